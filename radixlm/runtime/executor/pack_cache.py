"""The packed bf16 weights of layers/cpu_packed kept in the GGUF's start-up cache entry
(models/cache.py), so that a warm start maps them instead of packing them again.

Why: on a CPU with native bf16 matmul a GGUF model keeps dense bf16 weights for many-row
inputs (quantized_linear.keep_dense_rows), and packing them for radixlm's GEMM was the largest
part of a warm `Engine()`: 0.93 s of 2.29 s for SmolLM2 (2-core EPYC, 2026-11-27), a transposing
copy of ~270 MB. The packs are a pure function of the weights, and those come from the same
cache entry (its dense weights file), so the entry is their key; the file name carries the pack
layout's version. A pack is taken back only where cpu_packed.adopt agrees that pack() would make
one of that shape now; anything else is packed as before. Views over a private memory map
(models/safetensors_stream.map_safetensors): pages are read when the first many-row input uses
them, never written back. Weight updates (update_weights_from_disk) repack from the new weights
and never read this file.
"""

from __future__ import annotations

import logging
import os
from typing import Optional

from torch import nn

from radixlm.runtime.layers import cpu_packed

logger = logging.getLogger(__name__)

# Bump when OwnPacked's layout changes: older files are then not found.
LAYOUT = "own48-pair64-v1"


def _path(model_path: str, load_format: str) -> Optional[str]:
    """The packs file of a GGUF model's cache entry, or None (not a GGUF, cache off)."""
    if load_format != "gguf":
        return None
    from radixlm.runtime.layers.quantized_linear import gguf_file
    from radixlm.runtime.models import cache

    c = cache.try_cache(gguf_file(model_path))
    return None if c is None else os.path.join(c.entry, f"packs-{LAYOUT}.safetensors")


def convert_model(model: nn.Module, model_path: str, load_format: str) -> int:
    """cpu_packed.convert_model, taking the packs of an earlier start where the cache has them
    and saving them for the next one where it had none."""
    path = _path(model_path, load_format)
    saved = None
    if path is not None:
        from radixlm.runtime.models.safetensors_stream import map_safetensors

        mapped = map_safetensors(path)
        saved = dict(mapped) if mapped is not None else None
    n = cpu_packed.convert_model(model, saved)
    if path is not None and saved is None:
        _save(path, cpu_packed.own_packs(model))
    return n


def _save(path: str, packs: dict) -> None:
    if not packs:
        return
    from safetensors.torch import save

    from radixlm.runtime.models.safetensors_stream import atomic_file

    try:
        with atomic_file(path) as f:
            f.write(save({n: t.contiguous() for n, t in packs.items()}))
    except OSError as e:
        logger.warning("could not write packed weights to the radixlm cache (%s): %s", path, e)
