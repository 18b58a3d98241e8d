"""Qwen3 (`Qwen3ForCausalLM`): Llama with an RMSNorm over each q and k head before the rotary.

Matches HF transformers' Qwen3Attention: q = q_norm(q_proj(x) per head), k = k_norm(k_proj(x) per
head), both norms over head_dim with their own weights (head_dim, read from the config, need not
equal hidden / heads), then rotary, then attention with scale head_dim**-0.5. q/k/v/o carry a
bias only with `attention_bias` (o_proj too, unlike Qwen2). Everything else is llama.py's.

`QKNormAttention` is shared with Qwen3-MoE (models/moe.py).

Sliding windows (`use_sliding_window`, per `layer_types`) run as HF applies them
(arch_support.layer_windows). Refused (check_supported): rope types other than
default/linear/llama3 (e.g. yarn), activations other than silu, sliding layers without a window.
"""

from __future__ import annotations

import torch

from radixlm.runtime.config import ModelConfig
from radixlm.runtime.executor.forward_batch import ForwardBatch
from radixlm.runtime.layers import cpu_layer_stack
from radixlm.runtime.layers.rotary import apply_rotary
from radixlm.runtime.models import arch_support
from radixlm.runtime.models.llama import Attention, Linear, LlamaForCausalLM, RMSNorm, _fused_ops


def rotate_qk(qk: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """qk (T, Hq + Hkv, D) contiguous, rotated by cos/sin (T, 1, D): in place by the Triton kernel
    on CUDA, out of place by rotary.apply_rotary elsewhere."""
    ops = _fused_ops(qk)
    if ops is not None:
        ops.rotary_inplace(qk, *cos_sin)
        return qk
    return apply_rotary(qk, *cos_sin)


class QKNormAttention(Attention):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__(cfg, layer_id)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=cfg.attention_bias)
        self.q_norm = RMSNorm(self.d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.d, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor],
                fb: ForwardBatch) -> torch.Tensor:
        t, hq = x.shape[0], self.hq
        qk, v = self._normed_rotated_qkv(x, cos_sin)
        o = fb.attn_backend.forward(qk[:, :hq], qk[:, hq:], v, self.layer_id, fb)
        return self.o_proj(o.reshape(t, self.q_size))

    def forward_rows(self, x: torch.Tensor, cos_sin, fb: ForwardBatch,
                     rows: torch.Tensor) -> torch.Tensor:
        """forward()'s output at the rows `rows` only (R, hidden); every row's K/V is stored
        (llama.Attention.forward_rows, for the last layer of a prefill)."""
        hq = self.hq
        qk, v = self._normed_rotated_qkv(x, cos_sin)
        o = fb.attn_backend.forward_rows(qk[rows, :hq], qk[:, hq:], v, self.layer_id, fb, rows)
        return self.o_proj(o.reshape(rows.shape[0], self.q_size))

    def _normed_rotated_qkv(self, x: torch.Tensor, cos_sin) -> tuple[torch.Tensor, torch.Tensor]:
        """qk (T, hq + hkv, D): the normed and rotated q heads then k heads; v (T, hkv, D)."""
        t, hq, hkv, d = x.shape[0], self.hq, self.hkv, self.d
        qkv = self.qkv_proj(x)  # (T, (hq + 2 hkv) d)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        # per-head norms on (T*H, D) rows (the reshape copies the strided q/k slices: the Triton
        # norm wants uniform row strides); q and k then sit side by side for one rotary call
        qk = torch.cat((self.q_norm(q.reshape(t * hq, d)).view(t, hq, d),
                        self.k_norm(k.reshape(t * hkv, d)).view(t, hkv, d)), dim=1)
        return rotate_qk(qk, cos_sin), v.view(t, hkv, d)


cpu_layer_stack.accept_qk_norm_attention(QKNormAttention.forward)  # its q/k norms run in C++ too


class Qwen3ForCausalLM(LlamaForCausalLM):
    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        for i, layer in enumerate(self.layers):  # built on the meta device: swapping is free
            layer.self_attn = QKNormAttention(cfg, i)

    @staticmethod
    def check_supported(cfg: ModelConfig, context_len: int) -> None:
        arch_support.require_silu(cfg)
        arch_support.require_plain_rope(cfg)
        arch_support.layer_windows(cfg)  # raises on layer types it cannot run

    attention_spec = staticmethod(arch_support.attention_spec)  # per-layer sliding windows

    def init_dummy_weights(self, seed: int = 0) -> None:
        super().init_dummy_weights(seed)
        with torch.no_grad():  # the per-head norms start at 1 like the other norms
            for name, p in self.named_parameters():
                if name.endswith(("q_norm.weight", "k_norm.weight")):
                    p.fill_(1.0)
