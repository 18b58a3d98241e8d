"""DeepSeek-V2 / V3 (`DeepseekV2ForCausalLM`, `DeepseekV3ForCausalLM`): multi-head latent
attention (MLA) and a mixture of experts with shared experts, as HF transformers 5.24 computes
them (its modeling_deepseek_v2/_v3 are the reference; tests/unit/test_model_parity_deepseek.py).

Attention, per token (H heads, r = kv_lora_rank, dn/dr = qk_nope/rope_head_dim, dv = v_head_dim):
  q = q_proj(x), or q_b_proj(q_a_layernorm(q_a_proj(x))) with q LoRA     (H, dn + dr)
  [c_kv | k_pe] = kv_a_proj_with_mqa(x); c_kv = kv_a_layernorm(c_kv)      (r), (dr)
  q_pe, k_pe rotated (models/deepseek_rope.py; k_pe is one head shared by all)
  kv_b_proj (H (dn + dv), r) holds per head W_UK (dn, r) then W_UV (dv, r).
Only [c_kv | k_pe] (r + dr values) goes into the KV pool (mem_cache/kv_pool.MLAKVPool); the
backend (attention/mla_backend.py) attends over it, absorbed or expanded, and returns
(T, H, dv) for o_proj. Softmax scale: (dn + dr)**-0.5 times the YaRN mscale**2.

Layers: layer i has the MoE (models/deepseek_moe.py) when i >= first_k_dense_replace and
i % moe_layer_freq == 0 (DeepSeek's own rule; HF 5.24 ignores moe_layer_freq, which is 1 in every
released config), else the dense MLP of intermediate_size. V3 differs from V2 only in routing.
Not loaded: the multi-token-prediction layers past num_hidden_layers (V3's layer 61).
"""

from __future__ import annotations

import re
from typing import Iterable, Optional

import torch
from torch import nn

from radixlm.runtime.attention.base import AttentionSpec
from radixlm.runtime.config import ModelConfig
from radixlm.runtime.executor.forward_batch import ForwardBatch
from radixlm.runtime.models import arch_support
from radixlm.runtime.models.deepseek_config import fields
from radixlm.runtime.models.deepseek_moe import DeepseekMoE
from radixlm.runtime.models.deepseek_rope import (ROPE_TYPES, DeepseekRope, apply_rope, rope_kind,
                                                  softmax_scale)
from radixlm.runtime.models.llama import (MLP, Embedding, Linear, LlamaForCausalLM, RMSNorm,
                                          _fused_ops)
from radixlm.runtime.models.moe import MoeWeights


class Weight(nn.Module):
    """A bare weight (kv_b_proj): the attention reads its rows per head as W_UK / W_UV instead of
    calling it, so it is not an nn.Linear (the CPU GEMM converters swap those for other types)."""

    def __init__(self, rows: int, cols: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, cols))


class MLAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        hf = fields(cfg)
        self.layer_id, self.h = layer_id, cfg.num_heads
        self.dn, self.dr, self.dv = hf["qk_nope_head_dim"], hf["qk_rope_head_dim"], hf["v_head_dim"]
        self.r, self.q_lora = hf["kv_lora_rank"], hf["q_lora_rank"]
        # V2 always rotates adjacent pairs; V3 does with rope_interleave (its default)
        self.interleaved = cfg.architecture != "DeepseekV3ForCausalLM" or bool(hf["rope_interleave"])
        bias, hidden, qd = cfg.attention_bias, cfg.hidden_size, self.h * (self.dn + self.dr)
        if self.q_lora is None:
            self.q_proj = Linear(hidden, qd, bias=False)
        else:
            self.q_a_proj = Linear(hidden, self.q_lora, bias=bias)
            self.q_a_layernorm = RMSNorm(self.q_lora, 1e-6)  # HF's default eps, not rms_norm_eps
            self.q_b_proj = Linear(self.q_lora, qd, bias=False)
        self.kv_a_proj_with_mqa = Linear(hidden, self.r + self.dr, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.r, 1e-6)
        self.kv_b_proj = Weight(self.h * (self.dn + self.dv), self.r)
        self.o_proj = Linear(self.h * self.dv, hidden, bias=bias)

    def forward(self, x: torch.Tensor, cos_sin, fb: ForwardBatch) -> torch.Tensor:
        t = x.shape[0]
        q = self.q_proj(x) if self.q_lora is None else self.q_b_proj(
            self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(t, self.h, self.dn + self.dr)
        q_nope, q_pe = q.split([self.dn, self.dr], dim=-1)
        kv = self.kv_a_proj_with_mqa(x)  # (T, r + dr)
        q_pe = apply_rope(q_pe, *cos_sin, self.interleaved)  # (T, H, dr)
        ops = _fused_ops(kv) if kv.is_cuda else None
        if ops is not None:  # the norm, the rope, the cat and the pool's write in one kernel
            ops.mla_latent_store(
                kv, self.r, self.kv_a_layernorm.weight, self.kv_a_layernorm.eps, *cos_sin,
                self.interleaved, fb.attn_backend.kv_pool.latent_buffers[self.layer_id],
                fb.out_cache_loc)
            latent = None  # (written: forward_mla skips its write)
        else:
            c_kv, k_pe = kv.split([self.r, self.dr], dim=-1)
            k_pe = apply_rope(k_pe.unsqueeze(1), *cos_sin, self.interleaved)[:, 0]  # (T, dr)
            latent = torch.cat((self.kv_a_layernorm(c_kv), k_pe), dim=-1)  # (T, r + dr)
        w = self.kv_b_proj.weight.view(self.h, self.dn + self.dv, self.r)
        w_uk, w_uv = w[:, : self.dn], w[:, self.dn :]  # (H, dn, r), (H, dv, r)
        o = fb.attn_backend.forward_mla(q_nope, q_pe, latent, self.layer_id, fb, w_uk, w_uv)
        return self.o_proj(o.reshape(t, self.h * self.dv))


def is_moe_layer(cfg: ModelConfig, i: int) -> bool:
    hf = fields(cfg)
    return (hf["n_routed_experts"] is not None and i >= (hf["first_k_dense_replace"] or 0)
            and i % (hf["moe_layer_freq"] or 1) == 0)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, sigmoid_router: bool):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = MLAttention(cfg, layer_id)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = (DeepseekMoE(cfg, sigmoid_router) if is_moe_layer(cfg, layer_id)
                    else MLP(cfg))

    def forward(self, x, cos_sin, fb, residual=None):
        """(h, residual) as llama.DecoderLayer: the layer's output is h + residual."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, cos_sin, fb)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


# checkpoint names: q/k/v-less MLA projections load as they are; the dense and shared-expert
# gate/up land in the halves of the fused gate_up_proj
_GATE_UP = re.compile(r"(.*\.(?:mlp|shared_experts))\.(gate_proj|up_proj)\.weight")
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


class DeepseekV2ForCausalLM(MoeWeights, nn.Module):
    sigmoid_router = False  # V2: softmax scores
    lm_head_fp32: Optional[torch.Tensor] = None  # (llama.py's compute_logits reads these)
    lm_head_packed: Optional[torch.Tensor] = None
    lm_head_quant: Optional[nn.Module] = None
    lm_head_dense_above: Optional[int] = None

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, self.sigmoid_router)
                                    for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(
            cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rope = DeepseekRope(cfg)

    to_empty = LlamaForCausalLM.to_empty
    compute_logits = LlamaForCausalLM.compute_logits

    @staticmethod
    def mla_kv_dims(cfg: ModelConfig) -> tuple[int, int]:
        """(kv_lora_rank, qk_rope_head_dim): what the KV pool stores per token and layer."""
        hf = fields(cfg)
        return hf["kv_lora_rank"], hf["qk_rope_head_dim"]

    @staticmethod
    def attention_spec(cfg: ModelConfig) -> AttentionSpec:
        return AttentionSpec(scale=softmax_scale(cfg))

    @classmethod
    def check_supported(cls, cfg: ModelConfig, context_len: int) -> None:
        hf, name = fields(cfg), cfg.architecture
        arch_support.require_silu(cfg)
        if rope_kind(cfg) not in ROPE_TYPES:
            raise ValueError(f"{name} with rope_type={rope_kind(cfg)!r} is not supported "
                             "(supported: default, yarn)")
        if hf["mlp_bias"]:
            raise ValueError(f"{name} with mlp_bias=true is not supported (MLPs without bias)")
        if hf["n_routed_experts"] is not None:
            if hf["num_experts_per_tok"] is None:
                raise ValueError(f"{name}: num_experts_per_tok must be set")
            if hf["n_group"] and hf["n_routed_experts"] % hf["n_group"]:
                raise ValueError(f"{name}: n_routed_experts must be a multiple of n_group")
            cls._check_router(hf, name)

    @staticmethod
    def _check_router(hf: dict, name: str) -> None:
        method = hf["topk_method"]
        if method not in ("greedy", "group_limited_greedy"):
            raise ValueError(f"{name} with topk_method={method!r} is not supported "
                             "(V2: greedy, group_limited_greedy)")
        if method == "group_limited_greedy" and not (hf["n_group"] and hf["topk_group"]):
            raise ValueError(f"{name}: group_limited_greedy needs n_group and topk_group")
        if hf.get("norm_topk_prob"):
            raise ValueError(f"{name} with norm_topk_prob=true is not supported: HF transformers "
                             "ignores it for V2 and DeepSeek's code renormalizes; no reference")
        if hf.get("scoring_func", "softmax") != "softmax":
            raise ValueError(f"{name}: scoring_func={hf['scoring_func']!r} (V2 routes by softmax)")

    def forward(self, fb: ForwardBatch, input_embeds: Optional[torch.Tensor] = None):
        """Final hidden states of the rows `fb.logits_indices`: (N, hidden)."""
        x = self.embed_tokens(fb.input_ids) if input_embeds is None else input_embeds
        cos_sin = self.rope(fb.positions)  # (T, 1, dr/2) each
        residual = None
        for layer in self.layers:
            x, residual = layer(x, cos_sin, fb, residual)
        idx = fb.logits_indices
        return self.norm(x.index_select(0, idx), residual.index_select(0, idx))[0]

    # --- weights --------------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """HF-named tensors (experts per expert or stacked: MoeWeights._stack_experts); the
        multi-token-prediction layers past num_hidden_layers (num_nextn_predict_layers) are
        skipped. Every parameter must be filled."""
        self._load(self._stack_experts(
            (n, t) for n, t in weights
            if not ((m := _LAYER.search(n)) and int(m.group(1)) >= self.cfg.num_layers)))

    def _load(self, weights):
        params = dict(self.named_parameters())
        params.update((n, b) for n, b in self.named_buffers() if "e_score_correction" in n)
        filled: dict[str, set] = {}
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if "rotary_emb" in name or (name == "lm_head.weight" and self.lm_head is None):
                continue
            half = None
            g = _GATE_UP.fullmatch(name)
            if g:
                name, half = f"{g.group(1)}.gate_up_proj.weight", g.group(2)
            if name not in params:
                raise KeyError(f"checkpoint tensor {name!r} has no place in {type(self).__name__}")
            dst = params[name].data
            if half is not None:
                n = dst.shape[0] // 2
                dst = dst[:n] if half == "gate_proj" else dst[n:]
            if dst.shape != tensor.shape:
                raise ValueError(f"{name} ({half or 'whole'}): checkpoint shape "
                                 f"{tuple(tensor.shape)} != model shape {tuple(dst.shape)}")
            dst.copy_(tensor)
            filled.setdefault(name, set()).add(half)
        missing = [n for n in params if filled.get(n) not in (
            {None}, {"gate_proj", "up_proj"} if n.endswith("gate_up_proj.weight") else {None})]
        if missing:
            raise ValueError(f"checkpoint lacks tensors for: {missing[:8]}"
                             + (" ..." if len(missing) > 8 else ""))

    def init_dummy_weights(self, seed: int = 0) -> None:
        """Random weights (`--load-format dummy`): norms 1, biases and score biases 0."""
        g = None
        with torch.no_grad():
            for name, p in list(self.named_parameters()) + list(self.named_buffers()):
                if g is None:
                    g = torch.Generator(device=p.device).manual_seed(seed)
                if name.endswith(("norm.weight", "layernorm.weight")):
                    p.fill_(1.0)
                elif name.endswith(("bias", "e_score_correction_bias")):
                    p.zero_()
                elif p.is_floating_point():
                    p.normal_(0.0, 0.02, generator=g)


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    sigmoid_router = True  # V3: sigmoid scores, bias-corrected grouped choice (deepseek_moe.py)

    @staticmethod
    def _check_router(hf: dict, name: str) -> None:
        if hf.get("topk_method", "noaux_tc") != "noaux_tc":
            raise ValueError(f"{name} with topk_method={hf['topk_method']!r} is not supported "
                             "(V3: noaux_tc)")
        if hf.get("scoring_func", "sigmoid") != "sigmoid":
            raise ValueError(f"{name}: scoring_func={hf['scoring_func']!r} (V3 routes by sigmoid)")
        if not hf.get("n_group") or not hf.get("topk_group"):
            raise ValueError(f"{name}: n_group and topk_group must be set")
