"""HF transformers' own GGUF loading of the bundled SmolLM2 (the reference the tests compare
with), without costs of transformers' loader that change nothing it builds: it parses the
file's metadata (49k vocabulary strings, 48k merges) once for the config and again for the
weights, ~5 s each, and rebuilds gguf's tensor-name map (a pure function of architecture and
layer count) for each of the 397 tensors, ~7 s. Within `shared_gguf_parsing()` the reader of a path
and the name map are made once, and each metadata value is decoded once (transformers decodes
every field, the 97k vocabulary and merge strings included, for the config and again for the
weights); every value and tensor still comes from transformers and gguf's own code (measured on
this 2-core VM, 2026-11-27: the model load 25.8 s -> 10.8 s, every tensor equal). The reader also
reads the file through a plain ndarray view of its np.memmap (same mapping, no copy): memmap's
slicing is Python code, and the header parse slices it ~1.7M times (~2.7 -> ~1.0 CPU-s)."""

from __future__ import annotations

import contextlib
import functools
import os

import torch

from radixlm.runtime.models.gguf_loader import plain_reader_class


@contextlib.contextmanager
def shared_gguf_parsing():
    import gguf

    from transformers import modeling_gguf_pytorch_utils as hf_gguf_utils

    reader_cls, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    # gguf's own reader, over a plain ndarray view of its memory map (same bytes; radixlm's
    # loader uses the same class for the same reason: the parse ~2.7 -> ~1.0 CPU-s)
    PlainArrayReader = plain_reader_class()

    parse_value = hf_gguf_utils._gguf_parse_value
    decoded: dict = {}

    def parse_value_once(value, data_type):
        # `value` is one of the cached reader's field parts: the same array object (alive while
        # the reader is) each time the same field is read, so its id names it.
        key = (id(value), tuple(data_type) if isinstance(data_type, list) else data_type)
        if key not in decoded:
            decoded[key] = (value, parse_value(value, data_type))
        return decoded[key][1]

    gguf.GGUFReader = functools.lru_cache(maxsize=2)(PlainArrayReader)  # one parse per path
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=8)(name_map)
    hf_gguf_utils._gguf_parse_value = parse_value_once
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader_cls, name_map
        hf_gguf_utils._gguf_parse_value = parse_value


def hf_model(gguf_path: str, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    d, f = os.path.split(gguf_path)
    with shared_gguf_parsing():
        return AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=dtype).eval()

