"""Llama with `attention_bias=True` (biases on q, k, v and o, as HF's LlamaAttention has them)
against HF transformers in fp32: greedy tokens and prompt logprobs."""

from __future__ import annotations

import transformers as tf

import arch_parity as ap

VOCAB = 256


def test_llama_attention_bias_matches_hf(tmp_path):
    cfg = tf.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, attention_bias=True, bos_token_id=None,
                         eos_token_id=None)
    model = ap.save_tiny(tf.LlamaForCausalLM, cfg, tmp_path)
    assert model.model.layers[0].self_attn.o_proj.bias is not None
    prompts = ap.prompts(VOCAB)[:5]
    eng = ap.make_engine(str(tmp_path))
    try:
        ap.check_greedy(eng, prompts, ap.hf_greedy(model, prompts))
        ap.check_prompt_logprobs(eng, model, prompts)
    finally:
        eng.shutdown()
