"""The Llama layer stack cut at each attention, for the piecewise CUDA graphs of extends
(executor/piecewise_graph.py).

Piece 0 embeds the tokens and runs layer 0 up to its attention (norm, QKV projection, rotary,
K/V stored into the pool); piece k (1 <= k < L) runs layer k-1 after its attention (o_proj,
norm, MLP) and layer k up to its attention; piece L runs the last layer after its attention.
Between two pieces the attention runs eagerly (its work depends on each request's prefix length,
which a graph cannot follow). Pieces talk through the static buffers of `PieceBuffers`, so each
can be captured once per padded token count and replayed with new values in them.

The code is llama.py's, step for step (DecoderLayer.forward, Attention.forward's fused store;
Qwen3's QKNormAttention through its own projection),
so a piecewise forward computes what the eager one does; one difference: the last layer runs
every row (the eager forward prunes it to the logits rows), which changes no row's values.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixlm.runtime.models.llama import (MLP, Attention, DecoderLayer, Linear,
                                          LlamaForCausalLM, RMSNorm)
from radixlm.runtime.models.qwen3 import QKNormAttention

# the attention classes whose projection the pieces run (_project_store), forward unchanged
_ATTENTIONS = (Attention, QKNormAttention)


@dataclass
class PieceBuffers:
    """Static buffers of Tmax rows; a bucket of n tokens uses rows [:n] of each."""

    inputs: torch.Tensor  # (3, Tmax) int64 rows: input ids, positions, KV slots (out_cache_loc)
    cos: torch.Tensor  # (Tmax, D) fp32 rotary tables of the rows' positions
    sin: torch.Tensor  # (Tmax, D)
    q: torch.Tensor  # (Tmax, Hq * D) rotated queries of the layer whose attention is next
    o: torch.Tensor  # (Tmax, Hq * D) that attention's output (written eagerly, read by a piece)
    residual: torch.Tensor  # (Tmax, hidden) the residual stream
    out: torch.Tensor  # (Tmax, hidden) the last layer's MLP output (hidden = out + residual)

    @classmethod
    def allocate(cls, model: LlamaForCausalLM, max_tokens: int, device) -> "PieceBuffers":
        cfg = model.cfg
        dtype = model.embed_tokens.weight.dtype
        q_size = cfg.num_heads * cfg.head_dim
        act = dict(dtype=dtype, device=device)
        return cls(inputs=torch.zeros(3, max_tokens, dtype=torch.int64, device=device),
                   cos=torch.zeros(max_tokens, cfg.head_dim, dtype=torch.float32, device=device),
                   sin=torch.zeros(max_tokens, cfg.head_dim, dtype=torch.float32, device=device),
                   q=torch.zeros(max_tokens, q_size, **act),
                   o=torch.zeros(max_tokens, q_size, **act),
                   residual=torch.zeros(max_tokens, cfg.hidden_size, **act),
                   out=torch.zeros(max_tokens, cfg.hidden_size, **act))


def why_not(model, backend) -> str:
    """'' when the pieces below compute `model`'s forward with `backend`; else the reason."""
    if not isinstance(model, LlamaForCausalLM) or type(model).forward is not LlamaForCausalLM.forward:
        return f"{type(model).__name__} has its own forward"
    if model.two_batch_overlap is not None:
        return "two-batch overlap runs the layers"
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if not (type(layer) is DecoderLayer and type(attn) in _ATTENTIONS and type(mlp) is MLP
                and type(layer.input_layernorm) is RMSNorm
                and type(layer.post_attention_layernorm) is RMSNorm):
            return f"layer {attn.layer_id} is not llama.py's"
        if (type(attn) is QKNormAttention
                and not (type(attn.q_norm) is RMSNorm and type(attn.k_norm) is RMSNorm)):
            return f"layer {attn.layer_id}'s q/k norms are not llama.py's"
        linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        if any(type(m) is not Linear for m in linears):
            return "quantized linear layers"  # (their kernels keep host state a graph would fix)
    if not getattr(backend, "accepts_stored_kv", False):
        return f"the {type(backend).__name__} backend takes K/V from the layer"
    from radixlm.runtime.layers import triton_ops  # (a backend that stores K/V: triton's)

    if not triton_ops.ENABLED:  # the eager layers then rotate and store apart (another rounding)
        return "RADIXLM_DISABLE_FUSED_OPS is set"
    kv_dtype = backend.kv_pool.k_buffers[0].dtype
    if kv_dtype != model.embed_tokens.weight.dtype:
        return f"the KV pool's dtype {kv_dtype} is not the model's"
    return ""


