"""Extend (prefill) attention over the paged KV pool (Triton): all sequences of a batch, one launch.

`extend_attention`: sequence s owns the query rows `q[qo_indptr[s] : qo_indptr[s+1]]` (n_q rows)
and the keys at slots `req_to_token[req_pool_indices[s], kv_start[s] : kv_start[s] + kv_len[s]]`
(all read in place from the pool: the new tokens' K/V were written there before). causal=True:
query i (0-based in its sequence) sees keys j (0-based in the range) with j <= kv_len - n_q + i,
i.e. the queries are the last n_q positions of the range. causal=False: every query sees the whole
range (shared-prefix "cascade" attention: many requests' queries against one shared prefix run).
window > 0 (causal only): query i also sees only keys j > kv_len - n_q + i - window. softcap > 0:
scores softcap * tanh(score / softcap), before the mask.

Grid (S, cdiv(max_q_len * G, BLOCK_M), Hkv). A program takes BLOCK_M rows of the flattened
(query, head-of-group) space of one KV head, so with GQA one K/V tile serves all G query heads
(row r -> query r // G, head kv_head * G + r % G). Programs past a short sequence's end return at
once. The key loop runs in two parts: blocks every row of the tile may see in full (no mask
arithmetic), then the diagonal blocks with the causal / length mask. With a window the loop starts
at the tile's first key in any row's window, and the blocks where some rows' windows begin come
first, masked like the diagonal ones.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from radixlm.runtime.attention.triton_decode import (INDEX_ARGS, LOG2E, _online_softmax_step,
                                                     dot_dtype, dot_precision)


@triton.jit
def _masked_block(q, K, V, kv_row, n0, q_pos, kv_len, window, m_i, l_i, acc, scale_log2, cap2,
                  cap_k, kvh, stride_kt, stride_kh, stride_vt, stride_vh,
                  BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, D: tl.constexpr,
                  CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_CAP: tl.constexpr,
                  DOT: tl.constexpr, PREC: tl.constexpr):
    """Keys [n0, n0 + BLOCK_N) of the range with the length, causal and window masks; q_pos
    (BLOCK_M,) is each row's position in the range (kv_len - n_q + query index)."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    pos = n0 + offs_n  # (BLOCK_N,) key index within the range
    n_ok = pos < kv_len
    # slot 0 is the pool's scratch slot: out-of-range lanes read it and are masked
    slots = tl.load(kv_row + pos, mask=n_ok, other=0).to(tl.int64)
    k = tl.load(K + slots[:, None] * stride_kt + kvh * stride_kh + offs_d[None, :],
                mask=d_ok[None, :], other=0.0).to(DOT)
    v = tl.load(V + slots[:, None] * stride_vt + kvh * stride_vh + offs_d[None, :],
                mask=d_ok[None, :], other=0.0).to(DOT)
    s_mask = n_ok[None, :]
    if CAUSAL:
        s_mask = s_mask & (pos[None, :] <= q_pos[:, None])
    if HAS_WINDOW:
        s_mask = s_mask & (pos[None, :] > q_pos[:, None] - window)
    return _online_softmax_step(q, k, v, s_mask, m_i, l_i, acc, scale_log2, cap2, cap_k,
                                DOT, PREC, HAS_CAP)


