"""The int4 GEMM (M > 1: decode batches, prefill) of layers/int4_linear.py, over the layout and
the exact nibble -> fp32 step of layers/triton_int4.py (read its docstring first).

(BLOCK_M, BLOCK_N) output tiles, K in steps of BLOCK_K values (BLOCK_K/8 words of each of
BLOCK_N rows); per step 8 tl.dot calls, one per nibble i: A_i = x[:, the columns of nibble i]
(BLOCK_M, BLOCK_K/8; runs of 4 contiguous columns), W_i = ((q_i - z) * s) rounded once to x's
dtype (BLOCK_K/8, BLOCK_N): exactly the dequantized checkpoint's weight; fp32 accumulation.
Split-K (grid axis 2) for shapes with few tiles, reduced deterministically in the same launch.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from radixlm.runtime.layers.triton_int4 import MAGIC, _check, _nibble_minus_zero


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
    oc = tl.arange(0, BLOCK_K // 8)  # (BW,) BW = words of a row a step = K of each dot
    w_ptrs = QW + rn.to(tl.int64)[None, :] * stride_qw + oc[:, None]  # (BW, BLOCK_N)
    xcol = (oc // 4) * 32 + (oc % 4)  # (BW,) column of nibble 0 of each word of a step
    x_row = X + rm.to(tl.int64)[:, None] * stride_xm  # (BLOCK_M, 1)
    s_col = rn.to(tl.int64)[None, :] * stride_s  # (1, BLOCK_N)
    n_words = K // 8
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    kw_lo = pid_k * words_per_split
    kw_hi = tl.minimum(kw_lo + words_per_split, n_words)
    for kw in range(kw_lo, kw_hi, BLOCK_K // 8):
        k_ok = kw + oc < n_words  # (BW,)
        if EVEN_K:
            words = tl.load(w_ptrs + kw, mask=n_ok[None, :], other=0)
        else:
            words = tl.load(w_ptrs + kw, mask=k_ok[:, None] & n_ok[None, :], other=0)
        if GROUP % BLOCK_K == 0:  # the step inside one group: a scale, zero per column
            g = (kw * 8) // GROUP
            zf = tl.load(Z + s_col + g, mask=n_ok[None, :], other=0).to(tl.float32)
            s = tl.load(S + s_col + g, mask=n_ok[None, :], other=0.0).to(tl.float32)
        else:  # (BW, BLOCK_N): each word row's group
            g = ((kw + (oc // 4) * 4) * 8) // GROUP
            ok = k_ok[:, None] & n_ok[None, :]
            zf = tl.load(Z + s_col + g[:, None], mask=ok, other=0).to(tl.float32)
            s = tl.load(S + s_col + g[:, None], mask=ok, other=0.0).to(tl.float32)
        whi = words >> 20
        for i in tl.static_range(8):
            cols = kw * 8 + xcol + 4 * i  # (BW,)
            if HAS_PERM:
                cols = tl.load(P + cols, mask=k_ok, other=0)
            a = tl.load(x_row + cols[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            w = (_nibble_minus_zero(words, whi, zf, magic, i) * s).to(a.dtype)  # (BW, BLOCK_N)
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
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, SPLIT_K), by reasoning (not yet
    measured: benchmarks/int4_decode.py --kernels sweeps GEMM_SWEEP).
    Decode batches (M <= 64), one row of tiles: every program reads all of its K range of x,
    M * 2 bytes a column against BLOCK_N / 2 bytes of weights, so a narrow BLOCK_N makes x's
    re-reads (L2 -> SM) outweigh the weights (BLOCK_N 32 at M 64: 4x). BLOCK_N 128 keeps x at
    2x the weight bytes at M 64 (less below) and gives wgmma a 64 x 128 tile; the programs
    lost (32 tiles for N = 4096) come back by split-K (4 splits: 128 programs). BLOCK_K 128:
    8 dots of K = 16 a step, ~23 KB of shared memory a stage (69 KB at 3 stages); ptxas -v
    (sm_90a): 255 registers at M = 64 (2 programs an SM, no spills), 110 at M = 16.
    Prefill (M > 64): 64 x 128 tiles, programs enough without split-K."""
    bk = 128
    if m > 64:
        return 64, 128, bk, 4, 3, 1
    block_m = max(16, triton.next_power_of_2(m))
    tiles = triton.cdiv(n, 128)
    split = 1
    while split < 8 and tiles * split * 2 <= SMS and k // (bk * split * 2) >= 4:
        split *= 2  # up to ~one program per SM, >= 4 steps of BLOCK_K a split
    return block_m, 128, bk, 4, 3, split


_COUNTERS: dict = {}  # device -> (tiles,) int32 zeros: split-K arrival counters (self-resetting)


def _counters(device: torch.device, tiles: int) -> Optional[torch.Tensor]:
    """The split-K counters (all zero between calls: each call's last split resets its own),
    or None when they would first be allocated inside a CUDA graph capture (a capture records
    the zero-fill without running it: the caller then runs without split-K)."""
    c = _COUNTERS.get(device)
    if c is None or c.numel() < tiles:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        c = torch.zeros(max(tiles, 4096), dtype=torch.int32, device=device)
        _COUNTERS[device] = c
    return c


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
    assert block_k >= 128 and block_k & (block_k - 1) == 0, block_k  # dots of K >= 16
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
