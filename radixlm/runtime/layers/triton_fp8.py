"""Triton kernels of the FP8 linear layer (layers/fp8_linear.py) for CUDA.

  quantize_rows(x, static_scale)  x (M, K) 16/32-bit -> (x_q (M, K) e4m3, scale (M, 1) fp32):
                                  one program per row; dynamic: scale = amax(|row|) / 448, static:
                                  the checkpoint's input scale for every row. x_q = round(x / scale)
                                  clamped to +-448 (round to nearest even). One launch instead of
                                  the ~6 of the torch version (abs, amax, div, clamp, div, cast).
  gemv(x, w, w_scale, bias)       batch-1 decode: y (1, N) = (x (1, K) @ w (N, K)^T) * w_scale
                                  (+ bias), reading the e4m3 weight (1 byte a value) and the
                                  unquantized activation: half the weight bytes of the bf16 GEMV
                                  (layers/triton_gemv.py), no activation quantization at all.

Numerics: fp32 products and sums, one rounding to the output dtype. `gemv` is the dequantized
reference's matmul (x @ (w * w_scale)^T) up to summation order; `quantize_rows` matches the torch
reference of fp8_linear.quantize_rows_torch (divisions are IEEE `div_rn`, as torch's; Triton's
interpreter rounds ties away from zero instead of to even, so there a tie may land one e4m3 step
away).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

# Triton kernels may read only constexpr globals (the compiler refuses plain floats; the
# interpreter does not, so only the GPU caught this)
FP8_MAX = tl.constexpr(448.0)
MIN_SCALE = tl.constexpr(1e-12)  # an all-zero row quantizes to zeros with this scale (no 0 / 0)


@triton.jit
def _quant_rows_kernel(X, Q, S, S_IN, K, stride_x, stride_q,
                       STATIC: tl.constexpr, BLOCK_K: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_K)
    x_row = X + row * stride_x
    if STATIC:
        scale = tl.load(S_IN).to(tl.float32)
    else:  # pass 1: the row's absolute maximum (the row stays in L1/L2 for pass 2)
        amax = tl.zeros([BLOCK_K], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            x = tl.load(x_row + k0 + offs, mask=k0 + offs < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        scale = tl.maximum(tl.math.div_rn(tl.max(amax, axis=0), FP8_MAX), MIN_SCALE)
    for k0 in range(0, K, BLOCK_K):
        m = k0 + offs < K
        x = tl.load(x_row + k0 + offs, mask=m, other=0.0).to(tl.float32)
        q = tl.clamp(tl.math.div_rn(x, scale), -FP8_MAX, FP8_MAX)
        tl.store(Q + row * stride_q + k0 + offs,
                 q.to(Q.dtype.element_ty, fp_downcast_rounding="rtne"), mask=m)
    tl.store(S + row, scale)


def quantize_rows(x: torch.Tensor, static_scale: Optional[torch.Tensor] = None):
    """x (M, K), last dim contiguous -> (x_q (M, K) float8_e4m3fn, scale (M, 1) float32), with
    x ~= x_q * scale row by row. `static_scale` (a 1-element fp32 tensor on x's device): use it
    for every row instead of the row's amax / 448 (values beyond 448 * scale saturate)."""
    m, k = x.shape
    assert x.stride(1) == 1
    q = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m == 0:
        return q, s
    block_k = min(triton.next_power_of_2(k), 2048)
    _quant_rows_kernel[(m,)](x, q, s, static_scale if static_scale is not None else s, k,
                             x.stride(0), q.stride(0), STATIC=static_scale is not None,
                             BLOCK_K=block_k, num_warps=4 if block_k >= 1024 else 2)
    return q, s


@triton.jit
def _fp8_gemv_kernel(X, W, WS, B, Y, N, K, stride_w,
                     HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     EVEN_K: tl.constexpr, NUM_STAGES: tl.constexpr):
    # as layers/triton_gemv._gemv_kernel: each program streams BLOCK_N whole rows along K
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)  # (BLOCK_N,)
    row_ok = rows < N
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = W + rows.to(tl.int64)[:, None] * stride_w + offs_k[None, :]  # (BLOCK_N, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        if EVEN_K:
            x = tl.load(X + k0 + offs_k)
            w = tl.load(w_ptrs + k0, mask=row_ok[:, None], other=0.0)
        else:
            k_ok = k0 + offs_k < K
            x = tl.load(X + k0 + offs_k, mask=k_ok, other=0.0)
            w = tl.load(w_ptrs + k0, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    y = tl.sum(acc, axis=1) * tl.load(WS + rows, mask=row_ok, other=0.0)  # (BLOCK_N,)
    if HAS_BIAS:
        y += tl.load(B + rows, mask=row_ok, other=0.0).to(tl.float32)
    tl.store(Y + rows, y.to(Y.dtype.element_ty), mask=row_ok)


def gemv_config(n: int, k: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages): the bf16 GEMV's tuned tiles (triton_gemv.
    tuned_config) with BLOCK_K doubled, so a program streams as many bytes per step at 1 byte a
    value. Not swept on a GPU yet: benchmarks/fp8_linear.py times it and a few alternatives."""
    if k >= 4096 and k % 256 == 0:
        if k > 4096:
            return 4, 1024, 2, 3
        return (8, 512, 2, 4) if n < 16384 else (4, 2048, 8, 3)
    return 4, 1024, 4, 3


def gemv(x: torch.Tensor, weight: torch.Tensor, w_scale: torch.Tensor,
         bias: Optional[torch.Tensor] = None,
         config: Optional[tuple[int, int, int, int]] = None,
         out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """x (1, K) bf16/fp16/fp32, weight (N, K) e4m3 with contiguous rows, w_scale (N,) fp32,
    bias (N,) or None -> y (1, N) in `out_dtype` (default x's)."""
    m, k = x.shape
    n = weight.shape[0]
    assert m == 1 and weight.shape[1] == k and x.stride(1) == 1 and weight.stride(1) == 1
    y = torch.empty((1, n), dtype=out_dtype or x.dtype, device=x.device)
    block_n, block_k, warps, stages = config or gemv_config(n, k)
    _fp8_gemv_kernel[(triton.cdiv(n, block_n),)](
        x, weight, w_scale, bias if bias is not None else w_scale, y, n, k, weight.stride(0),
        HAS_BIAS=bias is not None, BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=k % block_k == 0,
        NUM_STAGES=stages, num_warps=warps)
    return y