def _project_store(attn: Attention, h: torch.Tensor, buf: PieceBuffers, n: int,
                   kv_pool) -> None:
    """The attention's forward up to the attention kernel: QKV projection, rotary, K/V into
    the pool at the rows' slots (Attention: one fused launch), the rotated queries into buf.q.
    QKNormAttention (Qwen3): its per-head q/k norms, then the rotary, as its forward."""
    from radixlm.runtime.layers import triton_ops

    loc = buf.inputs[2, :n]
    if type(attn) is QKNormAttention:
        cos_sin = (buf.cos[:n].unsqueeze(1), buf.sin[:n].unsqueeze(1))  # (n, 1, D) each
        qk, v = attn._normed_rotated_qkv(h, cos_sin)  # (n, Hq + Hkv, D), (n, Hkv, D)
        kv_pool.write(attn.layer_id, loc, qk[:, attn.hq:], v)
        buf.q[:n].copy_(qk[:, : attn.hq].reshape(n, attn.q_size))
        return
    qkv = attn.qkv_proj(h)  # (n, (Hq + 2 Hkv) D)
    triton_ops.rotary_store_kv(qkv.view(n, attn.hq + 2 * attn.hkv, attn.d),
                               buf.cos[:n], buf.sin[:n], attn.hq, attn.hkv,
                               kv_pool.k_buffers[attn.layer_id],
                               kv_pool.v_buffers[attn.layer_id], loc)
    buf.q[:n].copy_(qkv[:, : attn.q_size])


def run_piece(model: LlamaForCausalLM, k: int, buf: PieceBuffers, n: int, kv_pool) -> None:
    """Piece k of a bucket of n rows (see the module docstring)."""
    layers = model.layers
    if k == 0:
        ids, pos = buf.inputs[0, :n], buf.inputs[1, :n]
        x = model.embed_tokens(ids)  # (n, hidden)
        cos, sin = model.rope(pos)  # (n, 1, D) each
        buf.cos[:n].copy_(cos.view(n, -1))
        buf.sin[:n].copy_(sin.view(n, -1))
        h = layers[0].input_layernorm(x)
        buf.residual[:n].copy_(x)
        _project_store(layers[0].self_attn, h, buf, n, kv_pool)
        return
    prev = layers[k - 1]
    h = prev.self_attn.o_proj(buf.o[:n])
    h, residual = prev.post_attention_layernorm(h, buf.residual[:n])
    h = prev.mlp(h)
    if k == len(layers):
        buf.out[:n].copy_(h)
        buf.residual[:n].copy_(residual)
        return
    layer = layers[k]
    h, residual = layer.input_layernorm(h, residual)
    buf.residual[:n].copy_(residual)
    _project_store(layer.self_attn, h, buf, n, kv_pool)


def attention(model: LlamaForCausalLM, k: int, buf: PieceBuffers, n: int, fb) -> None:
    """Layer k's attention, eagerly, between pieces k and k+1: buf.q -> buf.o (rows [:n], the
    batch's real tokens; the padding rows of buf.o keep what they held)."""
    attn = model.layers[k].self_attn
    shape = (n, attn.hq, attn.d)
    fb.attn_backend.forward(buf.q[:n].view(shape), None, None, k, fb,
                            out=buf.o[:n].view(shape))


def final_hidden(model: LlamaForCausalLM, buf: PieceBuffers, n: int,
                 rows: torch.Tensor) -> torch.Tensor:
    """The final norm of the rows `rows` (the logits rows): (N, hidden), as the eager forward."""
    return model.norm(buf.out[:n].index_select(0, rows),
                      buf.residual[:n].index_select(0, rows))[0]
