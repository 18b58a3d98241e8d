"""The C++ GGUF block-format GEMM (csrc/quant_gemm.cpp): built once per CPU / torch / source and
cached exactly like the attention kernels (attention/cpu_kernels.py: same cache folder, flags,
flock-guarded build, `failed` marker), but as its own small extension, `torch.ops.radixlm_quant`,
so a failure here never costs the attention kernels and a change here never rebuilds them.

`load()` returns the ops namespace or raises `QuantKernelsUnavailable`; `warn_fallback` logs ONE
warning per process when a caller falls back to dequantized weights.

Ops (CPU tensors; formats by ggml type id: Q4_1 = 3, Q8_0 = 8, Q4_K = 12, Q6_K = 14):
  gemm(x (M, K) fp32/bf16/fp16, w (N, row_bytes) uint8, fmt, K) -> (M, N) fp32   (direct)
  gemm_tiled(...), gemm_chunked(...): the same product through dequantized fp32 tiles / chunks
      and BLAS (prefill); quantized_linear picks one per M
  dequant(w (N, row_bytes) uint8, fmt, K) -> (N, K) fp32, bit-identical to gguf.quants
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import platform
import sys
import threading
import time
from pathlib import Path
from typing import Optional

import torch

from radixlm.runtime.attention import cpu_kernels as ck

logger = logging.getLogger(__name__)

_CSRC = ck._CSRC
_SOURCES = ("quant_gemm.cpp",)
_HEADERS = ("quant_formats.h", "quant_vec.h")
# ggml type id -> (name, values per block, bytes per block)
FORMATS = {3: ("Q4_1", 32, 20), 8: ("Q8_0", 32, 34), 12: ("Q4_K", 256, 144),
           14: ("Q6_K", 256, 210)}


class QuantKernelsUnavailable(RuntimeError):
    """The quantized GEMM could not be built or loaded; the message says why."""


def module_name() -> str:
    h = hashlib.sha256()
    for fname in _SOURCES + _HEADERS:
        h.update((_CSRC / fname).read_bytes())
    for part in (*map(" ".join, ck._flags()), ck.cpu_features(), torch.__version__, sys.version,
                 platform.machine()):
        h.update(part.encode())
    return "radixlm_quant_gemm_" + h.hexdigest()[:16]


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
    if os.environ.get("RADIXLM_DISABLE_CPU_KERNELS") == "1":
        raise RuntimeError("disabled by RADIXLM_DISABLE_CPU_KERNELS=1")
    if not all((_CSRC / f).exists() for f in _SOURCES + _HEADERS):
        raise FileNotFoundError(f"kernel sources not found in {_CSRC}")
    name = module_name()
    build_dir = ck.cache_root() / name
    so = build_dir / f"{name}.so"
    if ck._is_built(build_dir, name):  # common case: a dlopen, no compiler, no lock
        torch.ops.load_library(str(so))
        return torch.ops.radixlm_quant
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / "build.flock", "w") as lock_file:  # one builder per machine
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        if ck._is_built(build_dir, name):
            torch.ops.load_library(str(so))
            return torch.ops.radixlm_quant
        failed = build_dir / "failed"
        if failed.exists():
            raise RuntimeError(f"an earlier build failed: {ck._summary(failed.read_text())} "
                               f"(log: {failed}; delete {build_dir} to retry)")
        (build_dir / "lock").unlink(missing_ok=True)  # torch's baton, stale while we hold flock
        try:
            return _build(name, build_dir, verbose)
        except Exception as e:
            failed.write_text(f"{type(e).__name__}: {e}\n")
            raise RuntimeError(f"building the quantized GEMM failed: {ck._summary(str(e))} "
                               f"(log: {failed})") from e


def _build(name: str, build_dir: Path, verbose: bool):
    from torch.utils import cpp_extension

    bin_dir = os.path.dirname(sys.executable)  # a venv's own ninja counts without activation
    if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = os.pathsep.join([os.environ.get("PATH", ""), bin_dir]).strip(os.pathsep)
    t0 = time.perf_counter()
    logger.info("building the quantized CPU GEMM into %s (once per CPU/torch/source)", build_dir)
    cflags, ldflags = ck._flags()
    cpp_extension.load(name=name, sources=[str(_CSRC / f) for f in _SOURCES],
                       extra_cflags=cflags, extra_ldflags=ldflags, extra_include_paths=[str(_CSRC)],
                       build_directory=str(build_dir), verbose=verbose, is_python_module=False)
    ops = torch.ops.radixlm_quant
    (build_dir / "built").write_text(ops.isa() + "\n")
    logger.info("built the quantized CPU GEMM (%s) in %.1fs", ops.isa(), time.perf_counter() - t0)
    return ops


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
