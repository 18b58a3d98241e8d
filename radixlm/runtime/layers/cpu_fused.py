"""Fused elementwise ops on the CPU: the C++ kernels of csrc/cpu_elementwise.cpp (built with the
CPU attention kernels, attention/cpu_kernels.py) behind the same functions as layers/triton_ops
has on CUDA, so models/llama.py's `_fused_ops(x)` hands out one or the other:

  rmsnorm(x, weight, eps, residual=None)  weight * norm(x); with residual: (weight * norm(s), s),
                                          s = x + residual
  silu_and_mul(gate_up)                   silu(gate) * up
  rotary_inplace(x, cos, sin)             rotate-half rotary of x (T, H, D) in place
  argmax_rows(logits)                     the greedy sampler's argmax (CPU only)

Why (SmolLM2 bf16, 2-core EPYC, torch.profiler): a prefill step of ~2000 tokens spent ~0.37 s of
its ~1.7 s in the 4-9 small torch ops (and fp32 temporaries) each of these replaces, ~0.17 s
fused; a 32-request decode step ~13 ms of ~88 ms, ~8 ms fused (per-call overhead dominates).

Numerics: the torch code's fp32 math and roundings at the same places (see the .cpp); a bf16 value
may rarely differ from torch's by one rounding (sum-of-squares order, the exp polynomial).
`RADIXLM_CPU_FUSED_OPS=off` keeps the torch ops. When the kernels cannot be built the torch ops
run and one warning says why.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Optional

import torch

logger = logging.getLogger(__name__)

ENV_VAR = "RADIXLM_CPU_FUSED_OPS"
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@functools.lru_cache(maxsize=1)
def _kernels():
    """torch.ops.radixlm_cpu, or None (off, or the build failed: logged once)."""
    setting = os.environ.get(ENV_VAR, "auto").strip().lower()
    if setting not in ("auto", "off"):
        raise ValueError(f"{ENV_VAR} must be auto or off (got {setting!r})")
    if setting == "off":
        return None
    from radixlm.runtime.attention import cpu_kernels

    try:
        return cpu_kernels.load()
    except cpu_kernels.CpuKernelsUnavailable as e:
        logger.warning("CPU fused elementwise kernels unavailable, using torch ops (slower): %s", e)
        return None


def usable(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and x.dtype in _DTYPES and _kernels() is not None


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float,
            residual: Optional[torch.Tensor] = None):
    """x (..., N). Without residual: weight * norm(x). With residual: s = x + residual, returns
    (weight * norm(s), s)."""
    n = x.shape[-1]
    x2 = x.reshape(-1, n)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if weight.dtype != x.dtype:  # torch would promote the product; the kernel computes in x's
        raise ValueError(f"rmsnorm: weight dtype {weight.dtype} must be x's ({x.dtype})")
    w = weight.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype)
    if residual is None:
        _kernels().rmsnorm(x2, w, eps, None, out.view(-1, n), None)
        return out
    r2 = residual.reshape(-1, n)
    if r2.stride(-1) != 1:
        r2 = r2.contiguous()
    s = torch.empty(x.shape, dtype=x.dtype)
    _kernels().rmsnorm(x2, w, eps, r2, out.view(-1, n), s.view(-1, n))
    return out, s


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x (T, 2I) = [gate | up] -> silu(gate) * up (T, I)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty((x.shape[0], x.shape[1] // 2), dtype=x.dtype)
    _kernels().silu_and_mul(x, out)
    return out


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """logits (B, V) -> torch.argmax(logits, -1) (int64): the C++ kernel for fp32 CPU rows with
    a contiguous last dim, sampling/triton_argmax for CUDA rows, else torch's."""
    if (logits.dim() == 2 and logits.dtype == torch.float32 and logits.device.type == "cpu"
            and logits.stride(-1) == 1 and logits.shape[1] > 0 and _kernels() is not None):
        return _kernels().argmax_rows(logits)
    if logits.is_cuda:
        from radixlm.runtime.sampling import triton_argmax

        if triton_argmax.supports(logits):
            return triton_argmax.argmax_rows(logits)
    return logits.argmax(dim=-1)


def rotary_inplace(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (T, H, D), last dim contiguous (may be a view of the fused qkv rows), rotated in place
    by cos / sin (T, 1, D) or (T, D) fp32 (layers/rotary.py's tables)."""
    t, _, d = x.shape
    _kernels().rotary_inplace(x, cos.reshape(t, d), sin.reshape(t, d))
    return x
