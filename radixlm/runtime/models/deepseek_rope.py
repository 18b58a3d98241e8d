"""DeepSeek's rotary embedding on the qk_rope_head_dim part of q and k, and its softmax scale.

As HF transformers 5.24 computes them (modeling_deepseek_v2/_v3, modeling_rope_utils):
- frequencies over dim = qk_rope_head_dim (the config's head_dim), theta from the config;
  `rope_type` default or yarn. YaRN: inv_freq blends interpolation (1 / (factor theta^(2i/d)))
  and extrapolation by a linear ramp between the correction dims of beta_fast / beta_slow
  (default 32 / 1) at original_max_position_embeddings (floor/ceil unless truncate is false);
  `factor` absent: max_position_embeddings / original_max_position_embeddings.
- cos and sin are multiplied by the attention factor: `attention_factor` if given, else
  mscale(factor, mscale) / mscale(factor, mscale_all_dim) when both are set, else mscale(factor)
  (mscale(s, m) = 0.1 m ln s + 1 for s > 1, else 1). DeepSeek's configs set mscale ==
  mscale_all_dim, so the factor is 1 there.
- the softmax scale is qk_head_dim**-0.5, times mscale(factor, mscale_all_dim)**2 when the rope
  type is not default and mscale_all_dim is set (V3: 0.1 ln 40 + 1 = 1.369, squared 1.874).
- pairs: DeepSeek-V2 (always) and V3 with `rope_interleave` (its default) rotate the adjacent
  pairs (x0, x1), (x2, x3), ...; V3 without it rotates (x_i, x_{i + d/2}) (rotate-half). Either
  way q and k get the same permutation of their output dims, so q.k is HF's.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from radixlm.runtime.config import ModelConfig
from radixlm.runtime.models.deepseek_config import fields

ROPE_TYPES = (None, "default", "yarn")


def rope_kind(cfg: ModelConfig) -> Optional[str]:
    s = cfg.rope_scaling
    return None if s is None else s.get("rope_type", s.get("type"))


def _mscale(scale: float, m: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def _yarn_factor(cfg: ModelConfig) -> float:
    s = cfg.rope_scaling
    if s.get("factor") is not None:
        return s["factor"]
    return cfg.max_position_embeddings / s["original_max_position_embeddings"]


def softmax_scale(cfg: ModelConfig) -> float:
    hf = fields(cfg)
    scale = (hf["qk_nope_head_dim"] + hf["qk_rope_head_dim"]) ** -0.5
    if rope_kind(cfg) not in (None, "default") and cfg.rope_scaling.get("mscale_all_dim"):
        scale *= _mscale(_yarn_factor(cfg), cfg.rope_scaling["mscale_all_dim"]) ** 2
    return scale


def _yarn(cfg: ModelConfig, dim: int) -> tuple[torch.Tensor, float]:
    """(inv_freq (dim/2,) fp32, attention factor), in HF's fp32 order of operations."""
    s, base = cfg.rope_scaling, cfg.rope_theta
    factor = _yarn_factor(cfg)
    attn = s.get("attention_factor")
    if attn is None:
        m, m_all = s.get("mscale"), s.get("mscale_all_dim")
        attn = _mscale(factor, m) / _mscale(factor, m_all) if m and m_all else _mscale(factor)
    fast, slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1
    orig = s["original_max_position_embeddings"]

    def corr_dim(rot):  # the dim whose wavelength makes `rot` turns over `orig` positions
        return dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))

    low, high = corr_dim(fast), corr_dim(slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extra = 1 - ramp  # 1: keep the original frequency (short wavelengths), 0: interpolate
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extra) + (1.0 / pos_freqs) * extra
    return inv_freq, float(attn)


class DeepseekRope(torch.nn.Module):
    """positions (T,) -> (cos, sin), each (T, 1, dim/2) in fp32, attention factor included."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg, self.dim = cfg, fields(cfg)["qk_rope_head_dim"]
        self.max_positions = cfg.max_position_embeddings
        self.cos = self.sin = None

    def reset(self, device) -> None:
        """Compute the tables (the model is built on the meta device; see rotary.py)."""
        with torch.device("cpu"):
            if rope_kind(self.cfg) == "yarn":
                inv_freq, attn = _yarn(self.cfg, self.dim)
            else:
                inv_freq = 1.0 / (self.cfg.rope_theta ** (
                    torch.arange(0, self.dim, 2, dtype=torch.float32) / self.dim))
                attn = 1.0
            freqs = torch.arange(self.max_positions, dtype=torch.float32)[:, None] * inv_freq
            self.cos, self.sin = (freqs.cos() * attn).to(device), (freqs.sin() * attn).to(device)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               interleaved: bool) -> torch.Tensor:
    """x (T, H, d) -> rotated (T, H, d) in x's dtype (computed in fp32). Output layout
    [rotated firsts | rotated seconds] of each pair (see the module docstring). On CUDA one
    Triton kernel (layers/triton_ops.rope_pairs), the same math, eager and in graphs alike."""
    if x.is_cuda:
        from radixlm.runtime.layers import triton_ops

        if triton_ops.ENABLED:  # (RADIXLM_DISABLE_FUSED_OPS=1: the torch ops below)
            return triton_ops.rope_pairs(x, cos, sin, interleaved)
    xf = x.float()
    if interleaved:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
    else:
        x1, x2 = xf.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
