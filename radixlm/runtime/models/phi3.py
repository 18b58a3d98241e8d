"""Phi-3 / Phi-3.5 / Phi-4-mini (`Phi3ForCausalLM`): Llama with fused checkpoint tensors, LongRoPE
and partial rotary.

What differs from llama.py, as HF transformers 5.23 computes it (models/phi3, modeling_rope_utils):
- The checkpoint stores `qkv_proj` ([q | k | v] rows) and `gate_up_proj` ([gate | up] rows)
  already fused, in the layout llama.py's fused parameters use; `load_weights` splits them into
  the q/k/v and gate/up pieces llama.py's loader expects (views, no copies).
- `partial_rotary_factor` (Phi-4-mini: 0.75): only the first rotary_dim = int(head_dim * factor)
  channels of each q/k head rotate ("rotate half" within them); the rest pass through.
  Read from `rope_parameters` first, else the top-level field, like HF's config does.
- LongRoPE (`rope_type` "longrope", old names "su"/"yarn" mapped to it as HF does):
  inv_freq = 1 / (ext_factor * theta ** (2i / rotary_dim)), and cos/sin are multiplied by
  attention_factor = rope `attention_factor`, else sqrt(1 + ln(factor) / ln(original_max)) with
  factor = rope `factor`, else max_position_embeddings / original_max (1.0 when factor <= 1).
  original_max is the top-level `original_max_position_embeddings` (HF gives it priority over
  the rope dict's; Phi3Config's default is 4096).

Which factor set: HF picks per forward call from seq_len = max(position_ids) + 1 -- `short_factor`
while seq_len <= original_max, `long_factor` beyond -- and when a generation crosses that length
Phi3ForCausalLM.prepare_inputs_for_generation drops its KV cache and recomputes every position
with the long factors. So HF's K/V for a position depends on how long the whole sequence gets.
A serving system cannot reproduce that: the radix cache shares the K/V of a prefix between
requests that end at different lengths, and a request's final length is unknown while its prompt
is prefilled. Within original_max every position HF computes uses the short factors (positions
here stay below context_len), so with LongRoPE this runs exactly the short-factor model and
`check_supported` refuses a context_length above original_max_position_embeddings (pass
--context-length <original_max>, e.g. 4096 for Phi-3-mini-128k).

`sliding_window` (Phi-3-mini-4k: 2047) applies to every layer, as in HF (arch_support).
Also refused: other rope types, activations other than silu.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Iterable, Optional

import torch

from radixlm.runtime.config import ModelConfig
from radixlm.runtime.executor.forward_batch import ForwardBatch
from radixlm.runtime.layers.rotary import RotaryEmbedding, apply_rotary
from radixlm.runtime.models import arch_support
from radixlm.runtime.models.llama import Attention, LlamaForCausalLM

PHI3_DEFAULT_ORIGINAL_MAX = 4096  # Phi3Config.original_max_position_embeddings's default


@dataclasses.dataclass(frozen=True)
class Phi3Rope:
    """The rotary parameters HF derives from a Phi-3 config."""

    kind: str  # "default" | "longrope"
    theta: float
    rotary_dim: int
    original_max: int
    short_factor: Optional[tuple[float, ...]] = None  # longrope: rotary_dim / 2 divisors
    attention_factor: float = 1.0  # longrope: cos/sin multiplier

    @staticmethod
    def from_config(cfg: ModelConfig) -> "Phi3Rope":
        hf = cfg.hf
        rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        kind = rope.get("rope_type", rope.get("type")) or "default"
        kind = "longrope" if kind in ("su", "yarn") else kind  # Phi3Config renames these
        theta = float(rope.get("rope_theta") or cfg.rope_theta)
        prf = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
        rotary_dim = int(cfg.head_dim * prf)
        orig = int(hf.get("original_max_position_embeddings") or PHI3_DEFAULT_ORIGINAL_MAX)
        if kind != "longrope":
            return Phi3Rope(kind, theta, rotary_dim, orig)
        factor = rope.get("factor")
        if factor is None:
            factor = cfg.max_position_embeddings / orig
        att = rope.get("attention_factor")
        if att is None:
            att = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
        return Phi3Rope(kind, theta, rotary_dim, orig, tuple(rope.get("short_factor") or ()),
                        float(att))


class Phi3RotaryEmbedding(RotaryEmbedding):
    """Tables (positions, rotary_dim) fp32: cos/sin of the short-factor frequencies, times the
    attention factor (1 without LongRoPE)."""

    def __init__(self, rope: Phi3Rope, max_positions: int):
        super().__init__(rope.rotary_dim, max_positions, rope.theta,
                         scaling=dataclasses.asdict(rope))

    def _cpu_tables(self):
        dim, p = self.head_dim, self.scaling
        inv_freq = 1.0 / (self.theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        if p["short_factor"] is not None:
            inv_freq = inv_freq / torch.tensor(p["short_factor"], dtype=torch.float64)
        freqs = torch.outer(torch.arange(self.max_positions, dtype=torch.float64), inv_freq).float()
        emb = torch.cat((freqs, freqs), dim=-1)  # (max_positions, rotary_dim)
        return emb.cos() * p["attention_factor"], emb.sin() * p["attention_factor"]


class PartialRotaryAttention(Attention):
    """Attention whose rotary covers the first `rotary_dim` channels of each q/k head."""

    def __init__(self, cfg: ModelConfig, layer_id: int, rotary_dim: int):
        super().__init__(cfg, layer_id)
        self.rotary_dim = rotary_dim

    def forward(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor],
                fb: ForwardBatch) -> torch.Tensor:
        t, hq, hkv, d, rd = x.shape[0], self.hq, self.hkv, self.d, self.rotary_dim
        qkv = self.qkv_proj(x)  # (T, (hq + 2 hkv) d)
        qk = qkv[:, : self.q_size + self.kv_size].view(t, hq + hkv, d)  # q and k heads, adjacent
        qk = torch.cat((apply_rotary(qk[..., :rd], *cos_sin), qk[..., rd:]), dim=-1)
        v = qkv[:, self.q_size + self.kv_size :].view(t, hkv, d)
        o = fb.attn_backend.forward(qk[:, :hq], qk[:, hq:], v, self.layer_id, fb)
        return self.o_proj(o.reshape(t, self.q_size))


class Phi3ForCausalLM(LlamaForCausalLM):
    def __init__(self, cfg: ModelConfig):
        # the parent's rotary (plain rope over head_dim) is replaced below: build it over 1 position
        super().__init__(dataclasses.replace(cfg, rope_scaling=None, max_position_embeddings=1))
        self.cfg = cfg
        rope = Phi3Rope.from_config(cfg)
        # positions past original_max are refused with LongRoPE (module docstring)
        n_pos = rope.original_max if rope.kind == "longrope" else cfg.max_position_embeddings
        self.rope = Phi3RotaryEmbedding(rope, n_pos)
        if rope.rotary_dim != cfg.head_dim:
            for i, layer in enumerate(self.layers):
                layer.self_attn = PartialRotaryAttention(cfg, i, rope.rotary_dim)

    @staticmethod
    def check_supported(cfg: ModelConfig, context_len: int) -> None:
        arch_support.require_silu(cfg)
        rope = Phi3Rope.from_config(cfg)
        if rope.kind not in ("default", "longrope"):
            raise ValueError(f"Phi3ForCausalLM with rope_scaling / rope_parameters rope_type="
                             f"{rope.kind!r} is not supported (supported: default, longrope)")
        if not 0 < rope.rotary_dim <= cfg.head_dim or rope.rotary_dim % 2:
            raise ValueError(f"Phi3ForCausalLM: partial_rotary_factor gives rotary_dim="
                             f"{rope.rotary_dim} for head_dim={cfg.head_dim}; need an even "
                             "number in (0, head_dim]")
        if rope.kind == "longrope" and len(rope.short_factor) != rope.rotary_dim // 2:
            raise ValueError(f"Phi3ForCausalLM: rope short_factor has {len(rope.short_factor)} "
                             f"entries, rotary_dim {rope.rotary_dim} needs {rope.rotary_dim // 2}")
        if rope.kind == "longrope" and context_len > rope.original_max:
            raise ValueError(
                f"Phi3ForCausalLM with LongRoPE: context length {context_len} > "
                f"original_max_position_embeddings={rope.original_max} is not supported: HF "
                f"switches to long_factor past that length and recomputes the whole KV cache, "
                f"which a shared prefix cache cannot reproduce. Pass --context-length "
                f"{rope.original_max} (or less) to run it exactly with short_factor")

    attention_spec = staticmethod(arch_support.attention_spec)  # sliding window on every layer

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(self._split_fused(weights))

    def _split_fused(self, weights):
        """qkv_proj -> q_proj/k_proj/v_proj and gate_up_proj -> gate_proj/up_proj (row views)."""
        cfg = self.cfg
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        inter = cfg.intermediate_size
        pieces = {"qkv_proj": (("q_proj", 0, q), ("k_proj", q, kv), ("v_proj", q + kv, kv)),
                  "gate_up_proj": (("gate_proj", 0, inter), ("up_proj", inter, inter))}
        for name, t in weights:
            parts = name.split(".")
            if len(parts) < 2 or parts[-2] not in pieces:
                yield name, t
                continue
            rows = sum(size for _, _, size in pieces[parts[-2]])
            if t.shape[0] != rows:
                raise ValueError(f"{name}: checkpoint has {t.shape[0]} rows, the config implies "
                                 f"{rows}")
            for piece, start, size in pieces[parts[-2]]:
                yield ".".join(parts[:-2] + [piece, parts[-1]]), t[start : start + size]
