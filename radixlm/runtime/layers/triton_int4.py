"""Triton kernels of the int4 weight-only linear layer (layers/int4_linear.py): the packed
weights are read as stored and dequantized in registers.

The layout they read (what int4_linear repacks every format into, K = in, N = out):
  qweight (N, K/8) int32   nibble i of qweight[n, c] is q[n, 8c + i] in [0, 15] (packed along K:
                           a row of W is K/2 contiguous bytes, streamed like a dense row)
  scales  (N, G) float     G = K / GROUP groups per row, contiguous along K
  zeros   (N, G) uint8     W[n, k] = (q[n, k] - zeros[n, k // GROUP]) * scales[n, k // GROUP]
(act-order checkpoints were permuted at load so that groups are contiguous; the layer permutes
x's columns the same way before calling these.)

  gemv(x, ...)   M == 1 (batch-1 decode): each program owns BLOCK_N rows of W and streams them
                 along K, BLOCK_K values (BLOCK_K / 2 bytes) a row per step; the integer (q - z)
                 times x is summed per group chunk, then scaled: y[n] = sum_g s[n, g] *
                 sum_{k in g} (q - z) x[k], all fp32, one rounding to the output dtype.
  gemm(x, ...)   M > 1: (BLOCK_M, BLOCK_N) output tiles, K in steps of BLOCK_K <= GROUP (one
                 group per step, so one scale and zero per column); the tile of W is
                 dequantized to exactly the dequantized checkpoint's weight in x's dtype
                 ((q - z) * s in fp32, one rounding) and fed to tl.dot with fp32 accumulation.
Both need K % 32 == 0 (true of every model this serves) and GROUP a power of two or K.
Tile choices are first guesses, not yet measured on a GPU (benchmarks/int4_decode.py times
them); they run in Triton's interpreter (TRITON_INTERPRET=1) for the CPU tests.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl


@triton.jit
def _unpack_last(words):
    # words (R, C) int32 -> (R, C, 8): nibble i of words[r, c] at [r, c, i] (so a reshape to
    # (R, 8C) puts value 8c + i of row r at column 8c + i); >> is arithmetic, & 0xF fixes it
    shifts = tl.arange(0, 8) * 4
    return (words[:, :, None] >> shifts[None, None, :]) & 0xF


@triton.jit
def _unpack_mid(words):
    # words (C, R) int32 -> (C, 8, R): nibble i of words[c, r] at [c, i, r] (a reshape to
    # (8C, R) puts value 8c + i at row 8c + i)
    shifts = tl.arange(0, 8) * 4
    return (words[:, None, :] >> shifts[None, :, None]) & 0xF


@triton.jit
def _int4_gemv_kernel(X, QW, S, Z, B, Y, N, K, stride_qw, stride_s,
                      GROUP: tl.constexpr, SUB: tl.constexpr, HAS_BIAS: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr):
    # SUB = min(GROUP, BLOCK_K): a tile of BLOCK_K columns is BLOCK_K // SUB chunks of one group
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)  # (BLOCK_N,)
    row_ok = rows < N
    offs_w = tl.arange(0, BLOCK_K // 8)  # words of a tile row
    offs_k = tl.arange(0, BLOCK_K)
    offs_c = tl.arange(0, BLOCK_K // SUB)  # chunks of a tile row
    w_ptrs = QW + rows.to(tl.int64)[:, None] * stride_qw + offs_w[None, :]  # (BLOCK_N, BK/8)
    s_row = rows.to(tl.int64)[:, None] * stride_s  # (BLOCK_N, 1)
    acc = tl.zeros([BLOCK_N], tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):  # NUM_STAGES steps in flight
        words = tl.load(w_ptrs + k0 // 8, mask=row_ok[:, None], other=0)
        q = tl.reshape(_unpack_last(words), (BLOCK_N, BLOCK_K // SUB, SUB))  # k = 8c + i order
        x = tl.reshape(tl.load(X + k0 + offs_k).to(tl.float32), (BLOCK_K // SUB, SUB))
        g = (k0 + offs_c * SUB) // GROUP  # (BLOCK_K // SUB,) the group of each chunk
        z = tl.load(Z + s_row + g[None, :], mask=row_ok[:, None], other=0).to(tl.int32)
        s = tl.load(S + s_row + g[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
        qz = (q - z[:, :, None]).to(tl.float32)  # exact small integers
        part = tl.sum(qz * x[None, :, :], axis=2)  # (BLOCK_N, BLOCK_K // SUB)
        acc += tl.sum(part * s, axis=1)
    if HAS_BIAS:
        acc += tl.load(B + rows, mask=row_ok, other=0.0).to(tl.float32)
    tl.store(Y + rows, acc.to(Y.dtype.element_ty), mask=row_ok)


@triton.jit
def _int4_gemm_kernel(X, QW, S, Z, B, Y, M, N, K, stride_xm, stride_ym, stride_qw, stride_s,
                      GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # (BLOCK_N,)
    m_ok, n_ok = rm < M, rn < N
    offs_k = tl.arange(0, BLOCK_K)
    offs_w = tl.arange(0, BLOCK_K // 8)
    x_ptrs = X + rm.to(tl.int64)[:, None] * stride_xm + offs_k[None, :]  # (BLOCK_M, BLOCK_K)
    w_ptrs = QW + rn.to(tl.int64)[None, :] * stride_qw + offs_w[:, None]  # (BLOCK_K/8, BLOCK_N)
    s_ptrs = rn.to(tl.int64) * stride_s  # (BLOCK_N,)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = tl.load(x_ptrs + k0, mask=m_ok[:, None], other=0.0)
        words = tl.load(w_ptrs + k0 // 8, mask=n_ok[None, :], other=0)
        q = tl.reshape(_unpack_mid(words), (BLOCK_K, BLOCK_N))  # row k = 8c + i
        g = k0 // GROUP  # BLOCK_K <= GROUP: one group per step
        z = tl.load(Z + s_ptrs + g, mask=n_ok, other=0).to(tl.int32)
        s = tl.load(S + s_ptrs + g, mask=n_ok, other=0.0).to(tl.float32)
        w = ((q - z[None, :]).to(tl.float32) * s[None, :]).to(a.dtype)  # (BLOCK_K, BLOCK_N)
        if IEEE:  # fp32 activations: no TF32 rounding of the inputs
            acc = tl.dot(a, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, w, acc)
    if HAS_BIAS:
        acc += tl.load(B + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    y_ptrs = Y + rm.to(tl.int64)[:, None] * stride_ym + rn[None, :]
    tl.store(y_ptrs, acc.to(Y.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def _block_k(k: int, cap: int) -> int:
    """The largest power of two <= cap dividing K (K % 32 == 0, so at least 32)."""
    b = 1 << (cap.bit_length() - 1)
    while k % b:
        b //= 2
    return b


def _check(x, qweight, scales, zeros, group):
    m, k = x.shape
    n = qweight.shape[0]
    assert k % 32 == 0 and qweight.shape[1] * 8 == k, (k, tuple(qweight.shape))
    assert scales.shape == zeros.shape == (n, k // group), (tuple(scales.shape), group)
    assert x.stride(1) == 1 and qweight.is_contiguous() and scales.is_contiguous() \
        and zeros.is_contiguous()
    assert group == k or (group & (group - 1)) == 0, group
    return m, n, k


def gemv_config(n: int, k: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages) for M == 1: 8 rows of 128 bytes a step, 3
    steps in flight, N / 8 programs (512 for N = 4096: every SM busy without split-K). A first
    guess, not yet swept (benchmarks/int4_decode.py --kernels sweeps it)."""
    return 8, _block_k(k, 256), 4, 3


