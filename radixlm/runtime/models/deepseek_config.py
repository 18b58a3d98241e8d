"""The DeepSeek config fields the model files read, with HF transformers 5.24's defaults where a
config.json omits one (DeepseekV2Config / DeepseekV3Config): a missing field means what it means
to HF (e.g. V3 without `routed_scaling_factor` scales by 2.5, without `q_lora_rank` has a q LoRA
of 1536), while a field present as null stays null (`q_lora_rank: null` = no q LoRA)."""

from __future__ import annotations

from radixlm.runtime.config import ModelConfig

_COMMON = dict(kv_lora_rank=512, q_lora_rank=1536, qk_nope_head_dim=128, qk_rope_head_dim=64,
               v_head_dim=128, moe_layer_freq=1, mlp_bias=False)
DEFAULTS = {
    "DeepseekV2ForCausalLM": dict(
        _COMMON, first_k_dense_replace=0, n_routed_experts=64, n_shared_experts=2,
        moe_intermediate_size=1407, routed_scaling_factor=1.0, topk_method="greedy",
        norm_topk_prob=False, n_group=None, topk_group=None, num_experts_per_tok=None),
    "DeepseekV3ForCausalLM": dict(
        _COMMON, first_k_dense_replace=3, n_routed_experts=256, n_shared_experts=1,
        moe_intermediate_size=2048, routed_scaling_factor=2.5, n_group=8, topk_group=4,
        num_experts_per_tok=8, norm_topk_prob=True, rope_interleave=True),
}


def fields(cfg: ModelConfig) -> dict:
    """cfg.hf over the architecture's defaults."""
    return {**DEFAULTS.get(cfg.architecture, {}), **cfg.hf}
