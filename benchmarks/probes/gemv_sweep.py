"""Batch-1 GEMV configs on this GPU, per projection of Llama-3.1-8B at TP=1, 2 and 4.

A sweep (one JSON line on stdout, a table on stderr): for each weight shape of one rank (qkv, o,
down, lm_head; gate_up through the fused SiLU-and-mul GEMV) the microseconds per call inside a
CUDA graph of calls that cycle through copies of the weight (together > 256 MB, so none stays in
L2, as in a decode step) for cuBLAS, for what layers/triton_gemv picks today, and for each
candidate (BLOCK_N, BLOCK_K, num_warps, num_stages); the best against the copy bandwidth.

    python benchmarks/probes/gemv_sweep.py [--tp 1,2,4]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from benchmarks.gpu_suite_parts import copy_bandwidth_tbps  # noqa: E402
from benchmarks.kernel_bench import capture, replay_ms  # noqa: E402
from radixlm.runtime.layers import triton_gemv  # noqa: E402

HIDDEN, INTER, VOCAB, HEADS, KV_HEADS, HEAD_DIM = 4096, 14336, 128256, 32, 8, 128
CONFIGS = [(1, 1024, 4, 4), (1, 2048, 8, 3), (2, 512, 2, 4), (2, 1024, 4, 3), (2, 1024, 8, 3),
           (4, 256, 2, 4), (4, 512, 2, 3), (4, 512, 4, 3), (4, 1024, 4, 3), (4, 1024, 8, 3),
           (8, 256, 2, 4), (8, 256, 4, 4), (8, 512, 4, 3), (8, 512, 8, 3), (16, 128, 2, 4),
           (16, 256, 4, 4), (4, 256, 1, 6), (8, 128, 1, 6), (2, 512, 1, 4), (4, 512, 2, 5),
           (8, 256, 2, 6)]


def shapes(tp: int) -> dict[str, tuple[int, int]]:
    """(N, K) of one rank's weights; gate_up is (2 I / tp, K) = [gate | up]."""
    return {"qkv": ((HEADS + 2 * KV_HEADS) * HEAD_DIM // tp, HIDDEN),
            "o": (HIDDEN, HEADS * HEAD_DIM // tp), "down": (HIDDEN, INTER // tp),
            "lm_head": (VOCAB // tp, HIDDEN), "gate_up": (2 * INTER // tp, HIDDEN)}


def per_call_us(calls) -> float:
    """Median us per call of `calls` (a list of thunks) replayed in one CUDA graph."""
    g = capture(lambda i: calls[i](), len(calls))
    ms = replay_ms(g)
    del g
    return ms * 1e3 / len(calls)


def sweep_shape(name: str, n: int, k: int, bw: float) -> dict:
    dev, dt = "cuda", torch.bfloat16
    nbytes = n * k * 2
    copies = max(4, -(-(256 << 20) // nbytes))
    ws = [torch.randn(n, k, device=dev, dtype=dt) * 0.02 for _ in range(copies)]
    x = torch.randn(1, k, device=dev, dtype=dt)
    silu = name == "gate_up"
    res: dict = {"N": n, "K": k, "MB": round(nbytes / 2**20, 1)}
    if silu:
        res["current_us"] = per_call_us([lambda w=w: triton_gemv.gate_up_silu(x, w) for w in ws])
        res["current_cfg"] = triton_gemv.silu_config(n, k, x.device)
        res["cublas_unfused_us"] = per_call_us([lambda w=w: F.linear(x, w) for w in ws])
    else:
        res["current_us"] = per_call_us([lambda w=w: triton_gemv.linear(x, w) for w in ws])
        res["current_cfg"] = triton_gemv.tuned_config(n, k, x.device)  # None: cuBLAS
        res["cublas_us"] = per_call_us([lambda w=w: F.linear(x, w) for w in ws])
    sweep = {}
    for cfg in CONFIGS:
        if cfg[1] > k:
            continue
        try:
            if silu:
                us = per_call_us([lambda w=w: triton_gemv.gemv_silu(x, w, cfg) for w in ws])
            else:
                us = per_call_us([lambda w=w: triton_gemv.gemv(x, w, config=cfg) for w in ws])
        except Exception as e:  # a config the compiler refuses (too many registers, ...)
            print(f"{name} {cfg}: {e!r}"[:200], file=sys.stderr)
            continue
        sweep[",".join(map(str, cfg))] = round(us, 2)
    best = min(sweep, key=sweep.get)
    res.update(best_cfg=[int(v) for v in best.split(",")], best_us=sweep[best],
               best_of_copy_bw=round(nbytes / (sweep[best] * 1e-6) / 1e12 / bw, 3),
               current_of_copy_bw=round(nbytes / (res["current_us"] * 1e-6) / 1e12 / bw, 3),
               sweep=sweep)
    for key in ("current_us", "cublas_us", "cublas_unfused_us"):
        if key in res:
            res[key] = round(res[key], 2)
    del ws
    torch.cuda.empty_cache()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tp", default="1,2,4")
    args = ap.parse_args()
    bw = copy_bandwidth_tbps()
    out = {"probe": "gemv_sweep", "device": torch.cuda.get_device_name(), "copy_TBps": round(bw, 3)}
    for tp in [int(t) for t in args.tp.split(",")]:
        for name, (n, k) in shapes(tp).items():
            r = sweep_shape(name, n, k, bw)
            out[f"tp{tp}.{name}"] = r
            print(f"tp{tp} {name:8s} {n}x{k}: current {r['current_us']} us {r['current_cfg']}, "
                  f"best {r['best_us']} {r['best_cfg']} ({r['best_of_copy_bw']} of copy bw), "
                  f"cuBLAS {r.get('cublas_us', r.get('cublas_unfused_us'))}",
                  file=sys.stderr, flush=True)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