def gemv(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
         group: int, bias: Optional[torch.Tensor] = None,
         config: Optional[tuple[int, int, int, int]] = None) -> torch.Tensor:
    """x (1, K) -> y (1, N) in x's dtype (layout in the module docstring)."""
    m, n, k = _check(x, qweight, scales, zeros, group)
    assert m == 1
    y = torch.empty((1, n), dtype=x.dtype, device=x.device)
    block_n, block_k, warps, stages = config or gemv_config(n, k)
    _int4_gemv_kernel[(triton.cdiv(n, block_n),)](
        x, qweight, scales, zeros, bias if bias is not None else scales, y, n, k,
        qweight.stride(0), scales.stride(0), GROUP=group,
        SUB=min(group, block_k), HAS_BIAS=bias is not None, BLOCK_N=block_n, BLOCK_K=block_k,
        NUM_STAGES=stages, num_warps=warps)
    return y


def gemm_config(m: int, n: int, k: int, group: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages). A first guess, not yet swept.
    Decode batches (M <= 64) are one row of tiles: narrow BLOCK_N so that N / BLOCK_N programs
    (128 for N = 4096) spread the weight stream over the SMs; larger M has programs enough."""
    if m <= 64:
        block_m = 16 if m <= 16 else 32 if m <= 32 else 64
        return block_m, 32 if n <= 8192 else 64, _block_k(k, min(group, 128)), 4, 4
    return 64, 128, _block_k(k, min(group, 64)), 4, 3


def gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
         group: int, bias: Optional[torch.Tensor] = None,
         config: Optional[tuple[int, int, int, int, int]] = None) -> torch.Tensor:
    """x (M, K) -> y (M, N) in x's dtype (layout in the module docstring)."""
    m, n, k = _check(x, qweight, scales, zeros, group)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    block_m, block_n, block_k, warps, stages = config or gemm_config(m, n, k, group)
    assert group % block_k == 0, (group, block_k)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _int4_gemm_kernel[grid](
        x, qweight, scales, zeros, bias if bias is not None else scales, y, m, n, k,
        x.stride(0), y.stride(0), qweight.stride(0), scales.stride(0), GROUP=group,
        HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32, BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages)
    return y
