"""MLA decode over the paged latent pool (Triton), in the absorbed form (attention/mla_backend.py).

Row b's H query heads, already in the latent space (q_lat (B, H, r + dr) = [W_UK^T q_nope | q_pe]),
attend to the latents at slots `req_to_token[req_pool_indices[b], :seq_lens[b]]`, read in place
from the pool (capacity + 1, r + dr); the values are the first r columns of the same latents.
Output (B, H, r), which the caller maps out through W_UV.

Grid (B, ceil(H / BLOCK_H)): a program holds BLOCK_H heads of one row, so each latent block it
loads serves all of them (the point of MLA's shared latent: one read for all heads). Scores are
two dots (the r columns and the dr rope columns, each padded to a power of two), online softmax
in fp32 with exp2 (log2(e) folded into the scale). One pass over the keys, no split along them:
a first kernel, correct and in place, not tuned (no flash-decoding split for long contexts or
small batches, no CUDA-graph buffers); GPU speed not measured yet.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixlm.runtime.attention.triton_decode import LOG2E, dot_dtype, dot_precision

BLOCK_H = 16  # heads per program (tl.dot needs >= 16 rows; fewer heads are masked)
BLOCK_N = 32  # keys per loop step


@triton.jit
def _mla_decode_kernel(Q, Lat, ReqToToken, ReqIdx, SeqLens, Out,
                       stride_qb, stride_qh, stride_lat, stride_rt, stride_ob, stride_oh,
                       H, R, DR, scale_log2,
                       BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_DR: tl.constexpr,
                       BLOCK_N: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr):
    b = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < H
    offs_r = tl.arange(0, BLOCK_R)
    offs_p = tl.arange(0, BLOCK_DR)
    rmask, pmask = offs_r < R, offs_p < DR
    q_row = Q + b * stride_qb + heads[:, None] * stride_qh
    q_c = tl.load(q_row + offs_r[None, :], mask=hmask[:, None] & rmask[None, :], other=0.0)
    q_p = tl.load(q_row + R + offs_p[None, :], mask=hmask[:, None] & pmask[None, :], other=0.0)
    q_c, q_p = q_c.to(DOT), q_p.to(DOT)  # (BLOCK_H, BLOCK_R), (BLOCK_H, BLOCK_DR)
    row = tl.load(ReqIdx + b)
    seq_len = tl.load(SeqLens + b)
    m_i = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_H,), tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_R), tl.float32)
    for start in range(0, seq_len, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        nmask = offs_n < seq_len
        slots = tl.load(ReqToToken + row * stride_rt + offs_n, mask=nmask, other=0)
        lat = Lat + slots[:, None] * stride_lat
        c = tl.load(lat + offs_r[None, :], mask=nmask[:, None] & rmask[None, :], other=0.0)
        pe = tl.load(lat + R + offs_p[None, :], mask=nmask[:, None] & pmask[None, :], other=0.0)
        c, pe = c.to(DOT), pe.to(DOT)  # (BLOCK_N, BLOCK_R), (BLOCK_N, BLOCK_DR)
        s = tl.dot(q_c, tl.trans(c), input_precision=PREC)
        s += tl.dot(q_p, tl.trans(pe), input_precision=PREC)
        s = tl.where(nmask[None, :], s * scale_log2, float("-inf"))  # (BLOCK_H, BLOCK_N)
        m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: every row has seq_len >= 1 keys
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT), c, input_precision=PREC)
        m_i = m_new
    out = acc / l_i[:, None]
    o_ptr = Out + b * stride_ob + heads[:, None] * stride_oh + offs_r[None, :]
    tl.store(o_ptr, out.to(Out.dtype.element_ty), mask=hmask[:, None] & rmask[None, :])


def decode(q_lat: torch.Tensor, buf: torch.Tensor, req_to_token: torch.Tensor,
           req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, r: int,
           scale: float) -> torch.Tensor:
    """q_lat (B, H, r + dr); buf (capacity + 1, r + dr) the layer's latents -> (B, H, r)."""
    q_lat = q_lat.contiguous()
    bsz, h, w = q_lat.shape
    if buf.stride(1) != 1 or req_to_token.stride(1) != 1:
        raise ValueError("the latent pool and req_to_token must be row-contiguous")
    out = q_lat.new_empty(bsz, h, r)
    dt = dot_dtype(q_lat.dtype, buf.dtype)
    _mla_decode_kernel[(bsz, triton.cdiv(h, BLOCK_H))](
        q_lat, buf, req_to_token, req_pool_indices, seq_lens, out,
        q_lat.stride(0), q_lat.stride(1), buf.stride(0), req_to_token.stride(0),
        out.stride(0), out.stride(1), h, r, w - r, scale * LOG2E,
        BLOCK_H=BLOCK_H, BLOCK_R=max(16, triton.next_power_of_2(r)),
        BLOCK_DR=max(16, triton.next_power_of_2(w - r)), BLOCK_N=BLOCK_N, DOT=dt,
        PREC=dot_precision(dt), num_warps=4,
        # shared memory: a (BLOCK_N, 512) latent tile is 64 KB in fp32, 32 KB in bf16; one
        # pipeline stage in fp32 keeps the tiles under the per-block limit (not tuned on a GPU)
        num_stages=1 if dt == tl.float32 else 2)
    return out
