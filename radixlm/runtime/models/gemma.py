"""Gemma 2 and Gemma 3 (text) in plain torch, on llama.py's building blocks.

Same flat-batch contract as llama.py (`forward(fb) -> (N, hidden)`, fused qkv / gate_up weights,
HF-named `load_weights`). What differs from Llama, as HF 5.23's modeling_gemma2 / modeling_gemma3
compute it:
- RMSNorm scales by (1 + weight), in fp32, then casts back; four norms per layer: input,
  post_attention (on the attention output, before its residual add), pre_ and post_feedforward;
- embeddings times sqrt(hidden), the factor first rounded to the model dtype;
- MLP gelu_pytorch_tanh(gate) * up;
- attention scale query_pre_attn_scalar**-0.5, layers `layer_types[i] == "sliding_attention"`
  see only the last `sliding_window` positions (both through the backend's AttentionSpec);
- Gemma 2: attention logit soft-cap (backend) and final logit soft-cap;
- Gemma 3: q/k RMSNorm over head_dim before rotary; sliding layers use their own rope theta
  (`rope_parameters["sliding_attention"]`, formerly `rope_local_base_freq`); final logit soft-cap
  when set. `attn_logit_softcapping` is NOT applied: HF 5.23's Gemma3Attention never passes it
  to attention, and HF is the reference.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from radixlm.runtime.attention.base import AttentionSpec
from radixlm.runtime.config import ModelConfig
from radixlm.runtime.executor.forward_batch import ForwardBatch
from radixlm.runtime.layers import cpu_linear
from radixlm.runtime.layers.rotary import RotaryEmbedding, apply_rotary
from radixlm.runtime.models.llama import MLP, Embedding, Linear, LlamaForCausalLM

ROPE_TYPES = (None, "default", "linear", "llama3")  # what layers/rotary.RotaryEmbedding computes
LAYER_TYPES = ("full_attention", "sliding_attention")
# Gemma2Config / Gemma3TextConfig defaults of the fields read here: HF uses them when config.json
# omits the field (hub configs written by older transformers often omit tie_word_embeddings)
_DEFAULTS = {
    "gemma2": dict(query_pre_attn_scalar=256, sliding_window=4096, attn_logit_softcapping=50.0,
                   final_logit_softcapping=30.0, tie_word_embeddings=True, head_dim=256),
    "gemma3_text": dict(query_pre_attn_scalar=256, sliding_window=4096,
                        attn_logit_softcapping=None, final_logit_softcapping=None,
                        tie_word_embeddings=True, head_dim=256),
}


def field(cfg: ModelConfig, name: str):
    """The config's `name`, or the HF config class's default when config.json omits it (a field
    written as null stays None, as in HF)."""
    return cfg.hf.get(name, _DEFAULTS.get(cfg.hf.get("model_type"), _DEFAULTS["gemma3_text"])[name])


def layer_types(cfg: ModelConfig) -> list[str]:
    """`layer_types` from the config (save_pretrained writes it), else the config class's default:
    Gemma 2 alternates sliding / full from layer 0; Gemma 3 makes every `sliding_window_pattern`-th
    layer (default 6) full, the others sliding."""
    hf, n = cfg.hf, cfg.num_layers
    types = hf.get("layer_types")
    if types is None:
        every = 2 if hf.get("model_type") == "gemma2" else hf.get("sliding_window_pattern", 6)
        types = ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(n)]
    return list(types)


Rope = tuple[float, Optional[dict]]  # (theta, scaling dict for rotary.py or None)


def rope_params(cfg: ModelConfig) -> tuple[Rope, Rope]:
    """(theta, scaling) of the full-attention and of the sliding layers. Gemma 2: one
    `rope_parameters` for all layers (older configs: rope_theta / rope_scaling). Gemma 3 nests
    them per layer type (older configs: rope_theta / rope_scaling for the global layers,
    rope_local_base_freq for the local ones), defaults 1e6 / 1e4 as Gemma3TextConfig's."""
    hf = cfg.hf
    params = hf.get("rope_parameters") or {}
    legacy = {"rope_theta": hf.get("rope_theta"), **(hf.get("rope_scaling") or {})}
    if hf.get("model_type") == "gemma2":
        full = local = dict(params or legacy)
        default = 1e4
    else:
        full = dict(params.get("full_attention") or legacy)
        local = dict(params.get("sliding_attention")
                     or {"rope_theta": hf.get("rope_local_base_freq") or 1e4})
        default = 1e6

    def split(p: dict) -> Rope:
        kind = p.get("rope_type", p.get("type", "default"))
        if kind not in ROPE_TYPES:
            raise ValueError(f"{cfg.architecture}: rope_type {kind!r} is not supported "
                             f"(supported: default, linear, llama3)")
        return float(p.get("rope_theta") or default), (None if kind in (None, "default") else p)

    return split(full), split(local)


