"""Batch-1 linear layer for CUDA (Triton GEMV): y (1, N) = x (1, K) @ W (N, K)^T.

Why: batch-1 decode reads every weight once per token, so it runs at the speed weights stream from
memory. On an H100 (Llama-3.1-8B shapes, bf16, copy bandwidth 3.01 TB/s) cuBLAS's M=1 kernels
reach 2.82 TB/s for gate_up (28672 x 4096) and 2.59 for down (4096 x 14336), but only 2.08 for
qkv (6144 x 4096) and 1.63 for o (4096 x 4096): the small matrices are split along K and leave
the memory system idle between their waves. Here each program owns BLOCK_N whole rows of W and
streams them along K (rows are contiguous, so every load is a wide coalesced read), keeping
NUM_STAGES tiles in flight; N / BLOCK_N programs (>= 256 for N >= 4096) fill the SMs without a
split-K reduction, so results are deterministic.

Numerics: products and the sum in fp32, one rounding to the output dtype (what cuBLAS does for
bf16, in a different summation order). `RADIXLM_DISABLE_TRITON_GEMV=1` turns it off.
"""

from __future__ import annotations

import os
from functools import lru_cache
from typing import Optional

import torch
import triton
import triton.language as tl

from radixlm.runtime.layers import triton_skinny

ENABLED = os.environ.get("RADIXLM_DISABLE_TRITON_GEMV", "") in ("", "0")
# RADIXLM_GEMV_GPU_TABLES=0: the rule alone, without TUNED_BY_GPU / SILU_BY_GPU (an A/B of them)
GPU_TABLES = os.environ.get("RADIXLM_GEMV_GPU_TABLES", "1") != "0"


@triton.jit
def _gemv_kernel(X, W, B, Y, N, K, stride_w,
                 HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 EVEN_K: tl.constexpr, NUM_STAGES: tl.constexpr):
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
    y = tl.sum(acc, axis=1)  # (BLOCK_N,)
    if HAS_BIAS:
        y += tl.load(B + rows, mask=row_ok, other=0.0).to(tl.float32)
    tl.store(Y + rows, y.to(Y.dtype.element_ty), mask=row_ok)


