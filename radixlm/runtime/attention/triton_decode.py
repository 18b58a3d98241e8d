"""Flash-decoding over the paged KV pool (Triton): one query token per row, K/V read in place.

`decode_attention`: query row b attends to the keys at slots
`req_to_token[req_pool_indices[b], kv_start[b] : seq_lens[b]]` (no causal mask: all of them);
with a sliding `window` only to the last `window` of them (the key loop starts there), and with a
logit `softcap` c the scores are c * tanh(score / c).

Two stages, CUDA-graph safe (fixed grids, no host sync, no data-dependent allocation):
- stage 1, grid (B, Hkv, S): program (b, h, s) takes the G = Hq / Hkv query heads of KV head h
  together (one K/V read serves all of them) and the s-th of S equal splits of the row's key range,
  each split ceil(len / S) keys rounded up to BLOCK_N. Its loop trip count is read from device
  tensors, so the grid never depends on data. It writes the split's normalized partial output and
  its log-sum-exp into a scratch buffer.
- stage 2, grid (B, Hq): merges the S partials by log-sum-exp.
With S == 1 stage 1 writes `out`/`lse_out` directly and stage 2 is skipped.

Numerics: scores and the softmax in fp32 (exp2 with log2(e) folded into the scale), products on
tensor cores in the storage dtype (fp32 products in IEEE precision, never TF32).
"""

from __future__ import annotations

import math
import os
from typing import Optional

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from radixlm.runtime.layers.triton_ops import pdl

LOG2E = 1.4426950408889634
BLOCK_N = 64  # keys per inner-loop step
MAX_SPLITS = 16
# Per-request index arrays (request rows, key ranges, lengths) arrive as slices of one packed
# host->device copy, so whether their address is 16-byte aligned changes from step to step.
# Triton compiles one kernel per alignment pattern of its pointer arguments, so each new pattern
# was a compile in the middle of serving (the likely reason an H100 shared-prefix run took 15.8 s
# on a fresh machine and 9.9 s once Triton's disk cache was warm). These are read a scalar at a
# time, so alignment buys nothing for them.
INDEX_ARGS = ["ReqIdx", "KvStart", "SeqLens", "QoIndptr", "KvLen"]


def interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def dot_dtype(*dtypes: torch.dtype):
    """The dtype `tl.dot` runs in: the storage dtype when every operand is bf16/fp16 alike, else
    fp32. The interpreter (Triton 3.6) multiplies bf16 as raw uint16 bits, so it gets fp32 too."""
    if interpreted() or len(set(dtypes)) != 1 or dtypes[0] == torch.float32:
        return tl.float32
    return {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}[dtypes[0]]


def dot_precision(dt) -> str:
    # fp32 operands: full IEEE products (TF32 would cost ~1e-3 relative error)
    return "ieee" if dt == tl.float32 else "tf32"


@triton.jit
def _online_softmax_step(q, k, v, s_mask, m_i, l_i, acc, scale_log2, cap2, cap_k,
                         DOT: tl.constexpr, PREC: tl.constexpr, HAS_CAP: tl.constexpr):
    """One block of online softmax. q (M, BD), k/v (N, BD) in DOT dtype; s_mask (M, N) bool or
    None-like True; m_i, l_i (M,) fp32 in log2 units; acc (M, BD) fp32. Returns new m_i, l_i, acc.
    Fully masked rows keep m_i = -inf, l_i = 0, acc = 0 (no NaN: the max is made safe).
    HAS_CAP: logit soft-cap c, applied before the mask: with cap2 = c * log2(e), cap_k = 2 / c,
    s <- cap2 * tanh(s / cap2) where tanh(y) = 1 - 2 / (e^2y + 1) and e^2y = 2^(s * cap_k)
    (overflow to inf gives 1, underflow to 0 gives -1)."""
    s = tl.dot(q, tl.trans(k), input_precision=PREC) * scale_log2  # (M, N) fp32
    if HAS_CAP:
        s = cap2 * (1.0 - 2.0 / (tl.exp2(s * cap_k) + 1.0))
    s = tl.where(s_mask, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[:, None])  # (M, N)
    alpha = tl.exp2(m_i - m_safe)  # (M,) rescale of what was accumulated so far
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(DOT), v, input_precision=PREC)
    return m_new, l_i, acc


