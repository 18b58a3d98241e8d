"""The int4 GEMM (M > 1: decode batches, prefill) of layers/int4_linear.py, over the layout and
the exact nibble -> fp32 step of layers/triton_int4.py (read its docstring first).

(BLOCK_M, BLOCK_N) output tiles, K in steps of BLOCK_K values; per step ONE tensor-core dot
(BLOCK_M, BLOCK_K) x (BLOCK_K, BLOCK_N) with fp32 accumulation:
  - the step's words are loaded once, as (BLOCK_K/32 blocks, 4 words, BLOCK_N rows) (16-byte
    blocks, cp.async-pipelined by num_stages);
  - each of the 8 nibbles gives W_i = ((q_i - z) * s) rounded once to x's dtype, (q - z) exact in
    fp32 by the magic-number step, then the same fp32 product and rounding as
    Int4Linear.dequantized_weight (for fp16 / bf16 scales the product is exact: a 5-bit
    integer times a 16-bit float fits fp32's mantissa), so W is bit for bit the dequantized
    checkpoint's weight in x's dtype (the rounding point of the old 8-dot kernel too);
  - tl.join (thread-local: a new register axis) x 3, then permute + reshape put nibble i of
    word j of block b at row 32b + 4i + j: K's own column order, so x's (BLOCK_M, BLOCK_K)
    tile is one contiguous load (a gather through perm under act-order), and the single
    layout change, registers -> the dot's shared-memory operand, is one the dot needs anyway.
  (The old kernel ran 8 dots of K = BLOCK_K/8 a step, one per nibble: 0.28-0.39x of cuBLAS
  bf16 at M = 64 on the H200.) sm_90 compile (ptxas, tests/unit/test_triton_int4_compile.py):
  words and x cp.async-pipelined, one wgmma chain a step at BLOCK_M 64 (mma.sync below 64
  rows), no spills at the defaults. Per value ~4.5 ALU ops (LOP3, FADD, FMUL, half an F2FP)
  and one 2-byte shared store: Triton gives each thread one row n of the tile, so its values
  go to shared memory one by one (BLOCK_N 256 at 4 warps gives a thread 2 rows and packed
  stores: in the sweep).
Split-K (grid axis 2) for shapes with few tiles, reduced deterministically in the same launch.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from radixlm.runtime.layers.triton_int4 import MAGIC, _check, _nibble_minus_zero
from radixlm.runtime.layers.triton_int4_host import split_counters


@triton.jit
def _dequant_tile(words, zf, s, magic, DT: tl.constexpr, BLOCK_K: tl.constexpr,
                  BLOCK_N: tl.constexpr):
    # words (NB, 4, BLOCK_N) int32: block b (32 values), word j of each of BLOCK_N rows; zf, s
    # (NB, 1, BLOCK_N) fp32 (a block never straddles a group). -> (BLOCK_K, BLOCK_N) in DT,
    # row 32b + 4i + j = nibble i of word j of block b: the layout's own column order, so the
    # tile's rows are K's columns in order and x's tile is a plain contiguous load.
    # Each value: ((q - z) * s) rounded once to DT (the dequantized checkpoint's weight).
    whi = words >> 20
    d0 = (_nibble_minus_zero(words, whi, zf, magic, 0) * s).to(DT)
    d1 = (_nibble_minus_zero(words, whi, zf, magic, 1) * s).to(DT)
    d2 = (_nibble_minus_zero(words, whi, zf, magic, 2) * s).to(DT)
    d3 = (_nibble_minus_zero(words, whi, zf, magic, 3) * s).to(DT)
    d4 = (_nibble_minus_zero(words, whi, zf, magic, 4) * s).to(DT)
    d5 = (_nibble_minus_zero(words, whi, zf, magic, 5) * s).to(DT)
    d6 = (_nibble_minus_zero(words, whi, zf, magic, 6) * s).to(DT)
    d7 = (_nibble_minus_zero(words, whi, zf, magic, 7) * s).to(DT)
    # join appends a size-2 axis (registers of one thread: no data movement); the three levels
    # give (NB, 4, BLOCK_N, t, u, v) holding nibble i = t + 2u + 4v
    t = tl.join(tl.join(tl.join(d0, d1), tl.join(d2, d3)),
                tl.join(tl.join(d4, d5), tl.join(d6, d7)))
    t = tl.permute(t, (0, 5, 4, 3, 1, 2))  # (NB, v, u, t, 4, BLOCK_N): row 32b + 4i + j
    return tl.reshape(t, (BLOCK_K, BLOCK_N))


@triton.jit
def _step_zs(Z, S, s_col, kw, ob, n_ok, n_words, GROUP: tl.constexpr, BLOCK_K: tl.constexpr):
    # zeros, scales (as stored) of the step at word kw: (1, 1, BLOCK_N) when the step lies in
    # one group, else (NB, 1, BLOCK_N), a group per block; 0 past K
    if GROUP % BLOCK_K == 0:
        g = (kw * 8) // GROUP
        ok = n_ok[None, None, :] & (kw < n_words)
        z = tl.load(Z + s_col + g, mask=ok, other=0)
        s = tl.load(S + s_col + g, mask=ok, other=0.0)
    else:
        g = ((kw // 4 + ob) * 32) // GROUP
        ok = (kw // 4 + ob < n_words // 4)[:, None, None] & n_ok[None, None, :]
        z = tl.load(Z + s_col + g[:, None, None], mask=ok, other=0)
        s = tl.load(S + s_col + g[:, None, None], mask=ok, other=0.0)
    return z, s


@triton.jit
def _int4_gemm_kernel(X, QW, S, Z, P, B, Y, WS, CNT, M, N, K, words_per_split,
                      stride_xm, stride_ym, stride_qw, stride_s, magic,
                      GROUP: tl.constexpr, HAS_PERM: tl.constexpr, HAS_BIAS: tl.constexpr,
                      IEEE: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)  # split-K: words [pid_k * words_per_split, +words_per_split)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # (BLOCK_N,)
    m_ok, n_ok = rm < M, rn < N
    rn64 = rn.to(tl.int64)
    ob = tl.arange(0, BLOCK_K // 32)  # (NB,) NB = blocks of 32 values (4 words) a step
    oj = tl.arange(0, 4)
    # (NB, 4, BLOCK_N): each word of the step loaded once (4 contiguous words = 16 bytes a block)
    w_ptrs = QW + rn64[None, None, :] * stride_qw + (ob[:, None] * 4 + oj[None, :])[:, :, None]
    s_col = rn64[None, None, :] * stride_s  # (1, 1, BLOCK_N)
    ok_ = tl.arange(0, BLOCK_K)
    x_row = X + rm.to(tl.int64)[:, None] * stride_xm  # (BLOCK_M, 1)
    n_words = K // 8
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    kw_lo = pid_k * words_per_split
    kw_hi = tl.minimum(kw_lo + words_per_split, n_words)
    zf_next, s_next = _step_zs(Z, S, s_col, kw_lo, ob, n_ok, n_words, GROUP, BLOCK_K)
    for kw in range(kw_lo, kw_hi, BLOCK_K // 8):
        blk_ok = kw // 4 + ob < n_words // 4  # (NB,)
        if EVEN_K:
            words = tl.load(w_ptrs + kw, mask=n_ok[None, None, :], other=0)
        else:  # ragged last step: blocks past K read as 0 (their x columns are 0 too)
            words = tl.load(w_ptrs + kw, mask=blk_ok[:, None, None] & n_ok[None, None, :],
                            other=0)
        # this step's scales and zeros were loaded one step ahead: too small for cp.async
        # (1-2 bytes a thread), the pipeliner leaves them, and loaded here the dequant would
        # wait for them every step
        zf, s = zf_next.to(tl.float32), s_next.to(tl.float32)
        zf_next, s_next = _step_zs(Z, S, s_col, kw + BLOCK_K // 8, ob, n_ok, n_words, GROUP,
                                   BLOCK_K)
        cols = kw * 8 + ok_  # (BLOCK_K,) K's columns in order (the tile's row order)
        k_ok = cols < K
        if HAS_PERM:
            cols = tl.load(P + cols, mask=k_ok, other=0)
        a = tl.load(x_row + cols[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = _dequant_tile(words, zf, s, magic, X.dtype.element_ty, BLOCK_K, BLOCK_N)
        if IEEE:  # fp32 activations: no TF32 rounding of the inputs
            acc = tl.dot(a, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, w, acc)
    out_ok = m_ok[:, None] & n_ok[None, :]
    if SPLIT_K > 1:
        # deterministic split-K in one launch: each split stores its fp32 partial; the split
        # that arrives last at the tile's counter sums all partials in split order (the same
        # sums whichever arrives last), writes y and resets the counter for the next call
        mn = rm.to(tl.int64)[:, None] * N + rn[None, :]  # (BLOCK_M, BLOCK_N) in an (M, N) slab
        tl.store(WS + pid_k.to(tl.int64) * M * N + mn, acc, mask=out_ok)
        tl.debug_barrier()  # every thread's partial stored before the release below
        tile = pid_m * tl.num_programs(1) + pid_n
        if tl.atomic_add(CNT + tile, 1, sem="acq_rel") == SPLIT_K - 1:
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for sk in tl.static_range(SPLIT_K):
                acc += tl.load(WS + sk * M.to(tl.int64) * N + mn, mask=out_ok, other=0.0,
                               cache_modifier=".cg")  # (L2: other programs' stores)
            _gemm_store(acc, B, Y, rm, rn, out_ok, n_ok, stride_ym, HAS_BIAS)
            tl.atomic_xchg(CNT + tile, 0)
    else:
        _gemm_store(acc, B, Y, rm, rn, out_ok, n_ok, stride_ym, HAS_BIAS)


@triton.jit
def _gemm_store(acc, B, Y, rm, rn, out_ok, n_ok, stride_ym, HAS_BIAS: tl.constexpr):
    if HAS_BIAS:
        acc += tl.load(B + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    y_ptrs = Y + rm.to(tl.int64)[:, None] * stride_ym + rn[None, :]
    tl.store(y_ptrs, acc.to(Y.dtype.element_ty), mask=out_ok)


SMS = 132  # H100 / H200 SXM: the split-K choice aims at about one program per SM


def gemm_config(m: int, n: int, k: int, group: int) -> tuple[int, int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, SPLIT_K) per M bucket, from the sweep
    of benchmarks/int4_decode.py --kernels on an H100 (2026-11-27, Llama-3.1-8B's four
    projections, M = 16 / 64 / 128: results/int4_decode-gpu.jsonl):
    - decode batches (M <= 64): 64 x 64 tiles of W, BLOCK_K 64, 4 warps, 4 stages (the best or
      within ~10% of it at M = 16 and 64 for o, gate_up and down; M 17-32 takes BLOCK_M 32
      untimed), split-K up to ~2 programs per SM (the best splits were 4 for o and down);
    - M > 64 with fewer 128 x 128 tiles than SMs: 128 x 64 tiles, BLOCK_K 128, 8 warps, 4 stages,
      split-K up to ~1 program per SM (qkv, o, down at M = 128); otherwise 128 x 128 x 64, 8 warps, 3 stages,
      no split (gate_up at M = 128, and prefill)."""
    if m > 64:
        if triton.cdiv(m, 128) * triton.cdiv(n, 128) >= SMS:
            return 128, 128, 64, 8, 3, 1
        block_m, block_n, bk, warps = 128, 64, 128, 8
    else:
        block_m, block_n, bk, warps = max(16, triton.next_power_of_2(m)), 64, 64, 4
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    return block_m, block_n, bk, warps, 4, split_for(m, tiles, k, bk)