@triton.jit
def _gemv_silu_kernel(X, W, Y, N, K, stride_w,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                      NUM_STAGES: tl.constexpr):
    # W (2N, K) = [gate | up]: program p streams gate rows and the matching up rows
    # [p * BLOCK_N, +BLOCK_N) and writes silu(gate) * up for them (the SiLU-and-mul epilogue)
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)  # (BLOCK_N,)
    row_ok = rows < N
    offs_k = tl.arange(0, BLOCK_K)
    g_ptrs = W + rows.to(tl.int64)[:, None] * stride_w + offs_k[None, :]  # (BLOCK_N, BLOCK_K)
    u_ptrs = g_ptrs + N.to(tl.int64) * stride_w
    acc_g = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    acc_u = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        if EVEN_K:
            x = tl.load(X + k0 + offs_k).to(tl.float32)[None, :]
            wg = tl.load(g_ptrs + k0, mask=row_ok[:, None], other=0.0)
            wu = tl.load(u_ptrs + k0, mask=row_ok[:, None], other=0.0)
        else:
            k_ok = k0 + offs_k < K
            x = tl.load(X + k0 + offs_k, mask=k_ok, other=0.0).to(tl.float32)[None, :]
            wg = tl.load(g_ptrs + k0, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            wu = tl.load(u_ptrs + k0, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        acc_g += wg.to(tl.float32) * x
        acc_u += wu.to(tl.float32) * x
    # the roundings of the unfused path: gate_up output in the storage dtype, silu(gate) rounded
    # (torch's F.silu), the product rounded (layers/triton_ops._silu_mul_kernel does the same)
    g = tl.sum(acc_g, axis=1).to(Y.dtype.element_ty).to(tl.float32)
    u = tl.sum(acc_u, axis=1).to(Y.dtype.element_ty).to(tl.float32)
    s = (g / (1.0 + tl.exp(-g))).to(Y.dtype.element_ty).to(tl.float32)
    tl.store(Y + rows, (s * u).to(Y.dtype.element_ty), mask=row_ok)


# Per GPU, the shapes where a sweep there beat the rule below by 3% or more
# (benchmarks/probes/gemv_sweep.py, results/gemv_sweep-gpu.jsonl, H200, 2026-11-29; us per call
# inside a CUDA graph, weights cycled out of L2, the rule's choice -> this table's): Llama-3.1-8B
# lm_head 276.8 -> 230.4, TP=2 qkv 8.89 -> 8.42 and o (cuBLAS) 7.31 -> 6.18, TP=4 qkv 6.73 ->
# 5.46, o (cuBLAS) 5.34 -> 4.25 and down (cuBLAS) 11.65 -> 9.17. The other shapes were within 2%
# of the rule (the sweep's noise). SILU_BY_GPU: the fused gate_up GEMV's own (BLOCK_N a half):
# 28672 x 4096 58.2 -> 55.5.
TUNED_BY_GPU: dict[str, dict[tuple[int, int], tuple[int, int, int, int]]] = {
    "NVIDIA H200": {(128256, 4096): (8, 256, 2, 4), (3072, 4096): (8, 256, 2, 6),
                    (4096, 2048): (4, 256, 2, 4), (1536, 4096): (4, 1024, 4, 3),
                    (4096, 1024): (16, 256, 4, 4), (4096, 3584): (4, 256, 2, 4)},
}
SILU_BY_GPU: dict[str, dict[tuple[int, int], tuple[int, int, int, int]]] = {
    "NVIDIA H200": {(28672, 4096): (4, 1024, 4, 3)},
}


@lru_cache(maxsize=None)
def _gpu_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def _by_gpu(table: dict, n: int, k: int, device: Optional[torch.device]):
    if device is None or device.type != "cuda" or not GPU_TABLES:
        return None
    name = _gpu_name(device.index if device.index is not None else torch.cuda.current_device())
    return table.get(name, {}).get((n, k))


def tuned_config(n: int, k: int, device: Optional[torch.device] = None
                 ) -> Optional[tuple[int, int, int, int]]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages) for an (N, K) weight, or None where cuBLAS is as
    fast or the shape was never measured: TUNED_BY_GPU's entry for `device`'s GPU, else the rule
    below, from a sweep on an H100
    (benchmarks/probes/gpu_probe.py gemv, bf16, weights cycled so none stays in L2; us per call,
    cuBLAS -> Triton):
        o 4096 x 4096           37.7 -> 21.9    (8, 256, 2, 4)
        qkv 6144 x 4096         22.3 -> 23.2    (8, 256, 2, 4): faster inside a CUDA graph
        gate_up 28672 x 4096    82.9 -> 78.3    (4, 1024, 8, 3)
        down 4096 x 14336       45.5 -> 42.2    (4, 512, 2, 3)
        lm_head 128256 x 4096   379.8 -> 332.6  (2, 1024, 8, 3)
    Inside a CUDA graph of the 32 layers' GEMVs (benchmarks/probes/gpu_probe_bs1.py chain, where
    the decode step runs them), per call: qkv cuBLAS 20.5 -> (8, 256, 2, 4) 18.7, o 15.4 -> 13.3;
    the whole chain 5.135 ms with qkv on cuBLAS, 5.063 with it here (ideal at copy bandwidth 4.957).
    Hidden sizes under 4096 were not measured there, so they keep cuBLAS."""
    cfg = _by_gpu(TUNED_BY_GPU, n, k, device)
    if cfg is not None:
        return cfg
    if k < 4096 or k % 256:
        return None
    if k > 4096:
        return 4, 512, 2, 3
    if n < 16384:
        return 8, 256, 2, 4
    return (4, 1024, 8, 3) if n < 65536 else (2, 1024, 8, 3)


def default_config(n: int, k: int) -> tuple[int, int, int, int]:
    return tuned_config(n, k) or (4, 512, 4, 3)


def supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `gemv` takes this call: one row, CUDA, 16-bit float, contiguous operands."""
    return (ENABLED and x.dim() == 2 and x.shape[0] == 1 and x.is_cuda
            and x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype
            and weight.stride(1) == 1 and x.stride(1) == 1)