class GemmaRMSNorm(nn.Module):
    """x / rms(x) * (1 + weight), computed in fp32 and cast back (HF's Gemma2RMSNorm)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)


class GemmaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, qk_norm: bool):
        super().__init__()
        self.layer_id = layer_id
        self.hq, self.hkv, self.d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = self.hq * self.d, self.hkv * self.d
        bias = cfg.attention_bias  # HF Gemma: on q/k/v and o alike
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=bias)
        self.q_norm = GemmaRMSNorm(self.d, cfg.rms_norm_eps) if qk_norm else None
        self.k_norm = GemmaRMSNorm(self.d, cfg.rms_norm_eps) if qk_norm else None

    def forward(self, x: torch.Tensor, cos_sin, fb: ForwardBatch) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = q.view(t, self.hq, self.d), k.view(t, self.hkv, self.d)
        if self.q_norm is not None:  # Gemma 3: per-head norms, before rotary
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, *cos_sin), apply_rotary(k, *cos_sin)
        o = fb.attn_backend.forward(q, k, v.view(t, self.hkv, self.d), self.layer_id, fb)
        return self.o_proj(o.reshape(t, self.q_size))


class GemmaMLP(MLP):
    """llama.py's MLP with GELU (tanh approximation) in place of SiLU."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.inter, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class GemmaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, qk_norm: bool):
        super().__init__()
        eps, h = cfg.rms_norm_eps, cfg.hidden_size
        self.input_layernorm = GemmaRMSNorm(h, eps)
        self.self_attn = GemmaAttention(cfg, layer_id, qk_norm)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.mlp = GemmaMLP(cfg)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps)

    def forward(self, x: torch.Tensor, cos_sin, fb: ForwardBatch) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos_sin, fb))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class _Ropes(nn.Module):
    """cos/sin of the full-attention layers and of the sliding ones (one table when equal)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        (g_theta, g_scaling), (l_theta, l_scaling) = rope_params(cfg)
        n = cfg.max_position_embeddings
        self.full = RotaryEmbedding(cfg.head_dim, n, g_theta, g_scaling)
        same = (g_theta, g_scaling) == (l_theta, l_scaling)
        self.local = None if same else RotaryEmbedding(cfg.head_dim, n, l_theta, l_scaling)

    def reset(self, device) -> None:
        self.full.reset(device)
        if self.local is not None:
            self.local.reset(device)

    def forward(self, positions: torch.Tensor):
        full = self.full(positions)
        return full, (full if self.local is None else self.local(positions))


class Gemma2ForCausalLM(nn.Module):
    QK_NORM = False  # Gemma 3 adds q/k norms
    ATTN_SOFTCAP = True  # Gemma 3 ignores attn_logit_softcapping (see the module docstring)
    lm_head_fp32: Optional[torch.Tensor] = None  # see LlamaForCausalLM (layers/cpu_linear)
    # the same HF naming and fused q/k/v, gate/up layout as Llama's
    load_weights = LlamaForCausalLM.load_weights
    to_empty = LlamaForCausalLM.to_empty

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(GemmaDecoderLayer(cfg, i, self.QK_NORM)
                                    for i in range(cfg.num_layers))
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if field(cfg, "tie_word_embeddings") else nn.Linear(
            cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rope = _Ropes(cfg)
        self.sliding = tuple(t == "sliding_attention" for t in layer_types(cfg))
        self.final_softcap: Optional[float] = field(cfg, "final_logit_softcapping")
        self._normalizers: dict[torch.dtype, float] = {}

    @classmethod
    def check_supported(cls, cfg: ModelConfig, context_len: int) -> None:
        hf = cfg.hf
        act = hf.get("hidden_activation", "gelu_pytorch_tanh")  # HF reads only this field
        if act != "gelu_pytorch_tanh":
            raise ValueError(f"{cfg.architecture} with hidden_activation={act!r} is not supported "
                             "(the MLP computes gelu_pytorch_tanh(gate) * up)")
        if field(cfg, "head_dim") != cfg.head_dim:  # ModelConfig's fallback is hidden // heads
            raise ValueError(f"{cfg.architecture}: config.json has no head_dim, and HF's default "
                             f"(256) differs from hidden_size / heads ({cfg.head_dim})")
        if hf.get("use_bidirectional_attention"):
            raise ValueError(f"{cfg.architecture} with use_bidirectional_attention is not "
                             "supported (causal attention only)")
        types = layer_types(cfg)
        if len(types) != cfg.num_layers or set(types) - set(LAYER_TYPES):
            raise ValueError(f"{cfg.architecture}: layer_types {types} is not supported")
        if "sliding_attention" in types and not field(cfg, "sliding_window"):
            raise ValueError(f"{cfg.architecture}: sliding_attention layers without a "
                             "sliding_window")
        rope_params(cfg)  # raises on rope types rotary.py does not compute

    @classmethod
    def attention_spec(cls, cfg: ModelConfig) -> AttentionSpec:
        window = field(cfg, "sliding_window")
        windows = tuple(window if t == "sliding_attention" else None for t in layer_types(cfg))
        cap = field(cfg, "attn_logit_softcapping") if cls.ATTN_SOFTCAP else None
        return AttentionSpec(scale=float(field(cfg, "query_pre_attn_scalar")) ** -0.5,
                             windows=windows if any(windows) else (), logit_softcap=cap or None)

    def _normalizer(self, dtype: torch.dtype) -> float:
        """sqrt(hidden) rounded to `dtype`, as HF multiplies by `embed_scale.to(weight.dtype)`."""
        if dtype not in self._normalizers:
            self._normalizers[dtype] = float(torch.tensor(self.cfg.hidden_size ** 0.5).to(dtype))
        return self._normalizers[dtype]

    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        """Returns final hidden states of the rows `fb.logits_indices`: (N, hidden)."""
        x = self.embed_tokens(fb.input_ids)  # (T, hidden)
        x = x * self._normalizer(x.dtype)
        full, local = self.rope(fb.positions)  # (T, 1, head_dim) cos, sin each
        for layer, sliding in zip(self.layers, self.sliding):
            x = layer(x, local if sliding else full, fb)
        return self.norm(x[fb.logits_indices])

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(N, hidden) -> (N, vocab) float32, soft-capped by cap * tanh(logits / cap) when set
        (in fp32 on the model-dtype logits)."""
        if self.lm_head_fp32 is not None:
            logits = cpu_linear.logits_fp32(hidden, self.lm_head_fp32, hidden.dtype)
        else:
            w = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
            logits = F.linear(hidden, w).float()
        if self.final_softcap:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits

    def init_dummy_weights(self, seed: int = 0) -> None:
        """Random weights (`--load-format dummy`); norms 0, i.e. a scale of 1 + 0."""
        g = None
        with torch.no_grad():
            for name, p in self.named_parameters():
                if g is None:
                    g = torch.Generator(device=p.device).manual_seed(seed)
                if name.endswith("norm.weight") or name.endswith("bias"):
                    p.zero_()
                else:
                    p.normal_(0.0, 0.02, generator=g)


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma 3 text (`Gemma3TextConfig`, model_type gemma3_text)."""

    QK_NORM = True
    ATTN_SOFTCAP = False
