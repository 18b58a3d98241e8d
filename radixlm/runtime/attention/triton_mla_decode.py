"""MLA decode over the paged latent pool (Triton), in the absorbed form (attention/mla_backend.py).

Row b's H query heads, already in the latent space (q_lat (B, H, r + dr) = [W_UK^T q_nope | q_pe]),
attend to the latents at slots `req_to_token[req_pool_indices[b], :seq_lens[b]]`, read in place
from the pool (capacity + 1, r + dr); the values are the first r columns of the same latents.
Output (B, H, r), which the caller maps out through W_UV.

Flash-decoding in two stages, CUDA-graph safe (grids from shapes only, no host sync, no
data-dependent allocation; the scratch is the caller's persistent buffer):
- stage 1, grid (B, ceil(H / block_h), S): program (b, g, s) holds block_h query heads of row b
  (MLA has ONE latent "head" shared by all query heads, so each latent tile it loads, (BLOCK_N,
  r + dr), serves all block_h heads: H / block_h reads of each row instead of H) and the s-th of
  S equal key ranges, each ceil(len / S) keys rounded up to BLOCK_N. Scores are two dots (the r
  columns and the dr rope columns, each padded to a power of two), online softmax in fp32 with
  exp2 (log2(e) folded into the scale). With S > 1 it writes the range's normalized partial
  output and log-sum-exp into the scratch: (B, H, S, BLOCK_R) and (B, H, S), fp32.
- stage 2 (attention/triton_decode._decode_stage2, grid (B, H)): merges the S partials by
  log-sum-exp; the same layout as the MHA decode's scratch, so the same kernel.
S == 1 writes the output directly and skips stage 2. S depends on (B, H) only (`num_splits`), so
one graph per batch size is stable. Untuned on a GPU (block_h, BLOCK_N, warps, stages are the
first guesses, passed as arguments so a sweep needs no edit).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl

from radixlm.runtime.attention.triton_decode import (LOG2E, _decode_stage2, dot_dtype,
                                                     dot_precision)

BLOCK_H = 16  # heads per program (tl.dot needs >= 16 rows; fewer heads are masked)
BLOCK_N = 32  # keys per loop step: a (32, 512) bf16 latent tile is 32 KB of shared memory
MAX_SPLITS = 16


@triton.jit(do_not_specialize_on_alignment=["ReqIdx", "SeqLens"])
def _mla_stage1(Q, Lat, ReqToToken, ReqIdx, SeqLens, Out, OPart, LsePart,
                stride_qb, stride_qh, stride_lat, stride_rt, stride_ob, stride_oh,
                H, R, DR, scale_log2,
                BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_DR: tl.constexpr,
                BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, DOT: tl.constexpr,
                PREC: tl.constexpr):
    b = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(2)
    hmask = heads < H
    offs_r = tl.arange(0, BLOCK_R)
    offs_p = tl.arange(0, BLOCK_DR)
    offs_n = tl.arange(0, BLOCK_N)
    rmask, pmask = offs_r < R, offs_p < DR
    q_row = Q + b * stride_qb + heads[:, None] * stride_qh
    q_c = tl.load(q_row + offs_r[None, :], mask=hmask[:, None] & rmask[None, :], other=0.0)
    q_p = tl.load(q_row + R + offs_p[None, :], mask=hmask[:, None] & pmask[None, :], other=0.0)
    q_c, q_p = q_c.to(DOT), q_p.to(DOT)  # (BLOCK_H, BLOCK_R), (BLOCK_H, BLOCK_DR)
    row = ReqToToken + tl.load(ReqIdx + b).to(tl.int64) * stride_rt
    # this split's key range [s_lo, s_hi) of the row's [0, seq_len)
    seq_len = tl.load(SeqLens + b).to(tl.int64)
    chunk = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    s_lo = split * chunk
    s_hi = tl.minimum(s_lo + chunk, seq_len)
    m_i = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_H,), tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_R), tl.float32)
    for start in range(s_lo, s_hi, BLOCK_N):  # data-dependent trip count, fixed grid
        pos = start + offs_n
        nmask = pos < s_hi
        # slot 0 is the pool's scratch slot: out-of-range lanes read it and are masked below
        slots = tl.load(row + pos, mask=nmask, other=0).to(tl.int64)
        lat = Lat + slots[:, None] * stride_lat
        c = tl.load(lat + offs_r[None, :], mask=rmask[None, :], other=0.0).to(DOT)
        pe = tl.load(lat + R + offs_p[None, :], mask=pmask[None, :], other=0.0).to(DOT)
        # c (BLOCK_N, BLOCK_R), pe (BLOCK_N, BLOCK_DR): one load for all BLOCK_H heads
        s = tl.dot(q_c, tl.trans(c), input_precision=PREC)
        s += tl.dot(q_p, tl.trans(pe), input_precision=PREC)
        s = tl.where(nmask[None, :], s * scale_log2, float("-inf"))  # (BLOCK_H, BLOCK_N)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT), c, input_precision=PREC)
        m_i = m_new
    has = l_i > 0  # a split past the row's end has no keys: output 0, lse -inf
    o = acc / tl.where(has, l_i, 1.0)[:, None]
    st_mask = hmask[:, None] & rmask[None, :]
    if NUM_SPLITS == 1:
        o_ptr = Out + b * stride_ob + heads[:, None] * stride_oh + offs_r[None, :]
        tl.store(o_ptr, o.to(Out.dtype.element_ty), mask=st_mask)
    else:
        lse = tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) / 1.4426950408889634,
                       float("-inf"))  # natural log, as _decode_stage2 merges
        base = (b * H + heads) * NUM_SPLITS + split  # (BLOCK_H,) rows of (B, H, S)
        tl.store(OPart + base[:, None] * BLOCK_R + offs_r[None, :], o, mask=st_mask)
        tl.store(LsePart + base, lse, mask=hmask)


def num_splits(batch: int, num_heads: int, device: torch.device,
               max_context_len: Optional[int] = None, block_h: int = BLOCK_H) -> int:
    """Key splits per row: enough programs for ~2 waves over the SMs, never more splits than key
    blocks; a power of two (each value is a compile of both kernels, see triton_decode's
    default_num_splits). Shapes only: stable for a CUDA graph. 1 off CUDA (the interpreter runs
    programs one by one: fewer, bigger ones are faster)."""
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    programs = batch * triton.cdiv(num_heads, block_h)
    splits = min(MAX_SPLITS, max(1, math.ceil(2 * sms / max(1, programs))))
    if max_context_len is not None:
        splits = min(splits, max(1, triton.cdiv(max_context_len, BLOCK_N)))
    return 1 << (splits.bit_length() - 1)


def scratch_numel(batch: int, num_heads: int, r: int, splits: int) -> int:
    """fp32 elements of the stage-1 scratch: partials (B, H, S, BLOCK_R) and lse (B, H, S)."""
    if splits == 1:
        return 0
    return batch * num_heads * splits * (max(16, triton.next_power_of_2(r)) + 1)


def decode(q_lat: torch.Tensor, buf: torch.Tensor, req_to_token: torch.Tensor,
           req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, r: int, scale: float,
           *, out: Optional[torch.Tensor] = None, scratch: Optional[torch.Tensor] = None,
           splits: Optional[int] = None, block_h: int = BLOCK_H, block_n: int = BLOCK_N,
           num_warps: int = 4, num_stages: Optional[int] = None) -> torch.Tensor:
    """q_lat (B, H, r + dr); buf (capacity + 1, r + dr) the layer's latents -> out (B, H, r).

    req_pool_indices, seq_lens (B,) int on the device (every row has seq_len >= 1). scratch: a
    flat fp32 tensor of >= scratch_numel(B, H, r, splits) elements (None: allocated here, which
    the caller of a CUDA graph avoids by passing its persistent one). splits None: num_splits."""
    q_lat = q_lat.contiguous()
    bsz, h, w = q_lat.shape
    if buf.stride(1) != 1 or req_to_token.stride(1) != 1:
        raise ValueError("the latent pool and req_to_token must be row-contiguous")
    if out is None:
        out = q_lat.new_empty(bsz, h, r)
    assert out.shape == (bsz, h, r) and out.stride(2) == 1
    if bsz == 0:
        return out
    splits = splits or num_splits(bsz, h, q_lat.device, block_h=block_h)
    need = scratch_numel(bsz, h, r, splits)
    if scratch is None:
        scratch = torch.empty(max(need, 1), dtype=torch.float32, device=q_lat.device)
    assert scratch.dtype == torch.float32 and scratch.numel() >= need, "MLA scratch too small"
    block_r = max(16, triton.next_power_of_2(r))
    n_o = bsz * h * splits * block_r
    # (B, H, S, BLOCK_R) and (B, H, S); one split writes `out` directly and never reads these
    o_part, lse_part = (scratch[:n_o], scratch[n_o:need]) if splits > 1 else (scratch, scratch)
    dt = dot_dtype(q_lat.dtype, buf.dtype)
    if num_stages is None:
        # shared memory: a (BLOCK_N, 512) latent tile is 64 KB in fp32, 32 KB in bf16; one
        # pipeline stage in fp32 keeps the tiles under the per-block limit (not tuned on a GPU)
        num_stages = 1 if dt == tl.float32 else 2
    _mla_stage1[(bsz, triton.cdiv(h, block_h), splits)](
        q_lat, buf, req_to_token, req_pool_indices, seq_lens, out, o_part, lse_part,
        q_lat.stride(0), q_lat.stride(1), buf.stride(0), req_to_token.stride(0),
        out.stride(0), out.stride(1), h, r, w - r, scale * LOG2E,
        BLOCK_H=block_h, BLOCK_R=block_r, BLOCK_DR=max(16, triton.next_power_of_2(w - r)),
        BLOCK_N=block_n, NUM_SPLITS=splits, DOT=dt, PREC=dot_precision(dt),
        num_warps=num_warps, num_stages=num_stages)
    if splits > 1:
        _decode_stage2[(bsz, h)](
            o_part, lse_part, out, out, out.stride(0), out.stride(1), 0,
            D=r, BLOCK_D=block_r, NUM_SPLITS=splits, BLOCK_S=triton.next_power_of_2(splits),
            HAS_LSE=False, num_warps=4)
    return out