def linear(x: torch.Tensor, weight: torch.Tensor,
           bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """F.linear, through `gemv` for one row of a tuned shape (batch-1 decode), through
    triton_skinny for 2-16 rows of one (a verify's rows, a small decode batch), else cuBLAS."""
    if supports(x, weight):
        cfg = tuned_config(weight.shape[0], weight.shape[1], x.device)
        if cfg is not None:
            return gemv(x, weight, bias, config=cfg)
    elif triton_skinny.supports(x, weight):
        cfg = triton_skinny.tuned_config(weight.shape[0], weight.shape[1])
        if cfg is not None:
            return triton_skinny.matmul(x, weight, bias, config=cfg)
    return torch.nn.functional.linear(x, weight, bias)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
         config: Optional[tuple[int, int, int, int]] = None) -> torch.Tensor:
    """x (1, K), weight (N, K) with a contiguous last dim, bias (N,) or None -> y (1, N)."""
    m, k = x.shape
    n = weight.shape[0]
    assert m == 1 and weight.shape[1] == k and x.stride(1) == 1 and weight.stride(1) == 1
    y = torch.empty((1, n), dtype=x.dtype, device=x.device)
    block_n, block_k, warps, stages = config or default_config(n, k)
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x, weight, bias if bias is not None else x, y, n, k, weight.stride(0),
        HAS_BIAS=bias is not None, BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=k % block_k == 0,
        NUM_STAGES=stages, num_warps=warps)
    return y


def silu_config(n2: int, k: int, device: Optional[torch.device] = None
                ) -> Optional[tuple[int, int, int, int]]:
    """Config of the fused gate_up + SiLU-and-mul GEMV for a (2I, K) weight, or None where the
    plain gate_up GEMV is not tuned either: SILU_BY_GPU's entry for `device`'s GPU, else the
    plain GEMV's with BLOCK_N halved (BLOCK_N counts rows of each half, so a program streams as
    many bytes per step as the tuned plain GEMV of the same weight)."""
    own = _by_gpu(SILU_BY_GPU, n2, k, device)
    if own is not None:
        return own
    cfg = tuned_config(n2, k, device)
    if cfg is None or n2 % 2 or cfg[0] < 2:
        return None
    return cfg[0] // 2, cfg[1], cfg[2], cfg[3]


def gate_up_silu(x: torch.Tensor, weight: torch.Tensor,
                 config: Optional[tuple[int, int, int, int]] = None) -> Optional[torch.Tensor]:
    """silu(x @ W_gate^T) * (x @ W_up^T) for one row, W = [gate | up] (2I, K) -> (1, I): the
    gate_up GEMV with the SiLU-and-mul in its epilogue (one launch, no (1, 2I) intermediate).
    The roundings of gemv() then triton_ops.silu_and_mul (sums may differ in order). 2-16 rows
    go to triton_skinny's fused kernel. None when this call is not taken (more than 16 rows,
    not CUDA, an untuned shape): the caller runs the unfused ops."""
    if weight.shape[0] % 2:
        return None
    if triton_skinny.supports(x, weight):  # 2-16 rows
        cfg = triton_skinny.tuned_config(weight.shape[0], weight.shape[1], silu=True)
        return None if cfg is None else triton_skinny.matmul(x, weight, config=cfg, silu=True)
    if not supports(x, weight):
        return None
    cfg = config or silu_config(weight.shape[0], weight.shape[1], x.device)
    return None if cfg is None else gemv_silu(x, weight, cfg)


def gemv_silu(x: torch.Tensor, weight: torch.Tensor,
              cfg: tuple[int, int, int, int]) -> torch.Tensor:
    """The fused kernel itself: x (1, K), weight (2I, K) contiguous rows -> (1, I)."""
    n = weight.shape[0] // 2
    k = x.shape[1]
    assert x.shape[0] == 1 and weight.shape[1] == k and weight.shape[0] % 2 == 0
    assert x.stride(1) == 1 and weight.stride(1) == 1
    y = torch.empty((1, n), dtype=x.dtype, device=x.device)
    block_n, block_k, warps, stages = cfg
    _gemv_silu_kernel[(triton.cdiv(n, block_n),)](
        x, weight, y, n, k, weight.stride(0), BLOCK_N=block_n, BLOCK_K=block_k,
        EVEN_K=k % block_k == 0, NUM_STAGES=stages, num_warps=warps)
    return y
