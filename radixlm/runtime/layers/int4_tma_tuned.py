"""Tuned configs of the batch-1 int4 TMA GEMV (layers/triton_int4_tma.py) per GPU and layer
shape, as measured by benchmarks/probes/int4_gemv_bound.py (its full sweep writes a JSON file of
this table's form with --configs-out): {device name: {kind: {"rows,K,group": config}}}, kind
"tma" (exact products) or "h2" (packed fp16 products), config (BLOCK_N, BLOCK_K, warps, stages,
programs an SM). RADIXLM_INT4_TMA_CONFIGS names such a file to use instead of the table below
(a sweep's output on a GPU not listed). A shape or GPU not found runs at triton_int4_tma's
DEFAULT (or its fallbacks); a config that does not fit the shape (triton_int4_tma.supported)
is skipped."""

from __future__ import annotations

import json
import os
from functools import lru_cache
from typing import Optional

ENV_VAR = "RADIXLM_INT4_TMA_CONFIGS"

# (measured sweeps; see benchmarks/results/int4_gemv_bound-gpu.jsonl)
TUNED: dict = {}


@lru_cache(maxsize=None)
def _file_table(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def tuned_config(device_name: str, kind: str, rows: int, k: int, group: int) -> Optional[tuple]:
    """The measured config for a layer of `rows` x K at `group` on `device_name`, or None."""
    path = os.environ.get(ENV_VAR)
    table = _file_table(path) if path else TUNED
    cfg = table.get(device_name, {}).get(kind, {}).get(f"{rows},{k},{group}")
    return tuple(cfg) if cfg is not None else None
