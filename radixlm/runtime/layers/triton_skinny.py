"""Few-row linear layer for CUDA (Triton): y (M, N) = x (M, K) @ W (N, K)^T for 2 <= M <= 16.

Why: a speculative verify at batch 1 multiplies 2-9 rows (the last token and its drafts), and a
small decode batch a few. Such a GEMM still reads every weight once, so it should cost what the
batch-1 GEMV costs (layers/triton_gemv.py); cuBLAS's kernels for M = 5 took 5% longer than that
GEMV over the Llama-3.1-8B step on an H200 (3.94 vs 3.74 ms, torch.profiler, 2026-11-28), plus a
split-K reduction and a separate SiLU-and-mul launch per layer.

Here each program owns BLOCK_N whole rows of W and streams them along K, as the GEMV does, and
multiplies each (BLOCK_N, BLOCK_K) tile with the x rows (padded to 16, the tensor cores' least
height) in one tl.dot: W is the dot's left operand, so a tile of 16-64 weight rows fills the
instruction's M and the few x rows its N ("swap AB"). No split-K: results are deterministic,
and a row's value does not depend on how many rows share the call.

Numerics: bf16/fp16 products, fp32 sums, one rounding to the output dtype (cuBLAS's contract, in
another summation order).
"""

from __future__ import annotations

import os
from typing import Optional

import torch
import triton
import triton.language as tl

MAX_ROWS = 16  # x rows one call takes (the dot's N)
ENABLED = os.environ.get("RADIXLM_DISABLE_TRITON_SKINNY", "") in ("", "0")


@triton.jit
def _skinny_kernel(X, W, B, Y, M, N, K, stride_x, stride_w, stride_y,
                   HAS_BIAS: tl.constexpr, SILU: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, NUM_STAGES: tl.constexpr):
    # SILU: W (2N, K) = [gate | up]; the program streams gate rows [p * BLOCK_N, +BLOCK_N) and the
    # matching up rows and writes silu(gate) * up (y has N columns)
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)  # (BLOCK_N,) weight rows
    row_ok = rows < N
    offs_m = tl.arange(0, 16)  # x rows (the dot's N)
    m_ok = offs_m < M
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = W + rows.to(tl.int64)[:, None] * stride_w + offs_k[None, :]  # (BLOCK_N, BLOCK_K)
    x_ptrs = X + offs_m[:, None] * stride_x + offs_k[None, :]  # (16, BLOCK_K)
    acc = tl.zeros([BLOCK_N, 16], tl.float32)
    if SILU:
        u_ptrs = w_ptrs + N.to(tl.int64) * stride_w
        acc_u = tl.zeros([BLOCK_N, 16], tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        if EVEN_K:
            x = tl.load(x_ptrs + k0, mask=m_ok[:, None], other=0.0)
            w = tl.load(w_ptrs + k0, mask=row_ok[:, None], other=0.0)
        else:
            k_ok = k0 + offs_k < K
            x = tl.load(x_ptrs + k0, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs + k0, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        xt = tl.trans(x)  # (BLOCK_K, 16)
        acc = tl.dot(w, xt, acc)  # (BLOCK_N, 16)
        if SILU:
            if EVEN_K:
                wu = tl.load(u_ptrs + k0, mask=row_ok[:, None], other=0.0)
            else:
                wu = tl.load(u_ptrs + k0, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            acc_u = tl.dot(wu, xt, acc_u)
    y_ptrs = Y + offs_m[None, :] * stride_y + rows[:, None]  # (BLOCK_N, 16): y[m, row]
    ok = row_ok[:, None] & m_ok[None, :]
    if SILU:
        # the roundings of the unfused path (triton_gemv._gemv_silu_kernel's): gate and up in the
        # storage dtype, silu(gate) rounded, the product rounded
        g = acc.to(Y.dtype.element_ty).to(tl.float32)
        u = acc_u.to(Y.dtype.element_ty).to(tl.float32)
        s = (g / (1.0 + tl.exp(-g))).to(Y.dtype.element_ty).to(tl.float32)
        tl.store(y_ptrs, (s * u).to(Y.dtype.element_ty), mask=ok)
    else:
        if HAS_BIAS:
            acc += tl.load(B + rows, mask=row_ok, other=0.0).to(tl.float32)[:, None]
        tl.store(y_ptrs, acc.to(Y.dtype.element_ty), mask=ok)


def tuned_config(n: int, k: int, silu: bool = False) -> Optional[tuple[int, int, int, int]]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages) for an (N, K) weight (silu: [gate | up]), or
    None where cuBLAS keeps the call. From benchmarks/probes/skinny_sweep.py on an H200 (bf16, 5 rows, weights
    streamed from DRAM, 24 calls in a CUDA graph; us per call, cuBLAS -> here, 2026-11-28):
        qkv 6144 x 4096          15.01 -> 14.67   (64, 256, 4, 4)
        o 4096 x 4096            12.47 -> 11.17   (64, 256, 4, 4)
        gate_up 28672 x 4096     57.56 -> 56.12   (64, 128, 4, 3), SiLU-and-mul fused (cuBLAS
                                                  then triton_ops.silu_and_mul)
        lm_head 128256 x 4096   239.72 -> 233.53  (64, 128, 4, 3)
        down 4096 x 14336        30.65 -> 30.91   cuBLAS kept (K > 4096)
    The same within 2% from 2 to 16 rows. Hidden sizes under 4096 were not measured: cuBLAS."""
    if k != 4096:
        return None
    # (the SiLU kernel streams two weight tiles a stage: (64, 256, 4, 4) would need 288 KB of
    # shared memory, over the H100's and H200's 227 KB)
    return (64, 128, 4, 3) if n >= 16384 or silu else (64, 256, 4, 4)


def supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `linear` takes this call: 2-16 rows, CUDA, 16-bit float, contiguous last dims."""
    return (ENABLED and x.dim() == 2 and 2 <= x.shape[0] <= MAX_ROWS and x.is_cuda
            and x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype
            and weight.stride(1) == 1 and x.stride(1) == 1)


def matmul(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
           config: Optional[tuple[int, int, int, int]] = None, silu: bool = False) -> torch.Tensor:
    """x (M <= 16, K), weight (N, K) with a contiguous last dim, bias (N,) or None -> (M, N).
    silu: weight is [gate | up] (2I, K) -> silu(x @ gate^T) * (x @ up^T) (M, I), no bias."""
    m, k = x.shape
    n = weight.shape[0] // 2 if silu else weight.shape[0]
    assert m <= MAX_ROWS and weight.shape[1] == k and x.stride(1) == 1 and weight.stride(1) == 1
    assert not (silu and (bias is not None or weight.shape[0] % 2))
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    block_n, block_k, warps, stages = (config or tuned_config(weight.shape[0], k, silu)
                                       or (64, 128, 4, 3))
    _skinny_kernel[(triton.cdiv(n, block_n),)](
        x, weight, bias if bias is not None else x, y, m, n, k, x.stride(0), weight.stride(0),
        y.stride(0), HAS_BIAS=bias is not None, SILU=silu, BLOCK_N=block_n, BLOCK_K=block_k,
        EVEN_K=k % block_k == 0, NUM_STAGES=stages, num_warps=warps)
    return y