@triton.jit(do_not_specialize_on_alignment=INDEX_ARGS)
def _decode_stage1(Q, K, V, R2T, ReqIdx, KvStart, SeqLens, Out, Lse, OPart, LsePart,
                   scale_log2, window, cap2, cap_k,
                   stride_qb, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                   stride_ob, stride_oh, stride_lb, stride_r2t,
                   G: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr,
                   BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
                   HAS_START: tl.constexpr, HAS_LSE: tl.constexpr, HAS_WINDOW: tl.constexpr,
                   HAS_CAP: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr,
                   PDL: tl.constexpr = False):
    if PDL:  # (layers/triton_ops.pdl)
        gdc_launch_dependents()
        gdc_wait()
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    offs_h = tl.arange(0, BLOCK_H)  # query heads of this KV group, padded to BLOCK_H rows
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    h_ok = offs_h < G
    d_ok = offs_d < D
    heads = kvh * G + offs_h  # (BLOCK_H,) absolute query heads

    # key range of this row and of this split: [lo, hi)
    hi = tl.load(SeqLens + b).to(tl.int64)
    lo = hi * 0
    if HAS_START:
        lo = tl.load(KvStart + b).to(tl.int64)
    if HAS_WINDOW:  # the query is at position hi - 1: it sees the keys in [hi - window, hi)
        lo = tl.maximum(lo, hi - window)
    n = tl.maximum(hi - lo, 0)
    chunk = tl.cdiv(tl.cdiv(n, NUM_SPLITS), BLOCK_N) * BLOCK_N
    s_lo = lo + split * chunk
    s_hi = tl.minimum(s_lo + chunk, hi)

    q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=h_ok[:, None] & d_ok[None, :], other=0.0).to(DOT)  # (BLOCK_H, BLOCK_D)
    row = R2T + tl.load(ReqIdx + b).to(tl.int64) * stride_r2t
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for n0 in range(s_lo, s_hi, BLOCK_N):  # data-dependent trip count, fixed grid
        pos = n0 + offs_n
        n_ok = pos < s_hi
        # slot 0 is the pool's scratch slot: out-of-range lanes read it and are masked below
        slots = tl.load(row + pos, mask=n_ok, other=0).to(tl.int64)  # (BLOCK_N,)
        k = tl.load(K + slots[:, None] * stride_kt + kvh * stride_kh + offs_d[None, :],
                    mask=d_ok[None, :], other=0.0).to(DOT)  # (BLOCK_N, BLOCK_D)
        v = tl.load(V + slots[:, None] * stride_vt + kvh * stride_vh + offs_d[None, :],
                    mask=d_ok[None, :], other=0.0).to(DOT)
        m_i, l_i, acc = _online_softmax_step(q, k, v, n_ok[None, :], m_i, l_i, acc, scale_log2,
                                             cap2, cap_k, DOT, PREC, HAS_CAP)

    has = l_i > 0
    o = acc / tl.where(has, l_i, 1.0)[:, None]  # (BLOCK_H, BLOCK_D), 0 for empty rows
    lse = tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) / 1.4426950408889634,
                   float("-inf"))  # natural log
    st_mask = h_ok[:, None] & d_ok[None, :]
    if NUM_SPLITS == 1:
        tl.store(Out + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
                 o.to(Out.dtype.element_ty), mask=st_mask)
        if HAS_LSE:
            tl.store(Lse + b * stride_lb + heads, lse, mask=h_ok)
    else:
        # OPart (B, Hq, S, BLOCK_D) and LsePart (B, Hq, S), contiguous
        base = (b * (G * tl.num_programs(1)) + heads) * NUM_SPLITS + split  # (BLOCK_H,)
        tl.store(OPart + base[:, None] * BLOCK_D + offs_d[None, :], o, mask=st_mask)
        tl.store(LsePart + base, lse, mask=h_ok)


