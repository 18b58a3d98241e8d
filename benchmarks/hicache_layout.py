"""Micro benchmark of the host pool's copies (mem_cache/host_pool.py): loads (host -> device) and
backups (device -> host) of N runs of consecutive host slots, this checkout's slot-major host pool
against a baseline commit's (by default 5ead5ac, the last layer-major one), in one sitting, the two
alternated so that a loaded machine slows both alike. One JSON line per arm to stdout (and to
benchmarks/results/hicache_layout-<cpu|gpu>.jsonl with --save).

    python benchmarks/hicache_layout.py                       # CPU: 8B shape, 16 runs x 128
    python benchmarks/hicache_layout.py --device cuda --runs 16 32 --run-tokens 64 1536 \
        --baseline-file old_host_pool.py   # a copy without git history

The baseline's KVMover runs on this checkout's device pool (its k_buffers are views of one tensor
now; each is still a contiguous (capacity + 1, H, D) buffer, as the old mover expects)."""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from radixlm.runtime.mem_cache import host_pool as new_host_pool  # noqa: E402
from radixlm.runtime.mem_cache.kv_mover import KVMover  # noqa: E402
from radixlm.runtime.mem_cache.kv_pool import KVPool  # noqa: E402

MODULE = "radixlm/runtime/mem_cache/host_pool.py"


def load_baseline(rev: str, path=None):
    """The old host_pool module: from a file (a machine without the git history), else git."""
    if path is not None:
        src = open(path).read()
    else:
        src = subprocess.run(["git", "-C", ROOT, "show", f"{rev}:{MODULE}"], check=True,
                             capture_output=True, text=True).stdout
    spec = importlib.util.spec_from_loader("baseline_host_pool", loader=None)
    mod = importlib.util.module_from_spec(spec)
    exec(compile(src, f"{rev}:{MODULE}", "exec"), mod.__dict__)
    return mod


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_op(fn, device, repeats: int) -> float:
    """Median seconds of fn() (run once first to warm caches and allocators)."""
    fn()
    sync(device)
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync(device)
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--baseline", default="5ead5ac",
                    help="git revision of the old host pool (5ead5ac: the last layer-major one)")
    ap.add_argument("--baseline-file", help="the old host_pool.py itself (`git show "
                    "5ead5ac:radixlm/runtime/mem_cache/host_pool.py > FILE`), where git is not")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--runs", type=int, nargs="+", default=[16])
    ap.add_argument("--run-tokens", type=int, nargs="+", default=[128])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3, help="old/new alternations")
    ap.add_argument("--save", action="store_true")
    args = ap.parse_args()
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    old_host_pool = load_baseline(args.baseline, args.baseline_file)
    need = max(r * t for r in args.runs for t in args.run_tokens)
    capacity = 2 * need + 64  # runs spaced by a gap, so they stay separate runs
    pool = KVPool(capacity, args.layers, args.kv_heads, args.head_dim, dtype, device)
    pool.kv.normal_()
    movers = {}
    for name, mod, mover in (("old", old_host_pool, old_host_pool.KVMover),
                             ("new", new_host_pool, KVMover)):  # (the mover: kv_mover.py now)
        host = mod.HostKVPool(capacity, pool, device)
        movers[name] = mover(pool, host, device)
    token_bytes = movers["new"].host.token_bytes
    commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip()
    base = args.baseline if args.baseline_file is None else f"{args.baseline} (file)"
    lines = []
    for runs in args.runs:
        for run_tokens in args.run_tokens:
            host_idx = torch.cat([torch.arange(1 + i * 2 * run_tokens, 1 + i * 2 * run_tokens
                                               + run_tokens) for i in range(runs)])
            n = host_idx.numel()
            dev_idx = (torch.randperm(capacity)[:n] + 1).to(device)
            times = {name: {"load": [], "backup": []} for name in movers}
            for _ in range(args.rounds):
                for name, mover in movers.items():
                    def load():
                        mover.to_device(host_idx, dev_idx)
                        if hasattr(mover, "take_layer_events"):  # the layer-major baseline's
                            mover.take_layer_events()
                        mover.complete()

                    def backup():
                        mover.to_host(dev_idx, host_idx)
                        mover.complete()

                    times[name]["load"].append(time_op(load, device, args.repeats))
                    times[name]["backup"].append(time_op(backup, device, args.repeats))
            for name in movers:
                load_s = statistics.median(times[name]["load"])
                backup_s = statistics.median(times[name]["backup"])
                line = {"benchmark": "hicache_layout", "arm": name,
                        "layout": "layer-major" if name == "old" else "slot-major",
                        "git_commit": commit if name == "new" else base,
                        "device": (torch.cuda.get_device_name(device) if device.type == "cuda"
                                   else "cpu"), "torch_threads": torch.get_num_threads(),
                        "layers": args.layers, "kv_heads": args.kv_heads,
                        "head_dim": args.head_dim, "dtype": args.dtype, "runs": runs,
                        "run_tokens": run_tokens, "bytes": n * token_bytes,
                        "load_s": round(load_s, 6), "backup_s": round(backup_s, 6),
                        "load_GBps": round(n * token_bytes / load_s / 1e9, 2),
                        "backup_GBps": round(n * token_bytes / backup_s / 1e9, 2),
                        "load_avg": list(os.getloadavg()),
                        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
                            timespec="seconds")}
                lines.append(line)
                print(json.dumps(line), flush=True)
    if args.save:
        kind = "gpu" if device.type == "cuda" else "cpu"
        with open(os.path.join(ROOT, "benchmarks", "results",
                               f"hicache_layout-{kind}.jsonl"), "a") as f:
            for line in lines:
                f.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    main()
