"""Is radixlm's CPU bf16 GEMM faster than oneDNN (or than a git revision's build of itself)?

radixlm's bf16 GEMM (csrc/cpu_gemm.cpp) against oneDNN on prepacked weights, in one process:
SmolLM2-135M's four projections of 30 layers (each layer its own weights, so they stream from
memory as in a real step) plus the 49152-row head, at decode and prefill row counts.

    .venv/bin/python benchmarks/probes/cpu_gemm_ab.py [--rows 1,8,32,64,512] [--rounds 8]
    .venv/bin/python benchmarks/probes/cpu_gemm_ab.py --base HEAD~1 [--rows 32]

The two alternate round by round (this machine's speed drifts by 10-30% between runs); the
comparison is the ratio of medians. Also reports how many outputs differ from oneDNN's (one bf16
rounding each: the kernels sum in different orders). With --base, the A side is radixlm's GEMM
built from that git revision's csrc/ and the B side the working tree's, both running the model's
own op mix (the gate/up projection paired, with the SiLU-and-mul epilogue); their outputs must be
bit-identical unless the summation changed. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

_ROOT = Path(__file__).resolve().parents[2]  # benchmarks/probes/ -> the repository
sys.path.insert(0, str(_ROOT))

from radixlm.runtime.layers import cpu_packed  # noqa: E402

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # qkv, o, gate_up, down
HEAD, LAYERS = (49152, 576), 30


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", default="1,8,32,64,512")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--result-file", default=None)
    p.add_argument("--base", default=None, help="git revision: own kernel at REV vs the tree")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.base:
        return compare_builds(args)
    if not cpu_packed.own_gemm_works() or not cpu_packed.packing_works():
        raise SystemExit("needs both radixlm's GEMM (AVX512-BF16 build) and oneDNN packing")
    g = torch.Generator().manual_seed(0)
    weights = [[(torch.randn(n, k, generator=g) * 0.05).bfloat16() for n, k in SHAPES]
               for _ in range(LAYERS)]
    head = (torch.randn(*HEAD, generator=g) * 0.05).bfloat16()
    onednn = [[torch.ops.mkldnn._reorder_linear_weight(w, 32) for w in ws] for ws in weights]
    own = [[cpu_packed.OwnPacked(w) for w in ws] for ws in weights]
    packs = {"onednn": (onednn, torch.ops.mkldnn._reorder_linear_weight(head, 32)),
             "own": (own, cpu_packed.OwnPacked(head))}
    report = {}
    for m in [int(r) for r in args.rows.split(",")]:
        xs = {k: torch.randn(m, k, generator=g).bfloat16() for k in (576, 1536)}
        times = {k: [] for k in packs}
        outs = {}
        for _ in range(args.rounds):
            for name, (layers, hp) in packs.items():
                t0 = time.perf_counter()
                res = [cpu_packed.linear(xs[k], pw, None)
                       for ws in layers for (n, k), pw in zip(SHAPES, ws)]
                res.append(cpu_packed.linear(xs[576], hp, None))
                times[name].append(time.perf_counter() - t0)
                outs[name] = res
        flops = 2 * m * (LAYERS * sum(n * k for n, k in SHAPES) + HEAD[0] * HEAD[1])
        med = {k: statistics.median(v) for k, v in times.items()}
        differ = sum(int((a != b).sum()) for a, b in zip(outs["own"], outs["onednn"]))
        total = sum(a.numel() for a in outs["own"])
        report[f"rows {m}"] = {
            "onednn_ms": round(med["onednn"] * 1e3, 2), "own_ms": round(med["own"] * 1e3, 2),
            "own_over_onednn": round(med["own"] / med["onednn"], 3),
            "own_gflops": round(flops / med["own"] / 1e9), "onednn_gflops": round(flops / med["onednn"] / 1e9),
            "outputs_differing": round(differ / total, 6)}
    from benchmarks.offline_throughput import emit_result, git_commit

    res = {"bench": "cpu_gemm_ab", "tree": git_commit(), "cases": report, "threads": args.threads,
           "shapes": "SmolLM2-135M: 30 x (960x576, 576x576, 3072x576, 576x1536) + head 49152x576"}
    return emit_result(res, args.result_file, __file__)


def compare_builds(args) -> dict:
    """radixlm's GEMM at args.base against the working tree's, on the model's op mix."""
    from benchmarks.probes.cpu_attention_ab import build, sources_at
    from benchmarks.offline_throughput import emit_result, git_commit

    builds = {"base": build("base", sources_at(args.base)), "tree": build("tree", _ROOT / "csrc")}
    g = torch.Generator().manual_seed(0)
    layers = []
    for _ in range(LAYERS):
        qkv, o, gate_up, down = [(torch.randn(n, k, generator=g) * 0.05).bfloat16()
                                 for n, k in SHAPES]
        layers.append((cpu_packed.OwnPacked(qkv), cpu_packed.OwnPacked(o),
                       cpu_packed.OwnPacked(gate_up, paired=True), cpu_packed.OwnPacked(down)))
    head = cpu_packed.OwnPacked((torch.randn(*HEAD, generator=g) * 0.05).bfloat16())

    def step(ops, x, xi):
        res = []
        for qkv, o, gate_up, down in layers:
            res.append(ops.gemm_bf16(x, qkv.data, qkv.n, None))
            res.append(ops.gemm_bf16(x, o.data, o.n, None))
            res.append(ops.gemm_bf16_silu(x, gate_up.data))
            res.append(ops.gemm_bf16(xi, down.data, down.n, None))
        res.append(ops.gemm_bf16(x, head.data, head.n, None))
        return res

    report = {}
    flops_row = 2 * (LAYERS * sum(n * k for n, k in SHAPES) + HEAD[0] * HEAD[1])
    for m in [int(r) for r in args.rows.split(",")]:
        x, xi = (torch.randn(m, k, generator=g).bfloat16() for k in (576, 1536))
        times = {k: [] for k in builds}
        outs = {}
        for _ in range(args.rounds):
            for tag, ops in builds.items():
                t0 = time.perf_counter()
                outs[tag] = step(ops, x, xi)
                times[tag].append(time.perf_counter() - t0)
        med = {k: statistics.median(v) for k, v in times.items()}
        same = all(torch.equal(a, b) for a, b in zip(outs["base"], outs["tree"]))
        report[f"rows {m}"] = {
            **{f"{k}_ms": round(v * 1e3, 2) for k, v in med.items()},
            "tree_over_base": round(med["tree"] / med["base"], 3),
            **{f"{k}_gflops": round(flops_row * m / v / 1e9) for k, v in med.items()},
            "bit_identical": same}
    res = {"bench": "cpu_gemm_ab", "base": args.base, "tree": git_commit(), "cases": report,
           "threads": args.threads, "ops": "model mix: qkv, o, gate_up paired + SiLU, down; head"}
    return emit_result(res, args.result_file, __file__)


if __name__ == "__main__":
    main()