@triton.jit
def _decode_stage2(OPart, LsePart, Out, Lse, stride_ob, stride_oh, stride_lb,
                   D: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr,
                   BLOCK_S: tl.constexpr, HAS_LSE: tl.constexpr, PDL: tl.constexpr = False):
    if PDL:  # (layers/triton_ops.pdl)
        gdc_launch_dependents()
        gdc_wait()
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_ok = offs_s < NUM_SPLITS
    base = (b * tl.num_programs(1) + h) * NUM_SPLITS
    lse = tl.load(LsePart + base + offs_s, mask=s_ok, other=float("-inf"))  # (BLOCK_S,)
    m = tl.max(lse, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse - m_safe)  # 0 for empty splits
    w_sum = tl.sum(w, 0)
    o = tl.load(OPart + (base + offs_s[:, None]) * BLOCK_D + offs_d[None, :],
                mask=s_ok[:, None], other=0.0)  # (BLOCK_S, BLOCK_D)
    has = w_sum > 0
    o = tl.sum(o * w[:, None], 0) / tl.where(has, w_sum, 1.0)
    tl.store(Out + b * stride_ob + h * stride_oh + offs_d, o.to(Out.dtype.element_ty),
             mask=offs_d < D)
    if HAS_LSE:
        tl.store(Lse + b * stride_lb + h,
                 tl.where(has, m_safe + tl.log(tl.where(has, w_sum, 1.0)), float("-inf")))


def default_num_splits(batch: int, num_kv_heads: int, device: torch.device,
                       max_context_len: Optional[int] = None) -> int:
    """Splits per row: enough programs to fill the GPU (~2 waves of (B, Hkv) groups), never more
    splits than key blocks. Depends on shapes only, so one CUDA graph per batch size is stable.

    A power of two: NUM_SPLITS is a compile-time constant of both kernels, so every distinct value
    is a Triton compile (~0.5 s on an H100). The exact count took ten values over batch sizes
    1..32, and the batch sizes CUDA graphs capture at start-up compiled only half of them: the
    rest compiled in the middle of serving, at the first mixed step with that many decode rows
    (measured: 0.7-0.9 s extend steps instead of ~0.1 s). Powers of two give 1, 2, 4, 8, 16, all
    compiled by the capture of buckets 1..32."""
    if device.type != "cuda":
        return 1  # the interpreter runs programs one by one: fewer, bigger ones are faster
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    splits = min(MAX_SPLITS, max(1, math.ceil(2 * sms / max(1, batch * num_kv_heads))))
    if max_context_len is not None:
        splits = min(splits, max(1, triton.cdiv(max_context_len, BLOCK_N)))
    return 1 << (splits.bit_length() - 1)  # round down: at most 2x fewer programs than asked


def scratch_numel(batch: int, num_q_heads: int, head_dim: int, num_splits: int) -> int:
    """fp32 elements of the stage-1 scratch: partial outputs (B, Hq, S, BLOCK_D), lse (B, Hq, S)."""
    if num_splits == 1:
        return 0
    block_d = max(16, triton.next_power_of_2(head_dim))
    return batch * num_q_heads * num_splits * (block_d + 1)


