"""The C++ GGUF block-format GEMM (csrc/quant_gemm.cpp): built once per CPU / torch / source and
cached exactly like the attention kernels (attention/cpu_kernels.py: same cache folder, flags,
flock-guarded build, `failed` marker), but as its own small extension, `torch.ops.radixlm_quant`,
so a failure here never costs the attention kernels and a change here never rebuilds them.

`load()` returns the ops namespace or raises `QuantKernelsUnavailable`; `warn_fallback` logs ONE
warning per process when a caller falls back to dequantized weights.

Ops (CPU tensors; formats by ggml type id: Q4_1 = 3, Q8_0 = 8, Q4_K = 12, Q6_K = 14):
  gemm(x (M, K) fp32/bf16/fp16, w (N, row_bytes) uint8, fmt, K) -> (M, N) fp32   (direct)
  gemm_rounded(...): gemm(...).to(x.dtype).float() in one call (a model's logits)
  gemm_tiled(...), gemm_chunked(...): the same product through dequantized fp32 tiles / chunks
      and BLAS (prefill); quantized_linear picks one per M
  dequant(w (N, row_bytes) uint8, fmt, K) -> (N, K) fp32, bit-identical to gguf.quants
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from typing import Optional

import torch

from radixlm.runtime.attention import cpu_kernels as ck

logger = logging.getLogger(__name__)

_CSRC = ck._CSRC
_SOURCES = ("quant_gemm.cpp",)
_HEADERS = ("quant_avx512.h", "quant_bf16.h", "quant_direct.h", "quant_formats.h", "quant_pool.h",
            "quant_vec.h")
# ggml type id -> (name, values per block, bytes per block)
FORMATS = {3: ("Q4_1", 32, 20), 8: ("Q8_0", 32, 34), 12: ("Q4_K", 256, 144),
           14: ("Q6_K", 256, 210)}


class QuantKernelsUnavailable(RuntimeError):
    """The quantized GEMM could not be built or loaded; the message says why."""


def module_name() -> str:
    return ck.hashed_name("radixlm_quant_gemm_", _SOURCES + _HEADERS)


_lock = threading.Lock()
_module = None
_error: Optional[str] = None
_warned = False


def warn_fallback(reason: str) -> None:
    global _warned
    if not _warned:
        _warned = True
        logger.warning("quantized CPU GEMM unavailable, GGUF weights are dequantized at load "
                       "instead: %s", reason)


def load(verbose: bool = False):
    """torch.ops.radixlm_quant (built on first use). Raises QuantKernelsUnavailable."""
    global _module, _error
    if _module is not None:
        return _module
    with _lock:
        if _module is None and _error is None:
            try:
                _module = _load_or_build(verbose)
            except Exception as e:  # noqa: BLE001 - any build/import failure means "unavailable"
                _error = f"{type(e).__name__}: {e}".strip()[:2000]
        if _module is None:
            raise QuantKernelsUnavailable(_error)
    return _module


def _load_or_build(verbose: bool):
    build = ck.cache_root() / module_name()
    return ck.load_or_build(module_name(), _SOURCES, _HEADERS, "radixlm_quant",
                            "the quantized CPU GEMM", f"delete {build} to retry", verbose)


def available() -> bool:
    try:
        load()
        return True
    except QuantKernelsUnavailable:
        return False


def gemm(x: torch.Tensor, w: torch.Tensor, fmt: int, k: int) -> torch.Tensor:
    """(M, K) @ dequant(w)^T -> (M, N) float32."""
    return load().gemm(x, w, fmt, k)


def dequant(w: torch.Tensor, fmt: int, k: int) -> torch.Tensor:
    """(N, row_bytes) uint8 blocks -> (N, K) float32."""
    return load().dequant(w, fmt, k)


def main() -> int:
    """`python -m radixlm.runtime.layers.quant_kernels [-v]`: build now (`make install` does).
    Exits 0 when the build fails (GGUF weights are then dequantized at load, as before)."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    t = time.perf_counter()
    try:
        ops = load(verbose="-v" in sys.argv)
    except QuantKernelsUnavailable as e:
        print(f"warning: quantized CPU GEMM unavailable, GGUF weights will be dequantized at "
              f"load: {e}", file=sys.stderr)
        return 0
    print(f"quantized CPU GEMM ({ops.isa()}) ready in {time.perf_counter() - t:.1f}s: "
          f"{ck.cache_root() / module_name()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
