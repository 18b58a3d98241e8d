"""GGUF files (llama.cpp's format) read into the runtime's Hugging Face view of a model.

The rest of the runtime only knows HF names and HF `config.json` keys, so this module translates
both ways it has to:
  * metadata (`llama.block_count`, `tokenizer.ggml.eos_token_id`, ...) -> an HF config dict;
  * tensors (`blk.3.attn_q.weight`, quantized Q4_1 / Q8_0 / ...) -> (HF name, dense tensor).

Two things differ from a safetensors checkpoint beyond the names:
  1. GGUF lists a tensor's dims fastest-varying first, i.e. reversed from torch's (out, in).
  2. llama.cpp's converter reorders the rows of every head of q_proj / k_proj for `llama`-arch
     models, because ggml's rotary embedding rotates adjacent pairs (x[2i], x[2i+1]) while HF's
     rotates the two halves (x[i], x[i + d/2]). `unpermute_rotary` undoes that.
"""

from __future__ import annotations

import functools
import os
import re
from typing import TYPE_CHECKING, Any, Iterator

import numpy as np

if TYPE_CHECKING:  # torch is imported where tensors are made: the tokenizer-only processes
    import torch   # (server parent, detokenizer) read GGUF metadata without paying for torch

# GGUF architecture name -> (HF architectures[0], HF model_type, rows were permuted for rotary).
# llama.cpp's converter permutes q/k only for its Llama family; Qwen2 keeps HF's half-split order.
_ARCHS = {
    "llama": ("LlamaForCausalLM", "llama", True),
    "qwen2": ("Qwen2ForCausalLM", "qwen2", False),
}

# Per-layer tensor names: GGUF `blk.{i}.<key>` -> HF `model.layers.{i}.<value>`.
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


@functools.lru_cache(maxsize=1)
def plain_reader_class():
    # gguf.gguf_reader's, not gguf's own attribute, which cache.tokenizer_from_gguf swaps
    from gguf.gguf_reader import GGUFReader

    class PlainArrayReader(GGUFReader):
        """gguf's reader over a plain ndarray view of its np.memmap (same mapping, no copy):
        the header parse slices the file ~1.7M times, and a memmap's slicing and
        `__array_finalize__` are Python code, an ndarray's are not. The parse of SmolLM2 took
        ~2.7 -> ~1.0 CPU-s (2-core VM, 2026-11-27), every field and tensor equal."""

        @property
        def data(self):
            return self._plain_data

        @data.setter
        def data(self, mapped) -> None:
            self._plain_data = np.asarray(mapped)

    return PlainArrayReader


@functools.lru_cache(maxsize=2)
def open_gguf(path: str):
    """A `gguf.GGUFReader` for `path`, cached: parsing the header (the 49k-entry token and merge
    lists are parsed field by field) costs ~1 s on SmolLM2, and both the config and the weights
    need it. The reader memory-maps the file, so caching it holds no tensor data in RAM."""
    return plain_reader_class()(path)


