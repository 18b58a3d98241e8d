"""Few-row GEMMs on CUDA: layers/triton_skinny.py's configs against cuBLAS and the batch-1 GEMV.

    python benchmarks/probes/skinny_sweep.py [--rows 1,2,5,8,9,16] [--sweep-rows 5]

Llama-3.1-8B's shapes (bf16). Each call reads its weights from DRAM (copies cycled past the L2)
and runs inside a CUDA graph of 24 calls (what a decode step's graph replays), so launch costs do
not count. First a sweep of (BLOCK_N, BLOCK_K, warps, stages) at --sweep-rows rows per shape,
then the best config and the shipped one (triton_skinny.tuned_config) at every --rows count
against cuBLAS (F.linear; for gate_up: F.linear then SiLU-and-mul) and, at one row, the GEMV.
One JSON line per shape: us per call and the GB/s the weights stream at.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from radixlm.runtime.layers import triton_gemv, triton_ops, triton_skinny  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
          "down": (4096, 14336), "lm_head": (128256, 4096)}
CALLS = 24


def timed(fn, weights) -> float:
    """us per call of fn(w), cycling through `weights`, inside one CUDA graph of CALLS calls."""
    for w in weights[:2]:
        fn(w)  # compile / autotune outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(CALLS):
            fn(weights[i % len(weights)])
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (10 * CALLS)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,2,4,5,8,9,16")
    ap.add_argument("--sweep-rows", type=int, default=5)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    args = ap.parse_args(argv)
    dev, dt = "cuda", torch.bfloat16
    grid = list(itertools.product((16, 32, 64), (128, 256, 512), (4, 8), (3, 4)))
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        silu = name == "gate_up"
        copies = max(2, int(200e6 // (n * k * 2)) + 1)  # > the L2 (50 MB) between reuses
        weights = [torch.randn(n, k, device=dev, dtype=dt) / k ** 0.5 for _ in range(copies)]
        mb = n * k * 2 / 1e6

        def skinny(x, cfg):
            return lambda w: triton_skinny.matmul(x, w, config=cfg, silu=silu)

        def cublas(x):
            if silu:
                return lambda w: triton_ops.silu_and_mul(F.linear(x, w))
            return lambda w: F.linear(x, w)

        x = torch.randn(args.sweep_rows, k, device=dev, dtype=dt)
        sweep = {}
        for cfg in grid:
            try:
                sweep[cfg] = timed(skinny(x, cfg), weights)
            except Exception as e:  # (out of shared memory / registers for this tile)
                sweep[cfg] = float("inf")
                print(f"# {name} {cfg}: {type(e).__name__}", file=sys.stderr)
        best = min(sweep, key=sweep.get)
        shipped = triton_skinny.tuned_config(n, k, silu)
        res = {"shape": name, "n": n, "k": k, "weights_MB": round(mb, 1),
               "best_config": best, "shipped_config": shipped,
               "sweep_top5": sorted(((round(v, 2), c) for c, v in sweep.items()))[:5],
               "device": torch.cuda.get_device_name()}
        for m in [int(r) for r in args.rows.split(",")]:
            x = torch.randn(m, k, device=dev, dtype=dt)
            row = {"cublas_us": round(timed(cublas(x), weights), 2)}
            if m == 1:
                if silu:
                    cfg = triton_gemv.silu_config(n, k)
                    row["gemv_us"] = round(timed(lambda w: triton_gemv.gemv_silu(x, w, cfg),
                                                 weights), 2)
                else:
                    cfg = triton_gemv.tuned_config(n, k)
                    row["gemv_us"] = round(timed(lambda w: triton_gemv.gemv(x, w, config=cfg),
                                                 weights), 2)
            row["best_us"] = round(timed(skinny(x, best), weights), 2)
            if shipped is not None and shipped != best:
                row["shipped_us"] = round(timed(skinny(x, shipped), weights), 2)
            row["best_GBps"] = round(mb * 1e3 / row["best_us"], 0)
            res[f"m{m}"] = row
        print(json.dumps(res), flush=True)
        del weights
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