@triton.jit(do_not_specialize_on_alignment=INDEX_ARGS)
def _extend_kernel(Q, K, V, Out, Lse, R2T, ReqIdx, QoIndptr, KvStart, KvLen, scale_log2,
                   window, cap2, cap_k,
                   stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                   stride_ot, stride_oh, stride_lt, stride_r2t,
                   G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                   HAS_LSE: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_CAP: tl.constexpr,
                   DOT: tl.constexpr, PREC: tl.constexpr):
    seq = tl.program_id(0)
    mblk = tl.program_id(1)
    kvh = tl.program_id(2)
    q_lo = tl.load(QoIndptr + seq).to(tl.int64)
    n_q = tl.load(QoIndptr + seq + 1).to(tl.int64) - q_lo
    if mblk * BLOCK_M < n_q * G:  # else: a q-block past this sequence's end, nothing to do
        rows = mblk * BLOCK_M + tl.arange(0, BLOCK_M)  # flattened (query, head-in-group)
        qi = rows // G  # (BLOCK_M,) query index within the sequence
        heads = kvh * G + rows % G  # (BLOCK_M,) absolute query head
        row_ok = qi < n_q
        offs_d = tl.arange(0, BLOCK_D)
        offs_n = tl.arange(0, BLOCK_N)
        d_ok = offs_d < D
        q = tl.load(Q + (q_lo + qi)[:, None] * stride_qt + heads[:, None] * stride_qh
                    + offs_d[None, :], mask=row_ok[:, None] & d_ok[None, :],
                    other=0.0).to(DOT)  # (BLOCK_M, BLOCK_D)

        kv_len = tl.load(KvLen + seq).to(tl.int64)
        kv_row = (R2T + tl.load(ReqIdx + seq).to(tl.int64) * stride_r2t
                  + tl.load(KvStart + seq).to(tl.int64))  # slots of key 0 of the range
        if CAUSAL:
            first_q = (mblk * BLOCK_M) // G
            last_q = tl.minimum((mblk * BLOCK_M + BLOCK_M - 1) // G, n_q - 1)
            # keys < full_end are visible to every row of the tile; keys >= end to none
            full_end = tl.maximum(tl.minimum(kv_len - n_q + first_q + 1, kv_len), 0)
            end = tl.maximum(tl.minimum(kv_len - n_q + last_q + 1, kv_len), 0)
        else:
            full_end = kv_len
            end = kv_len
        full_end = (full_end // BLOCK_N) * BLOCK_N
        q_pos = kv_len - n_q + qi  # (BLOCK_M,) each row's position in the range

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        start = 0  # HAS_WINDOW is a compile-time branch: without it the loops are as before
        if HAS_WINDOW:  # (CAUSAL) row i sees keys j > q_pos[i] - window
            # keys below `start` are outside every row's window; below `win_end` outside some
            # rows' (masked blocks); start <= win_end <= full_end, block-aligned
            start = (tl.maximum(kv_len - n_q + first_q - window + 1, 0) // BLOCK_N) * BLOCK_N
            win_end = tl.cdiv(tl.maximum(kv_len - n_q + last_q - window + 1, 0), BLOCK_N) * BLOCK_N
            win_end = tl.maximum(tl.minimum(win_end, full_end), start)
            for n0 in range(start, win_end, BLOCK_N):  # blocks where some rows' windows begin
                m_i, l_i, acc = _masked_block(q, K, V, kv_row, n0, q_pos, kv_len, window, m_i,
                                              l_i, acc, scale_log2, cap2, cap_k, kvh, stride_kt,
                                              stride_kh, stride_vt, stride_vh, BLOCK_N, BLOCK_D,
                                              D, CAUSAL, HAS_WINDOW, HAS_CAP, DOT, PREC)
            start = win_end
        for n0 in range(start, full_end, BLOCK_N):  # interior blocks: no masks
            slots = tl.load(kv_row + n0 + offs_n).to(tl.int64)  # (BLOCK_N,)
            k = tl.load(K + slots[:, None] * stride_kt + kvh * stride_kh + offs_d[None, :],
                        mask=d_ok[None, :], other=0.0).to(DOT)  # (BLOCK_N, BLOCK_D)
            v = tl.load(V + slots[:, None] * stride_vt + kvh * stride_vh + offs_d[None, :],
                        mask=d_ok[None, :], other=0.0).to(DOT)
            m_i, l_i, acc = _online_softmax_step(q, k, v, True, m_i, l_i, acc, scale_log2,
                                                 cap2, cap_k, DOT, PREC, HAS_CAP)
        for n0 in range(full_end, end, BLOCK_N):  # diagonal / tail blocks: masked
            m_i, l_i, acc = _masked_block(q, K, V, kv_row, n0, q_pos, kv_len, window, m_i, l_i,
                                          acc, scale_log2, cap2, cap_k, kvh, stride_kt,
                                          stride_kh, stride_vt, stride_vh, BLOCK_N, BLOCK_D, D,
                                          CAUSAL, HAS_WINDOW, HAS_CAP, DOT, PREC)

        has = l_i > 0
        o = acc / tl.where(has, l_i, 1.0)[:, None]  # rows that see no key: 0
        tl.store(Out + (q_lo + qi)[:, None] * stride_ot + heads[:, None] * stride_oh
                 + offs_d[None, :], o.to(Out.dtype.element_ty),
                 mask=row_ok[:, None] & d_ok[None, :])
        if HAS_LSE:
            lse = tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) / 1.4426950408889634,
                           float("-inf"))  # natural log
            tl.store(Lse + (q_lo + qi) * stride_lt + heads, lse, mask=row_ok)


def default_config(d: int, device: torch.device,
                   dtype: torch.dtype = torch.bfloat16) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages). Compiled for sm_90 with Triton 3.7 (ptxas -v,
    bf16, D 128): 128/64/8/2 uses 255 registers and spills ~300 bytes; 64/32/4/2 spills none.
    fp32 (tests only; products on CUDA cores): 128/64 tiles spill 28-60 KB per thread, 64/32/4/2
    the least (0.9 KB at D 64, 2.5 KB at D 128).
    Timed on an H100 (benchmarks/probes/gpu_probe.py attn, bf16, Hq 32, Hkv 8, D 128), ms per
    call, 128/64/8/2 -> 64/64/4/4: prefill 1 x 2048 0.204 -> 0.139; a 2048 chunk after 2048 cached
    0.503 -> 0.341; 64 x 64 new on 2048 cached 0.878 -> 0.479; the shared-prefix decode's
    32 groups x 16 queries on 2048 (non-causal) 0.236 -> 0.104, the best of 8 configs there and
    within 6% of the best elsewhere. D <= 64 was not timed."""
    if device.type != "cuda":
        return 64, 64, 4, 1  # the interpreter runs programs one by one: few, big tiles
    if dtype == torch.float32:
        return 64, 32, 4, 2
    if d <= 64:
        return 128, 64, 4, 2
    return 64, 64, 4, 4


def extend_attention(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
                     req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                     qo_indptr: torch.Tensor, kv_start: torch.Tensor, kv_len: torch.Tensor,
                     causal: bool, scale: float, out: torch.Tensor,
                     lse_out: Optional[torch.Tensor] = None, max_q_len: int = 0,
                     config: Optional[tuple[int, int, int, int]] = None, *, window: int = 0,
                     softcap: float = 0.0) -> torch.Tensor:
    """Attention of q (T, Hq, D) for S sequences in one launch; writes and returns out (T, Hq, D).

    req_pool_indices, kv_start, kv_len (S,) and qo_indptr (S+1,) are int device tensors; k_buf /
    v_buf (slots, Hkv, D), last dim contiguous. max_q_len must be >= every sequence's query count
    (it sizes the grid; a host-side int so no sync is needed). lse_out (T, Hq) fp32, if given,
    gets the natural-log sum-exp of each row's scaled scores (-inf and out 0 where a row sees no
    key). Rows of q outside every sequence are left untouched in out. config: (BLOCK_M, BLOCK_N,
    num_warps, num_stages) tuning override, blocks >= 16 (None: `default_config`).
    window > 0 (causal only) / softcap > 0: see the module docstring (plain numbers: kernel
    arguments, 0 compiles the kernel without them).
    """
    t, hq, d = q.shape
    hkv = k_buf.shape[1]
    n_seq = req_pool_indices.shape[0]
    assert hq % hkv == 0 and k_buf.shape[2] == d and out.shape == q.shape
    assert q.stride(2) == 1 and out.stride(2) == 1 and k_buf.stride(2) == 1 and v_buf.stride(2) == 1
    assert qo_indptr.shape[0] == n_seq + 1 and kv_start.shape[0] == n_seq == kv_len.shape[0]
    assert causal or not window, "a sliding window needs causal attention"
    if n_seq == 0 or max_q_len <= 0 or t == 0:
        return out
    g = hq // hkv
    block_m, block_n, warps, stages = config or default_config(d, q.device, q.dtype)
    if lse_out is not None:
        assert lse_out.dtype == torch.float32 and lse_out.shape == (t, hq)
        assert lse_out.stride(1) == 1
    dt = dot_dtype(q.dtype, k_buf.dtype)
    grid = (n_seq, triton.cdiv(max_q_len * g, block_m), hkv)
    _extend_kernel[grid](
        q, k_buf, v_buf, out, lse_out if lse_out is not None else out, req_to_token,
        req_pool_indices, qo_indptr, kv_start, kv_len, scale * LOG2E, int(window),
        softcap * LOG2E, 2.0 / softcap if softcap else 0.0,
        q.stride(0), q.stride(1), k_buf.stride(0), k_buf.stride(1), v_buf.stride(0),
        v_buf.stride(1), out.stride(0), out.stride(1),
        lse_out.stride(0) if lse_out is not None else 0, req_to_token.stride(0),
        G=g, D=d, BLOCK_D=max(16, triton.next_power_of_2(d)), BLOCK_M=block_m, BLOCK_N=block_n,
        CAUSAL=causal, HAS_LSE=lse_out is not None, HAS_WINDOW=window > 0,
        HAS_CAP=softcap > 0, DOT=dt, PREC=dot_precision(dt), num_warps=warps, num_stages=stages)
    return out
