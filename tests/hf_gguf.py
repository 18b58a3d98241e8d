"""HF transformers' own GGUF loading of the bundled SmolLM2 (the reference the tests compare
with), without two costs of transformers' loader that change nothing it builds: it parses the
file's metadata (49k vocabulary strings, 48k merges) once for the config and again for the
weights, ~5 s each, and rebuilds gguf's tensor-name map (a pure function of architecture and
layer count) for each of the 397 tensors, ~7 s. Within `shared_gguf_parsing()` the reader of a path
and the name map are made once; every value and tensor still comes from transformers and gguf's
own code (measured on this 2-core VM, 2026-11-27: the model load 25.8 s -> 10.8 s, every tensor equal)."""

from __future__ import annotations

import contextlib
import functools
import os

import torch


@contextlib.contextmanager
def shared_gguf_parsing():
    import gguf

    reader_cls, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    gguf.GGUFReader = functools.lru_cache(maxsize=2)(reader_cls)  # one parse per path
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=8)(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader_cls, name_map


def hf_model(gguf_path: str, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    d, f = os.path.split(gguf_path)
    with shared_gguf_parsing():
        return AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=dtype).eval()