def _field(reader, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def _f32(x: float) -> float:
    """GGUF stores floats as float32, so 1e-5 reads back as 9.99999974e-06. Rounding to the
    shortest decimal that survives float32 restores the value the HF config had."""
    return float(str(np.float32(x)))


def gguf_arch(reader) -> tuple[str, str, str, bool]:
    arch = _field(reader, "general.architecture")
    if arch not in _ARCHS:
        raise NotImplementedError(
            f"GGUF architecture {arch!r} is not supported (supported: {sorted(_ARCHS)})"
        )
    return (arch, *_ARCHS[arch])


def gguf_to_hf_config(path: str) -> dict[str, Any]:
    """The HF `config.json` equivalent of a GGUF file's metadata."""
    r = open_gguf(path)
    arch, hf_arch, model_type, _ = gguf_arch(r)
    tensor_names = {t.name for t in r.tensors}
    if "rope_freqs.weight" in tensor_names:
        # Llama-3.1-style rope scaling is baked into a per-frequency tensor that has no HF config
        # equivalent; loading without it would silently give wrong outputs.
        raise NotImplementedError(f"{path}: GGUF rope_freqs (llama3 rope scaling) is not supported")

    def meta(key: str, default: Any = None) -> Any:
        return _field(r, f"{arch}.{key}", default)

    heads = int(meta("attention.head_count"))
    tokens = r.fields.get("tokenizer.ggml.tokens")
    # The token list is authoritative; `{arch}.vocab_size` is optional in GGUF.
    vocab = len(tokens.data) if tokens is not None else meta("vocab_size")
    if vocab is None:
        vocab = int(next(t.shape[-1] for t in r.tensors if t.name == "token_embd.weight"))
    cfg: dict[str, Any] = {
        "architectures": [hf_arch],
        "model_type": model_type,
        "vocab_size": int(vocab),
        "hidden_size": int(meta("embedding_length")),
        "intermediate_size": int(meta("feed_forward_length")),
        "num_hidden_layers": int(meta("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta("attention.head_count_kv", heads)),
        "rms_norm_eps": _f32(meta("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": _f32(meta("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(meta("context_length", 4096)),
        # No separate output matrix: the LM head reuses the embedding (llama.cpp does the same).
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "hidden_act": "silu",
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
    }
    key_len = meta("attention.key_length")
    if key_len is not None:
        cfg["head_dim"] = int(key_len)
    scaling_type = meta("rope.scaling.type")
    if scaling_type not in (None, "none"):
        cfg["rope_scaling"] = {
            "rope_type": scaling_type,
            "factor": _f32(meta("rope.scaling.factor", 1.0)),
        }
        orig = meta("rope.scaling.original_context_length")
        if orig is not None:
            cfg["rope_scaling"]["original_max_position_embeddings"] = int(orig)
    for hf_key, gguf_key in (("bos_token_id", "bos"), ("eos_token_id", "eos"), ("pad_token_id", "padding")):
        tid = _field(r, f"tokenizer.ggml.{gguf_key}_token_id")
        if tid is not None:
            cfg[hf_key] = int(tid)
    return cfg


def hf_name(gguf_name: str) -> str:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; KeyError if unknown."""
    m = _LAYER_RE.fullmatch(gguf_name)
    if m is not None:
        layer, key, kind = m.groups()
        return f"model.layers.{layer}.{_LAYER_NAMES[key]}.{kind}"
    stem, _, kind = gguf_name.rpartition(".")
    return f"{_GLOBAL_NAMES[stem]}.{kind}"


def permute_rotary(w: np.ndarray, n_heads: int) -> np.ndarray:
    """HF -> GGUF row order (what llama.cpp's converter does), kept for tests.

    Within each head of d rows, HF row (half, i) -- half in {0, 1}, i < d/2 -- moves to row
    2*i + half, so the two members of each rotary pair become neighbours."""
    d = w.shape[0] // n_heads
    return w.reshape(n_heads, 2, d // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_rotary(w: np.ndarray, n_heads: int) -> np.ndarray:
    """GGUF -> HF row order, the inverse of `permute_rotary`: read each head's rows as
    (i, half) pairs and transpose back to (half, i). Works for weights (d*n, in) and biases (d*n,)."""
    d = w.shape[0] // n_heads
    return w.reshape(n_heads, d // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_weight_plan(path: str) -> list[tuple[str, tuple[int, ...]]]:
    """(HF name, torch shape) of every tensor `iter_gguf_weights` yields, in the same order,
    without dequantizing anything (the weight cache writes its header from this)."""
    r = open_gguf(path)
    plan = []
    for t in r.tensors:
        try:
            name = hf_name(t.name)
        except KeyError:
            raise NotImplementedError(f"{path}: no HF name for GGUF tensor {t.name!r}") from None
        plan.append((name, tuple(int(n) for n in reversed(t.shape))))
    return plan


def iter_gguf_weights(path: str, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, dense `dtype` tensor) for every tensor of the file, one at a time, so peak
    memory stays at one float32 tensor above the model's own weights."""
    import torch
    from gguf.quants import dequantize

    r = open_gguf(path)
    arch, _, _, permuted = gguf_arch(r)
    n_heads = int(_field(r, f"{arch}.attention.head_count"))
    n_kv = int(_field(r, f"{arch}.attention.head_count_kv", n_heads))
    for t in r.tensors:
        try:
            name = hf_name(t.name)
        except KeyError:
            raise NotImplementedError(f"{path}: no HF name for GGUF tensor {t.name!r}") from None
        # dequantize returns float32 with the rows already laid out as torch expects; the reshape
        # to the reversed GGUF shape only makes that explicit (and checks the element count).
        arr = dequantize(t.data, t.tensor_type).reshape(tuple(int(n) for n in reversed(t.shape)))
        if permuted and ".attn_q." in t.name:
            arr = unpermute_rotary(arr, n_heads)
        elif permuted and ".attn_k." in t.name:
            arr = unpermute_rotary(arr, n_kv)
        # F32 tensors come back as read-only views of the memory map: copy before torch owns them.
        arr = np.ascontiguousarray(arr, dtype=np.float32)
        if not arr.flags.writeable:
            arr = arr.copy()
        yield name, torch.from_numpy(arr).to(dtype)


def gguf_file_in(folder: str) -> str:
    """The single .gguf file in `folder`; errors when there are none or several."""
    found = sorted(f for f in os.listdir(folder) if f.endswith(".gguf"))
    if len(found) != 1:
        what = "no .gguf file" if not found else f"several .gguf files {found}"
        raise ValueError(f"{folder}: {what}; pass the .gguf file itself as the model path")
    return os.path.join(folder, found[0])


def iter_gguf_blocks(path: str, type_ids: set[int]) -> Iterator[tuple[str, int, np.ndarray]]:
    """(HF name, ggml type id, raw blocks (rows, row_bytes) uint8) for every tensor of the file
    stored in one of `type_ids`, still quantized (layers/quantized_linear.py keeps them so). Rows
    are independent runs of blocks along the input dim, so q/k rows are un-permuted for rotary
    exactly as the dequantized ones are. Views of the memory map where no row moves: copy before
    handing them to torch."""
    r = open_gguf(path)
    arch, _, _, permuted = gguf_arch(r)
    n_heads = int(_field(r, f"{arch}.attention.head_count"))
    n_kv = int(_field(r, f"{arch}.attention.head_count_kv", n_heads))
    for t in r.tensors:
        if int(t.tensor_type) not in type_ids or len(t.shape) != 2:
            continue
        arr = t.data  # (rows, row_bytes) uint8: gguf's reader gives byte rows for block types
        if permuted and ".attn_q." in t.name:
            arr = unpermute_rotary(arr, n_heads)
        elif permuted and ".attn_k." in t.name:
            arr = unpermute_rotary(arr, n_kv)
        yield hf_name(t.name), int(t.tensor_type), arr