def split_for(m: int, tiles: int, k: int, bk: int) -> int:
    """The split-K of `tiles` output tiles: doubled while the programs stay within ~3 per SM
    (M <= 64; the best splits at M = 64 were 4 for o and down on an H100, and 4 for qkv's 96
    tiles on an H200: 21.4 us against 26.7 at split 2, 2026-11-29) or ~1 per SM (M > 64: 1-2
    were best at M = 128), with >= 4 steps of BLOCK_K a split, at most 8."""
    cap = SMS if m > 64 else 3 * SMS
    split = 1
    while split < 8 and tiles * split * 2 <= cap and k // (bk * split * 2) >= 4:
        split *= 2
    return split


_COUNTERS: dict = {}  # device -> (tiles,) int32 zeros: split-K arrival counters (self-resetting)


def _counters(device: torch.device, tiles: int) -> Optional[torch.Tensor]:
    """The split-K counters (all zero between calls: each call's last split resets its own),
    or None when they would first be allocated inside a CUDA graph capture (a capture records
    the zero-fill without running it: the caller then runs without split-K)."""
    return split_counters(_COUNTERS, device, tiles, 4096)


def gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
         group: int, bias: Optional[torch.Tensor] = None,
         config: Optional[tuple] = None,
         perm: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x (M, K) -> y (M, N) in x's dtype (layout in the module docstring). config: gemm_config's
    6 values (a 5-value one means SPLIT_K 1). Split-K assumes one stream at a time per device
    (the counters are shared)."""
    m, n, k = _check(x, qweight, scales, zeros, group, perm)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    block_m, block_n, block_k, warps, stages, *rest = config or gemm_config(m, n, k, group)
    split = rest[0] if rest else 1
    # whole 32-value blocks a step (a dot of K >= 16); BLOCK_N >= 16 (the dot's N)
    assert block_k >= 32 and block_k & (block_k - 1) == 0, block_k
    assert block_m >= 16 and block_n >= 16, (block_m, block_n)
    grid_mn = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    words = k // 8
    bw = block_k // 8
    per_split = triton.cdiv(triton.cdiv(words, bw), split) * bw  # whole steps a split
    split = triton.cdiv(words, per_split)
    cnt = _counters(x.device, grid_mn[0] * grid_mn[1]) if split > 1 else None
    if cnt is None:
        split, per_split = 1, words
    ws = torch.empty((split, m, n), dtype=torch.float32, device=x.device) if split > 1 else y
    _int4_gemm_kernel[grid_mn + (split,)](
        x, qweight, scales, zeros, perm if perm is not None else qweight,
        bias if bias is not None else scales, y, ws, cnt if cnt is not None else qweight,
        m, n, k, per_split, x.stride(0), y.stride(0),
        qweight.stride(0), scales.stride(0), MAGIC, GROUP=group, HAS_PERM=perm is not None,
        HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32, EVEN_K=k % block_k == 0,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split, num_warps=warps,
        num_stages=stages)
    return y