def decode_attention(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
                     req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                     kv_start: Optional[torch.Tensor], seq_lens: torch.Tensor, scale: float,
                     out: torch.Tensor, lse_out: Optional[torch.Tensor] = None,
                     scratch: Optional[torch.Tensor] = None, num_splits: Optional[int] = None,
                     *, window: int = 0, softcap: float = 0.0, block_n: int = BLOCK_N,
                     num_warps: int = 4, num_stages: int = 2) -> torch.Tensor:
    """Decode attention of q (B, Hq, D) over the pool; writes and returns `out` (B, Hq, D).

    k_buf/v_buf (slots, Hkv, D) bf16/fp16/fp32, last dim contiguous; req_to_token (rows, ctx) int;
    req_pool_indices, seq_lens, kv_start (B,) int (kv_start None = 0). Row b's keys are slots
    `req_to_token[req_pool_indices[b], kv_start[b]:seq_lens[b]]`. lse_out (B, Hq) fp32, if given,
    gets the natural-log sum-exp of the scaled scores; an empty range gives out 0, lse -inf.
    scratch: flat fp32 tensor of at least `scratch_numel(B, Hq, D, num_splits)` elements (None:
    allocated here, which a CUDA graph must avoid). num_splits None: `default_num_splits`.
    window > 0: row b sees only its last `window` keys (kv_start still bounds them from below);
    softcap > 0: scores softcap * tanh(score / softcap). Both plain Python numbers (per-layer
    constants), so CUDA graphs capture them as kernel arguments; 0 compiles the kernel without.
    block_n / num_warps / num_stages: stage-1 tuning knobs (keys per step, block_n >= 16).
    """
    bsz, hq, d = q.shape
    hkv = k_buf.shape[1]
    assert hq % hkv == 0 and k_buf.shape[2] == d and out.shape == q.shape
    assert q.stride(2) == 1 and out.stride(2) == 1 and k_buf.stride(2) == 1 and v_buf.stride(2) == 1
    if bsz == 0:
        return out
    g = hq // hkv
    splits = num_splits or default_num_splits(bsz, hkv, q.device)
    block_d = max(16, triton.next_power_of_2(d))
    need = scratch_numel(bsz, hq, d, splits)
    if scratch is None:
        scratch = torch.empty(max(need, 1), dtype=torch.float32, device=q.device)
    assert scratch.dtype == torch.float32 and scratch.numel() >= need, "decode scratch too small"
    n_o = bsz * hq * splits * block_d
    o_part, lse_part = scratch[:n_o], scratch[n_o:need]  # (B, Hq, S, BLOCK_D), (B, Hq, S)
    lse_arg = lse_out if lse_out is not None else out  # placeholder pointer when not written
    lse_stride = lse_out.stride(0) if lse_out is not None else 0
    if lse_out is not None:
        assert lse_out.dtype == torch.float32 and lse_out.stride(1) == 1
    dt = dot_dtype(q.dtype, k_buf.dtype)
    use_pdl = q.is_cuda and pdl(q.device)
    _decode_stage1[(bsz, hkv, splits)](
        q, k_buf, v_buf, req_to_token, req_pool_indices,
        kv_start if kv_start is not None else seq_lens, seq_lens, out, lse_arg, o_part, lse_part,
        scale * LOG2E, int(window), softcap * LOG2E, 2.0 / softcap if softcap else 0.0,
        q.stride(0), q.stride(1), k_buf.stride(0), k_buf.stride(1),
        v_buf.stride(0), v_buf.stride(1), out.stride(0), out.stride(1), lse_stride,
        req_to_token.stride(0),
        G=g, D=d, BLOCK_H=max(16, triton.next_power_of_2(g)), BLOCK_D=block_d, BLOCK_N=block_n,
        NUM_SPLITS=splits, HAS_START=kv_start is not None, HAS_LSE=lse_out is not None,
        HAS_WINDOW=window > 0, HAS_CAP=softcap > 0, DOT=dt, PREC=dot_precision(dt),
        PDL=use_pdl, launch_pdl=use_pdl, num_warps=num_warps, num_stages=num_stages)
    if splits > 1:
        _decode_stage2[(bsz, hq)](
            o_part, lse_part, out, lse_arg, out.stride(0), out.stride(1), lse_stride,
            D=d, BLOCK_D=block_d, NUM_SPLITS=splits, BLOCK_S=triton.next_power_of_2(splits),
            HAS_LSE=lse_out is not None, PDL=use_pdl, launch_pdl=use_pdl, num_warps=4)
    return out
