"""Mistral and Qwen2 with a sliding window much shorter than the prompts, against HF transformers
5.23 in fp32 on tiny `save_pretrained` checkpoints: greedy tokens (C++ CPU and torch_native
attention) and prompt logprobs; radix cache on = off and chunked prefill = unchunked, with prompts
sharing a prefix longer than the window; HF's window really is W keys (not W +- 1)."""

from __future__ import annotations

import pytest
import torch
import transformers as tf

import arch_parity as ap

VOCAB = 256
WINDOW = 8
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, bos_token_id=None,
              eos_token_id=None)
CASES = {
    # every layer windowed
    "mistral": (tf.MistralForCausalLM, lambda w=WINDOW: tf.MistralConfig(
        **COMMON, num_hidden_layers=2, sliding_window=w), (WINDOW, WINDOW)),
    # layers >= max_window_layers windowed (save_pretrained writes them as layer_types)
    "qwen2": (tf.Qwen2ForCausalLM, lambda w=WINDOW: tf.Qwen2Config(
        **COMMON, num_hidden_layers=3, use_sliding_window=True, sliding_window=w,
        max_window_layers=1), (None, WINDOW, WINDOW)),
}


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    """(name, checkpoint folder, HF model, prompts, HF greedy outputs)."""
    cls, config, _ = CASES[request.param]
    case = ap.make_case(request.param, cls, config(), tmp_path_factory, VOCAB)
    assert max(map(len, case[3])) > 10 * WINDOW
    return case


@pytest.mark.parametrize("backend", ["auto", "torch_native"])
def test_greedy_and_prompt_logprobs_match_hf(case, backend):
    def checks(eng):
        assert eng.runner.attention_spec.windows == CASES[case[0]][2]
        assert not eng.runner.attn_backend.supports_shared_prefix
    ap.check_engine_matches_hf(case, backend, checks)


@pytest.mark.parametrize("variant", ap.VARIANTS, ids=ap.VARIANT_IDS)
def test_radix_off_and_chunked_prefill_agree(case, variant):
    """The prompts sharing a 40-token prefix (5 windows) hit the cache in check_greedy's second
    round; here the cache is off, or prefill runs in chunks of 16 (2 windows)."""
    ap.check_variant_matches_hf(case, **variant)


def test_hf_window_is_exactly_w_keys(case, tmp_path):
    """A model with the window one key longer or shorter gives other logprobs than HF's with W,
    so the parity above pins the convention (p - W, p]."""
    name, path, model, prompts, _ = case
    ids = torch.tensor([prompts[4]])  # 97 tokens
    with torch.no_grad():
        base = torch.log_softmax(model(ids).logits[0].float(), -1)
        for w in (WINDOW - 1, WINDOW + 1):
            other = CASES[name][0].from_pretrained(path, sliding_window=w).float().eval()
            assert other.config.sliding_window == w
            diff = (torch.log_softmax(other(ids).logits[0].float(), -1) - base).abs().max()
            assert diff > 1e-2, (w, float(diff))
