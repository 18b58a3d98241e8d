"""Tuned configs of the batch-1 int4 TMA GEMV (layers/triton_int4_tma.py) per GPU and layer
shape, as measured by benchmarks/probes/int4_gemv_bound.py (its full sweep writes a JSON file of
this table's form with --configs-out): {device name: {"tma": {"rows,K,group": config}}}, config
(BLOCK_N, BLOCK_K, warps, stages, programs an SM). RADIXLM_INT4_TMA_CONFIGS names such a file to
use instead of the table below (a sweep's output on a GPU not listed). A shape or GPU not found
runs at triton_int4_tma's DEFAULT (or its fallbacks); a config that does not fit the shape
(triton_int4_tma.supported) is skipped."""

from __future__ import annotations

import json
import os
from functools import lru_cache
from typing import Optional

ENV_VAR = "RADIXLM_INT4_TMA_CONFIGS"

# The full sweep of 2026-11-29 on an H200 (137 configs a shape, benchmarks/results/
# int4_gemv_bound-gpu.jsonl): Llama-3.1-8B's qkv, o, [gate | up] and down at group 128; us against
# DEFAULT's: gate_up 25.8 / 35.8, down 13.9 / 15.4, qkv 8.2 / 10.4, o 6.2 / 6.7 (several programs
# an SM: more warps in flight to hide the math's latency).
TUNED: dict = {
    "NVIDIA H200": {"tma": {
        "28672,4096,128": (32, 512, 2, 3, 8),
        "4096,14336,128": (32, 1024, 4, 3, 3),
        "6144,4096,128": (16, 1024, 4, 3, 6),
        "4096,4096,128": (32, 1024, 4, 3, 2),
    }},
}


@lru_cache(maxsize=None)
def _file_table(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def tuned_config(device_name: str, rows: int, k: int, group: int) -> Optional[tuple]:
    """The measured config for a layer of `rows` x K at `group` on `device_name`, or None."""
    path = os.environ.get(ENV_VAR)
    table = _file_table(path) if path else TUNED
    cfg = table.get(device_name, {}).get("tma", {}).get(f"{rows},{k},{group}")
    return tuple(cfg) if cfg is not None else None
