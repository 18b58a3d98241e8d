"""The on-disk cache of GGUF-derived artifacts (runtime/models/cache.py).

What a cache hit returns must be what the uncached path computes, bit for bit; a damaged entry
must be rebuilt, never used; an edited file must get a new entry. Weights and keys are tested on
a tiny GGUF written here (fast); the tokenizer on the bundled SmolLM2 file, built from the GGUF
once per module.
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import torch

from radixlm.runtime.models import cache, gguf_loader, loader
from radixlm.runtime.tokenizer_light import LightTokenizer

gguf = pytest.importorskip("gguf")

HIDDEN, HEADS, KV_HEADS, FFN, VOCAB = 64, 2, 1, 128, 96
HEAD_DIM = HIDDEN // HEADS


def write_tiny_gguf(path, seed: int = 0) -> str:
    """A 1-layer llama GGUF: F32 tensors plus Q8_0 ones, so dequantization is exercised."""
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(128)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    shapes = {  # torch (out, in) shapes
        "token_embd.weight": (VOCAB, HIDDEN), "blk.0.attn_norm.weight": (HIDDEN,),
        "blk.0.attn_q.weight": (HIDDEN, HIDDEN), "blk.0.attn_k.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
        "blk.0.attn_v.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
        "blk.0.attn_output.weight": (HIDDEN, HIDDEN), "blk.0.ffn_gate.weight": (FFN, HIDDEN),
        "blk.0.ffn_up.weight": (FFN, HIDDEN), "blk.0.ffn_down.weight": (HIDDEN, FFN),
        "blk.0.ffn_norm.weight": (HIDDEN,), "output_norm.weight": (HIDDEN,),
    }
    q8 = gguf.GGMLQuantizationType.Q8_0
    for name, shape in shapes.items():
        arr = rng.standard_normal(shape).astype(np.float32)
        if name in ("blk.0.attn_q.weight", "blk.0.ffn_down.weight"):
            w.add_tensor(name, gguf.quants.quantize(arr, q8), raw_dtype=q8)
        else:
            w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    d = tmp_path / "cache"
    monkeypatch.setenv("RADIXLM_CACHE_DIR", str(d))
    monkeypatch.delenv("RADIXLM_DISABLE_CACHE", raising=False)
    return d


@pytest.fixture
def tiny(tmp_path):
    return write_tiny_gguf(tmp_path / "tiny.gguf")


def uncached_weights(path, dtype):
    gguf_loader.open_gguf.cache_clear()  # re-read the file: it may have been edited in place
    return list(gguf_loader.iter_gguf_weights(path, dtype))


def assert_same_weights(a, b):
    """Same names, same order, same dtype and shape, same bits (NaN-safe)."""
    assert [n for n, _ in a] == [n for n, _ in b]
    for (name, x), (_, y) in zip(a, b):
        assert x.dtype == y.dtype and x.shape == y.shape, name
        bits = torch.int16 if x.element_size() == 2 else torch.int32
        assert torch.equal(x.contiguous().view(bits), y.contiguous().view(bits)), name


def entry_of(path) -> cache.GGUFCache:
    return cache.GGUFCache(path)


# --- weights and config ----------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_weights_hit_equals_uncached(cache_dir, tiny, dtype):
    ref = uncached_weights(tiny, dtype)
    cold = list(loader.iter_weights(tiny, "gguf", dtype))  # miss: built and written
    c = entry_of(tiny)
    assert os.path.isfile(c.weights_path(str(dtype).removeprefix("torch.")))
    warm = list(loader.iter_weights(tiny, "gguf", dtype))  # hit: read from the cache file
    assert_same_weights(ref, cold)
    assert_same_weights(ref, warm)
    assert len(ref) == 11


def test_config_hit_equals_uncached(cache_dir, tiny):
    ref = gguf_loader.gguf_to_hf_config(tiny)
    assert loader.load_hf_config(tiny) == ref  # miss
    assert os.path.isfile(os.path.join(entry_of(tiny).entry, "config.json"))
    assert loader.load_hf_config(tiny) == ref  # hit
    assert ref["hidden_size"] == HIDDEN and ref["vocab_size"] == VOCAB


@pytest.mark.parametrize("damage", ["truncate", "extend", "empty"])
def test_damaged_weights_are_rebuilt(cache_dir, tiny, damage):
    ref = uncached_weights(tiny, torch.bfloat16)
    list(loader.iter_weights(tiny, "gguf", torch.bfloat16))
    path = entry_of(tiny).weights_path("bfloat16")
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        if damage == "truncate":
            f.truncate(size - 100)
        elif damage == "extend":
            f.seek(0, os.SEEK_END)
            f.write(b"\0" * 64)
        else:
            f.truncate(0)
    again = list(loader.iter_weights(tiny, "gguf", torch.bfloat16))
    assert_same_weights(ref, again)  # not the damaged bytes
    assert os.path.getsize(path) == size  # and the file was rewritten whole
    assert_same_weights(ref, list(loader.iter_weights(tiny, "gguf", torch.bfloat16)))


def test_damaged_config_is_rebuilt(cache_dir, tiny):
    ref = loader.load_hf_config(tiny)
    path = os.path.join(entry_of(tiny).entry, "config.json")
    with open(path, "r+") as f:
        f.truncate(os.path.getsize(path) // 2)
    assert loader.load_hf_config(tiny) == ref
    with open(path) as f:
        assert json.load(f) == ref


def test_partial_read_leaves_no_cache_file(cache_dir, tiny):
    it = loader.iter_weights(tiny, "gguf", torch.bfloat16)
    next(it)
    it.close()  # the consumer stopped (e.g. load_weights raised): nothing may be committed
    entry = entry_of(tiny).entry
    assert not os.path.exists(entry_of(tiny).weights_path("bfloat16"))
    assert [f for f in os.listdir(entry) if f.startswith(".tmp")] == []


def test_key_follows_content(cache_dir, tiny, tmp_path):
    a = entry_of(tiny)
    # same bytes elsewhere, or the same file touched: same content hash, same entry
    copy = shutil.copy(tiny, tmp_path / "copy.gguf")
    assert entry_of(copy).entry == a.entry
    os.utime(tiny, ns=(1, 1))
    assert entry_of(tiny).entry == a.entry
    list(loader.iter_weights(tiny, "gguf", torch.float32))

    # edit one weight byte in place: new size/mtime -> re-hashed -> new entry, new weights
    r = gguf.GGUFReader(tiny)
    t = next(t for t in r.tensors if t.name == "output_norm.weight")
    offset = int(t.data_offset)
    del r
    with open(tiny, "r+b") as f:
        f.seek(offset)
        old = f.read(4)
        f.seek(offset)
        f.write(np.float32(123.0).tobytes() if old != np.float32(123.0).tobytes() else b"\0" * 4)
    b = entry_of(tiny)
    assert b.entry != a.entry
    edited = list(loader.iter_weights(tiny, "gguf", torch.float32))
    assert_same_weights(uncached_weights(tiny, torch.float32), edited)
    norm = dict(edited)["model.norm.weight"]
    assert norm[0].item() in (123.0, 0.0)


def test_unusable_cache_dir_falls_back(tmp_path, monkeypatch, tiny):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    monkeypatch.setenv("RADIXLM_CACHE_DIR", str(blocker))
    assert cache.try_cache(tiny) is None
    assert loader.load_hf_config(tiny) == gguf_loader.gguf_to_hf_config(tiny)
    assert_same_weights(uncached_weights(tiny, torch.bfloat16),
                        list(loader.iter_weights(tiny, "gguf", torch.bfloat16)))


# --- tokenizer (the bundled model) ---------------------------------------------------------------
TEXTS = [
    "What is the capital of France?", "", " ", "  leading and trailing  ", "tabs\tand\nnewlines\n\n",
    "héllo wörld — naïve café", "日本語のテキスト", "emoji 🤖👍🏽 and ZWJ 👩‍👩‍👧", "def f(x):\n    return x**2",
    "<|im_start|>user\nhi<|im_end|>", "<|endoftext|>", "12 + 7 = 19", "a" * 300,
]
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "12 + 7?"}],
]


@pytest.fixture(scope="module")
def smol():
    try:
        return loader.default_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def reference_tokenizer(smol):
    return cache.tokenizer_from_gguf(smol)  # the uncached path: transformers reads the GGUF


def assert_same_tokenizer(ref, tok):
    # a hit may serve the light class (no transformers import), checked against HF's on build
    assert type(tok) is type(ref) or isinstance(tok, LightTokenizer)
    assert tok.name_or_path == ref.name_or_path
    assert tok.chat_template == ref.chat_template
    assert tok.get_vocab() == ref.get_vocab()
    assert tok.added_tokens_decoder == ref.added_tokens_decoder
    for attr in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id", "all_special_ids",
                 "model_max_length", "clean_up_tokenization_spaces"):
        assert getattr(tok, attr) == getattr(ref, attr), attr
    for text in TEXTS:
        ids = ref.encode(text)
        assert tok.encode(text) == ids, text
        assert tok.encode(text, add_special_tokens=False) == ref.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == ref.decode(ids)
        assert tok.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True)
    for chat in CHATS:
        for gen in (True, False):
            kw = dict(add_generation_prompt=gen)
            assert tok.apply_chat_template(chat, tokenize=False, **kw) == \
                ref.apply_chat_template(chat, tokenize=False, **kw)
            assert list(tok.apply_chat_template(chat, tokenize=True, **kw)["input_ids"]) == \
                list(ref.apply_chat_template(chat, tokenize=True, **kw)["input_ids"])


def test_tokenizer_hit_equals_uncached(cache_dir, smol, reference_tokenizer, monkeypatch):
    built = []

    def build(path):  # the cache's miss path, without building the same tokenizer a second time
        built.append(path)
        return reference_tokenizer

    monkeypatch.setattr(cache, "tokenizer_from_gguf", build)
    loader.load_tokenizer(smol)  # miss: built, saved
    assert built == [smol]
    c = entry_of(smol)
    assert os.path.isfile(os.path.join(c.tokenizer_dir, "tokenizer.json"))
    warm = loader.load_tokenizer(smol)  # hit: from tokenizer.json + config + chat template
    assert built == [smol] and warm is not reference_tokenizer
    assert_same_tokenizer(reference_tokenizer, warm)


@pytest.mark.parametrize("victim", ["tokenizer.json", "chat_template.jinja", "MANIFEST.json"])
def test_damaged_tokenizer_is_rebuilt(cache_dir, smol, reference_tokenizer, monkeypatch, victim):
    built = []
    monkeypatch.setattr(cache, "tokenizer_from_gguf", lambda p: built.append(p) or reference_tokenizer)
    c = entry_of(smol)
    c.get_tokenizer()
    path = os.path.join(c.tokenizer_dir, victim)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    tok = c.get_tokenizer()
    assert len(built) == 2  # detected and rebuilt, not loaded
    assert_same_tokenizer(reference_tokenizer, cache.GGUFCache(smol).get_tokenizer())
    assert len(built) == 2 and tok is reference_tokenizer
