"""Rotary position embedding (HF/NeoX "rotate half" layout), with Llama-3 frequency scaling."""

from __future__ import annotations

import math
from typing import Optional

import torch


def _llama3_scale(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1 rope scaling: long wavelengths divided by `factor`, short ones kept, smooth between."""
    factor = scaling["factor"]
    low = scaling.get("low_freq_factor", 1.0)
    high = scaling.get("high_freq_factor", 4.0)
    old_ctx = scaling.get("original_max_position_embeddings", 8192)
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, smoothed, out)


class RotaryEmbedding(torch.nn.Module):
    def __init__(self, head_dim: int, max_positions: int, theta: float,
                 scaling: Optional[dict] = None, device=None):
        super().__init__()
        self.head_dim, self.max_positions, self.theta, self.scaling = (
            head_dim, max_positions, theta, scaling)
        cos, sin = self._tables(device)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def reset(self, device) -> None:
        """Recompute the tables (after the module was built on the meta device)."""
        self.cos, self.sin = self._tables(device)

    def _tables(self, device):
        # Computed on the CPU, then moved: under a `torch.device("meta")` context (how the model
        # is built) these ops would otherwise run through torch's Python reference
        # decompositions, which import torch._dynamo (seconds), for tables reset() recomputes.
        with torch.device("cpu"):
            cos, sin = self._cpu_tables()
        return cos.to(device), sin.to(device)

    def _cpu_tables(self):
        head_dim, scaling = self.head_dim, self.scaling
        inv_freq = 1.0 / (self.theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        if scaling is not None:
            kind = scaling.get("rope_type", scaling.get("type"))
            if kind == "llama3":
                inv_freq = _llama3_scale(inv_freq, scaling)
            elif kind == "linear":
                inv_freq = inv_freq / scaling["factor"]
            else:
                raise NotImplementedError(f"rope scaling type {kind!r} is not supported")
        t = torch.arange(self.max_positions, dtype=torch.float64)
        freqs = torch.outer(t, inv_freq).float()  # (max_positions, head_dim/2)
        # cos/sin duplicated over both halves: (max_positions, head_dim), kept in fp32
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions (T,) -> cos, sin (T, 1, D) fp32; looked up once per forward, used by all layers."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (T, H, D) rotated by position: x * cos + rotate_half(x) * sin, computed in fp32."""
    half = x.shape[-1] // 2
    xf = x.float()
    rotated = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
    return (xf * cos + rotated * sin).to(x.dtype)
