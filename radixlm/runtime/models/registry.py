"""Model architectures by HF `architectures[0]` name, imported lazily.

Each entry maps to "module:Class"; the class takes a `ModelConfig` and follows the contract of
`models/llama.py`: `forward(fb) -> (N, hidden)`, `compute_logits`, `load_weights` of HF-named
tensors, `init_dummy_weights`, `to_empty`. An architecture may also define
`check_supported(cfg, context_len)` (a staticmethod raising ValueError) for configurations it
cannot run exactly: a model we cannot run exactly is refused, never run approximately.
`attention_spec(cfg)` (a staticmethod or classmethod returning attention.base.AttentionSpec) says
what its attention computes (scale, per-layer sliding windows, logit soft-cap); without it the
runner uses a scale of head_dim**-0.5 and plain causal attention.
`mla_kv_dims(cfg)` (DeepSeek) returns (kv_lora_rank, rope_dim): the runner then keeps a latent
KV pool (mem_cache/kv_pool.MLAKVPool) and the MLA attention backend, and the model's attention
calls `forward_mla` (attention/mla_backend.py) instead of `forward`.
"""

from __future__ import annotations

import importlib

from radixlm.runtime.config import ModelConfig

ARCHITECTURES = {
    "LlamaForCausalLM": "radixlm.runtime.models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "radixlm.runtime.models.llama:LlamaForCausalLM",
    "Qwen2ForCausalLM": "radixlm.runtime.models.llama:LlamaForCausalLM",
    "Gemma2ForCausalLM": "radixlm.runtime.models.gemma:Gemma2ForCausalLM",
    "Gemma3ForCausalLM": "radixlm.runtime.models.gemma:Gemma3ForCausalLM",
    "Qwen3ForCausalLM": "radixlm.runtime.models.qwen3:Qwen3ForCausalLM",
    "Phi3ForCausalLM": "radixlm.runtime.models.phi3:Phi3ForCausalLM",
    "MixtralForCausalLM": "radixlm.runtime.models.moe:MixtralForCausalLM",
    "Qwen3MoeForCausalLM": "radixlm.runtime.models.moe:Qwen3MoeForCausalLM",
    "DeepseekV2ForCausalLM": "radixlm.runtime.models.deepseek:DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM": "radixlm.runtime.models.deepseek:DeepseekV3ForCausalLM",
    "LlavaForConditionalGeneration": "radixlm.runtime.models.llava:LlavaForConditionalGeneration",
}


def model_class(cfg: ModelConfig, context_len: int) -> type:
    """The class that runs `cfg`, after checking it can run it exactly up to `context_len`."""
    target = ARCHITECTURES.get(cfg.architecture)
    if target is None:
        raise ValueError(f"architecture {cfg.architecture!r} is not supported "
                         f"(supported: {', '.join(sorted(ARCHITECTURES))})")
    module, name = target.split(":")
    cls = getattr(importlib.import_module(module), name)
    check = getattr(cls, "check_supported", None)
    if check is not None:
        check(cfg, context_len)
    return cls
