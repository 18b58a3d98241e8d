"""Fixtures of the GPU tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="session")
def tiny_llama_path(tmp_path_factory) -> str:
    """A random Llama written with HF transformers (vocab 512, 3 layers, 4 heads over 2 KV heads;
    std 0.08: peaked logits): for the speculative and hierarchical-cache tests on CUDA."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512,
                      num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=1024, initializer_range=0.08,
                      bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(cfg).save_pretrained(path)
    return str(path)
