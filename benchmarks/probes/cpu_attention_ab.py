"""Are the working tree's CPU attention kernels faster than a git revision's, and bit-identical?

A/B of two builds of the CPU attention kernels in one process: the csrc/ of a git revision
against the working tree's, on SmolLM2-135M's shapes (9 query heads, 3 KV heads, D 64, bf16 pool,
30 layers, each with its own pool so the KV streams from memory as in a real step).

    .venv/bin/python benchmarks/probes/cpu_attention_ab.py --base HEAD~1 [--rounds 12]

This machine's speed drifts by 10-30% between runs, so both builds run interleaved in one
process (round by round) and the comparison is their ratio. Each build loads under its own ops
namespace (RLM_OPS_NS), compiled once into /tmp/radixlm_ab_<tag> (~20-30 s per build). Prints
one JSON line: per case the min and median ms of each build, the ratio of medians, and whether
the outputs are identical (bit for bit) or how far apart.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

_ROOT = Path(__file__).resolve().parents[2]  # benchmarks/probes/ -> the repository
sys.path.insert(0, str(_ROOT))

from radixlm.runtime.attention import cpu_kernels as ck  # noqa: E402

LAYERS, HQ, HKV, D = 30, 9, 3, 64


def build(tag: str, csrc: Path):
    from torch.utils import cpp_extension

    cflags, ldflags = ck._flags()
    out = Path(tempfile.gettempdir()) / f"radixlm_ab_{tag}"
    out.mkdir(exist_ok=True)
    os.environ["PATH"] += os.pathsep + os.path.dirname(sys.executable)  # the venv's ninja
    # the sources of today's build that the revision has (an older one may lack some)
    sources = [str(csrc / f) for f in ck._SOURCES if (csrc / f).exists()]
    cpp_extension.load(name=f"rlm_ab_{tag}", sources=sources,
                       extra_cflags=cflags + [f"-DRLM_OPS_NS=rlm_ab_{tag}"],
                       extra_ldflags=ldflags, extra_include_paths=[str(csrc)],
                       build_directory=str(out), is_python_module=False)
    return getattr(torch.ops, f"rlm_ab_{tag}")


def sources_at(rev: str) -> Path:
    """csrc/ of git revision `rev`, written to a temp dir."""
    d = Path(tempfile.mkdtemp(prefix="radixlm_csrc_"))
    names = subprocess.run(["git", "ls-tree", "--name-only", rev, "csrc/"], cwd=_ROOT, check=True,
                           capture_output=True, text=True).stdout.split()
    for name in names:
        blob = subprocess.run(["git", "show", f"{rev}:{name}"], cwd=_ROOT, check=True,
                              capture_output=True).stdout
        (d / Path(name).name).write_bytes(blob)
    return d


def cases(n_slots: int = 40000):
    """(name, op, args builder) for decode B=32 x 230 keys, decode B=1 x 2000, extend 8 x 200."""
    g = torch.Generator().manual_seed(0)
    pools = [(torch.randn(n_slots, HKV, D, generator=g).bfloat16(),
              torch.randn(n_slots, HKV, D, generator=g).bfloat16()) for _ in range(LAYERS)]
    e_i, e_f = torch.empty(0, dtype=torch.int64), torch.empty(0)
    r2t = torch.zeros(32, 512, dtype=torch.int64)
    for b in range(32):  # a prompt of 200 contiguous slots, then 30 decode slots interleaved
        r2t[b, :200] = torch.arange(b * 200 + 1000, (b + 1) * 200 + 1000)
        r2t[b, 200:230] = torch.arange(30) * 32 + b + 20000
    q32 = torch.randn(32, HQ, D, generator=g).bfloat16()
    r1 = torch.zeros(1, 4096, dtype=torch.int64)
    r1[0, :2000] = torch.arange(1000, 3000)
    q1 = torch.randn(1, HQ, D, generator=g).bfloat16()
    qe = torch.randn(1600, HQ, D, generator=g).bfloat16()
    indptr = torch.arange(0, 1601, 200)
    return pools, [
        ("decode 32 x 230 keys", "decode", q32,
         lambda q, k, v, out: (q, k, v, r2t, torch.arange(32), e_i,
                               torch.full((32,), 230, dtype=torch.int64), 0.125, 0, 0.0, out, e_f)),
        ("decode 1 x 2000 keys", "decode", q1,
         lambda q, k, v, out: (q, k, v, r1, torch.arange(1), e_i, torch.tensor([2000]), 0.125, 0,
                               0.0, out, e_f)),
        ("extend 8 x 200 causal", "extend", qe,
         lambda q, k, v, out: (q, k, v, r2t[:8], torch.arange(8), indptr, e_i,
                               torch.full((8,), 200, dtype=torch.int64), True, 0.125, 0, 0.0, out,
                               e_f)),
    ]


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--base", default="HEAD", help="git revision of the A build (B: working tree)")
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--result-file", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    builds = {"base": build("base", sources_at(args.base)), "tree": build("tree", _ROOT / "csrc")}
    pools, todo = cases()
    report = {}
    for name, op, q, make in todo:
        times = {k: [] for k in builds}
        outs = {}
        for _ in range(args.rounds):
            for tag, ops in builds.items():
                out = torch.empty_like(q)
                fn = getattr(ops, op)
                t0 = time.perf_counter()
                for k, v in pools:
                    fn(*make(q, k, v, out))
                times[tag].append(time.perf_counter() - t0)
                outs[tag] = out
        med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        diff = (outs["base"].float() - outs["tree"].float()).abs().max().item()
        report[name] = {**{f"{k}_min_ms": round(min(v) * 1e3, 2) for k, v in times.items()},
                        **{f"{k}_median_ms": round(m, 2) for k, m in med.items()},
                        "tree_over_base": round(med["tree"] / med["base"], 3),
                        "max_abs_diff": diff}
    from benchmarks.offline_throughput import emit_result, git_commit

    rev = subprocess.run(["git", "rev-parse", "--short", args.base], cwd=_ROOT,
                         capture_output=True, text=True).stdout.strip()
    res = {"bench": "cpu_attention_ab", "base": f"{args.base} ({rev})",
           "tree": git_commit(), "cases": report,
           "layers": LAYERS, "heads": [HQ, HKV, D], "threads": args.threads}
    return emit_result(res, args.result_file, __file__)


if __name__ == "__main__":
    main()
