"""What a draft model (STANDALONE) will take, known before it loads: its config, its KV pool's
tokens and its bytes. The target's ModelRunner reads it on a GPU to leave the draft its share
of --mem-fraction-static (a module apart from draft_runner.py, which builds a ModelRunner: the
runner importing it would tie the two into a circle)."""

from __future__ import annotations

import torch

from radixlm.runtime.config import ModelConfig
from radixlm.runtime.mem_cache.kv_pool import KVPool
from radixlm.runtime.models import loader


def draft_load_format(args) -> str:
    """Random weights for the draft too when the target's are (`--load-format dummy`, as SGLang
    does): a config-only folder then serves as its own draft (the same seed, the same weights)."""
    if args.load_format == "dummy":
        return "dummy"
    return loader.resolve_load_format(args.speculative_draft_model_path)


def draft_config(args) -> ModelConfig:
    path = args.speculative_draft_model_path
    return ModelConfig.from_hf(loader.load_hf_config(path, draft_load_format(args)))


def pool_tokens(target_capacity: int, args, per_request: int) -> int:
    """The draft pool's tokens: the target's plus one chain (or a tree's beams: `per_request`
    draft inputs, SpecConfig.draft_inputs) per running request."""
    return target_capacity + (args.max_running_requests + 1) * (per_request + 1)


def draft_memory(args, dtype: torch.dtype) -> tuple[int, int]:
    """(KV bytes per token, weight bytes) the draft model will take, from its config: on a GPU
    the target's KV budget makes room for them (ModelRunner._kv_capacity), as both come out of
    --mem-fraction-static. Weights: embeddings (and an untied head), attention and MLP."""
    cfg = draft_config(args)
    h, layers = cfg.hidden_size, cfg.num_layers
    attn = h * cfg.head_dim * (2 * cfg.num_heads + 2 * cfg.num_kv_heads)
    params = (cfg.vocab_size * h * (1 if cfg.tie_word_embeddings else 2)
              + layers * (attn + 3 * h * cfg.intermediate_size))
    elem = torch.empty((), dtype=dtype).element_size()
    return KVPool.bytes_per_token(layers, cfg.num_kv_heads, cfg.head_dim, dtype), params * elem
