"""The configs and shape rules of the int4 wgmma GEMM (layers/gluon_int4_gemm.py: read its
docstring), torch only: which rows Int4Linear sends it (layers/int4_batch1.py), whether a layer
fits, and each call's config (the measured table per GPU, else the sweep's pattern)."""

from __future__ import annotations

import json
import os
from functools import lru_cache

import torch

from radixlm.runtime.layers.int4_mma_layout import GROUPS

# the rows Int4Linear sends to the kernel: below, the GEMV (triton_int4_mma); above, the Triton
# GEMM (the kernel itself takes any M, in tiles of 64 rows past 64: slower than the Triton GEMM
# for gate_up there, results/int4_wgmma_bound-gpu.jsonl)
MIN_M, MAX_M = 9, 64
SMS = 132  # H100 / H200 SXM
# config: (WARPS, RREP, STEP, SPLIT_K, MAXNREG, ASYNC) (gemm's docstring). The best by GPU,
# layer shape ("N,K,group") and batch tile (BM: "16", "32", "64" rows: 64 for every tile
# above) from benchmarks/probes/int4_wgmma_bound.py --configs-out; elsewhere default_config.
# H200, 2026-11-29 (12e2959, results/int4_wgmma_bound-gpu.jsonl; cuBLAS bf16 in brackets):
# qkv 10.8 / 12.5 / 18.9 us at 16 / 32 / 64 rows [15.8 / 16.5 / 16.6], o 8.3 / 10.0 / 13.3
# [13.5 / 13.9 / 12.1], gate_up 31.5 / 33.9 / 52.4 [63.4 / 57.5 / 61.7], down 16.9 / 20.0 /
# 32.3 [32.9 / 33.2 / 36.3]
TUNED: dict = {
    "NVIDIA H200": {
        "6144,4096,128": {"16": (8, 1, 128, 4), "32": (8, 1, 128),
                          "64": (8, 1, 64, None, 128, 1)},
        "4096,4096,128": {"16": (8, 1, 128), "32": (8, 1, 128), "64": (8, 1, 128, 4)},
        "28672,4096,128": {"16": (8, 1, 128, 1), "32": (8, 1, 128, 1),
                           "64": (8, 1, 64, 1, 128, 1)},
        "4096,14336,128": {"16": (8, 1, 128), "32": (8, 1, 128), "64": (8, 1, 128, 4)},
    },
}
ENV_VAR = "RADIXLM_INT4_WGMMA_CONFIGS"  # a sweep's table (same form) instead of TUNED


def bm_for(m: int) -> int:
    """The batch tile: 16, 32 or 64 rows (above 64: tiles of 64)."""
    return 16 if m <= 16 else 32 if m <= 32 else 64


def default_config(n: int, group: int, m: int) -> tuple:
    """The sweep's pattern: 8 warps (128 rows a program) where N allows; up to 32 rows one MMA
    chain a group, synchronous; 64-row tiles two steps of 64 k a group of 128, a group's MMAs
    in flight (ASYNC) and at most 128 registers (2 programs an SM)."""
    warps = 8 if n % 128 == 0 else 4
    if bm_for(m) <= 32:
        return (warps, 1, min(group, 128))
    return (warps, 1, min(group, 64), None, 128 if warps == 8 else None, 1)


def config_for(n: int, k: int, group: int, m: int, device_name: str = "") -> tuple:
    path = os.environ.get(ENV_VAR)
    table = _file_table(path) if path else TUNED
    cfg = table.get(device_name, {}).get(f"{n},{k},{group}", {}).get(str(bm_for(m)))
    return tuple(cfg) if cfg is not None else default_config(n, group, m)


@lru_cache(maxsize=None)
def _file_table(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def supported(n: int, k: int, group: int, x_dtype: torch.dtype, warps: int = 4,
              rrep: int = 1) -> bool:
    """Whole programs of 16 x warps x rrep rows, whole groups of 32 / 64 / 128, bf16 / fp16."""
    return (n % (16 * warps * rrep) == 0 and k % 64 == 0 and group in GROUPS
            and k % group == 0 and x_dtype in (torch.bfloat16, torch.float16))


def split_for(programs: int, groups: int) -> int:
    """Split-K doubled while the programs stay within ~2 an SM and a split keeps >= 4 groups."""
    split = 1
    while split < 8 and programs * split * 2 <= 2 * SMS and groups // (split * 2) >= 4:
        split *= 2
    return split


