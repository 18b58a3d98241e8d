"""Qwen3, Phi-3, Mixtral and Qwen3-MoE with an 8-token sliding window (prompts up to 150 tokens),
against HF transformers 5.23 in fp32 on tiny `save_pretrained` checkpoints: greedy tokens (C++
CPU and torch_native attention) and prompt logprobs; radix cache off and chunked prefill (16)
give the same tokens, with prompts sharing a prefix five windows long. Each case's window is
shown to change HF's output, so the parity is about the window."""

from __future__ import annotations

import pytest
import torch
import transformers as tf

import arch_parity as ap

VOCAB = 256
WINDOW = 8
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, bos_token_id=None,
              eos_token_id=None, num_hidden_layers=3)
MOE = dict(num_experts_per_tok=2, moe_intermediate_size=48)
CASES = {  # name: (HF class, config(window), windows per layer)
    # layers >= max_window_layers windowed (save_pretrained writes them as layer_types)
    "qwen3": (tf.Qwen3ForCausalLM, lambda w: tf.Qwen3Config(
        **COMMON, head_dim=24, use_sliding_window=True, sliding_window=w, max_window_layers=1),
        (None, WINDOW, WINDOW)),
    "phi3-partial": (tf.Phi3ForCausalLM, lambda w: tf.Phi3Config(
        **COMMON, pad_token_id=0, partial_rotary_factor=0.5, sliding_window=w), (WINDOW,) * 3),
    "mixtral": (tf.MixtralForCausalLM, lambda w: tf.MixtralConfig(
        **COMMON, num_local_experts=4, num_experts_per_tok=2, sliding_window=w), (WINDOW,) * 3),
    "qwen3moe": (tf.Qwen3MoeForCausalLM, lambda w: tf.Qwen3MoeConfig(
        **COMMON, **MOE, num_experts=4, use_sliding_window=True, sliding_window=w),
        (WINDOW,) * 3),
}


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    """(name, checkpoint folder, HF model, prompts, HF greedy outputs)."""
    cls, config, _ = CASES[request.param]
    case = ap.make_case(request.param, cls, config(WINDOW), tmp_path_factory, VOCAB)
    assert max(map(len, case[3])) > 10 * WINDOW
    return case


@pytest.mark.parametrize("backend", ["auto", "torch_native"])
def test_greedy_and_prompt_logprobs_match_hf(case, backend):
    def checks(eng):
        assert eng.runner.attention_spec.windows == CASES[case[0]][2]
    ap.check_engine_matches_hf(case, backend, checks)


@pytest.mark.parametrize("variant", ap.VARIANTS, ids=ap.VARIANT_IDS)
def test_radix_off_and_chunked_prefill_agree(case, variant):
    ap.check_variant_matches_hf(case, **variant)


def test_the_window_changes_hf_output(case):
    """The same weights with a window longer than any prompt (full attention) give other
    logprobs: HF applies the window for this model."""
    name, path, model, prompts, _ = case
    ids = torch.tensor([prompts[4]])  # 97 tokens
    full = CASES[name][0].from_pretrained(path, sliding_window=10_000).float().eval()
    with torch.no_grad():
        a = torch.log_softmax(model(ids).logits[0].float(), -1)
        b = torch.log_softmax(full(ids).logits[0].float(), -1)
    assert (a - b).abs().max() > 1e-2
