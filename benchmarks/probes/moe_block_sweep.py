"""Time layers/triton_moe.experts over block shapes, warps and pipeline stages (CUDA), at batch 1
and a decode batch, on one MoE layer's shapes (default DeepSeek-V2-Lite: 64 experts, top-6,
hidden 2048, expert intermediate 1408), in CUDA graphs; one JSON line per config with the
routed expert bytes per second. BLOCK_K changes a row's summation order: a model keeps one.

    python benchmarks/probes/moe_block_sweep.py [--experts 64 --top-k 6 --hidden 2048 --inter 1408]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from benchmarks.fp8_linear import graph_time_us  # noqa: E402
from radixlm.runtime.layers import triton_moe as tm  # noqa: E402


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--top-k", type=int, default=6)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--inter", type=int, default=1408)
    p.add_argument("--batches", default="1,128")
    args = p.parse_args(argv)
    e, k, h, i = args.experts, args.top_k, args.hidden, args.inter
    dev = torch.device("cuda")
    gate_up = torch.randn(e, 2 * i, h, device=dev, dtype=torch.bfloat16) * 0.02
    down = torch.randn(e, h, i, device=dev, dtype=torch.bfloat16) * 0.02
    for t in map(int, args.batches.split(",")):
        x = torch.randn(t, h, device=dev, dtype=torch.bfloat16)
        idx = torch.rand(t, e, device=dev).topk(k, dim=-1)[1].sort(dim=-1)[0]
        w = torch.rand(t, k, device=dev)
        used = int(torch.unique(idx).numel())
        nbytes = used * 3 * i * h * 2
        for bn, bk, warps, stages in itertools.product((32, 64, 128), (64, 128), (4, 8), (2, 3, 4)):
            tm.BLOCK_N, tm.BLOCK_K, tm.NUM_WARPS, tm.NUM_STAGES = bn, bk, warps, stages
            try:
                us = graph_time_us(lambda _: tm.experts(x, gate_up, down, idx, w), 10, 50)
            except Exception as ex:  # (a config past the shared memory)
                print(json.dumps({"T": t, "BLOCK_N": bn, "BLOCK_K": bk, "warps": warps,
                                  "stages": stages, "error": str(ex)[:120]}))
                continue
            print(json.dumps({"T": t, "BLOCK_N": bn, "BLOCK_K": bk, "warps": warps,
                              "stages": stages, "us": round(us, 2),
                              "TBps": round(nbytes / us / 1e6, 3)}), flush=True)


if __name__ == "__main__":
    main()
