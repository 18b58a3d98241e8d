"""The C++ CPU attention kernels (csrc/cpu_attention*.cpp): build once, then load in milliseconds.

`load()` returns the ops namespace `torch.ops.radixlm_cpu` (decode, extend, store_kv, isa; and
the fused elementwise ops of csrc/cpu_elementwise.cpp that layers/cpu_fused.py wraps). The
build's name carries a hash of the sources, the compile flags, the CPU's feature flags (the build
is `-march=native`: AVX-512, AVX2 or generic code, see cpu_vec.h), torch's and Python's versions,
so a build is never loaded on a CPU or torch it was not made for. Builds live in
`$RADIXLM_KERNEL_CACHE/<name>/` (default `~/.cache/radixlm/kernels/`), one per machine, shared by
every process: when `<name>.so` and its `built` marker exist the .so is loaded directly
(`torch.ops.load_library`, a dlopen; no compiler, no lock). Otherwise one process builds it with
`torch.utils.cpp_extension.load` (~30 s on 2 cores; `make install` does it once) while the
others wait on a flock of the build folder.

Failure (no compiler or ninja, a compile error, `RADIXLM_DISABLE_CPU_KERNELS=1`) raises
`CpuKernelsUnavailable` with the reason. A failed build writes `<name>/failed` (its log) and is
not retried by later processes until `python -m radixlm.runtime.attention.cpu_kernels --rebuild`.
The registry's `auto` turns it into ONE logged warning (`warn_fallback`) and torch_native.

Functional API (the cascade / shared-prefix code builds on these; all tensors on the CPU):
  decode(q (B,Hq,D), k_buf, v_buf (N,Hkv,D), req_to_token (R,C) int64, req_pool_indices (B,),
         seq_lens (B,), scale, kv_start=None, window=0, softcap=0.0, out=None, return_lse=False)
      row b attends to req_to_token[req_pool_indices[b], kv_start[b] : seq_lens[b]]; window > 0:
      only to the last `window` of them (its query is at position seq_lens[b] - 1)
  extend(q (T,Hq,D), k_buf, v_buf, req_to_token, req_pool_indices (S,), qo_indptr (S+1,),
         kv_len (S,), scale, kv_start=None, causal=True, window=0, softcap=0.0, out=None,
         return_lse=False)
      q[qo_indptr[s]:qo_indptr[s+1]] (n_q rows) against
      req_to_token[req_pool_indices[s], kv_start[s] : kv_start[s] + kv_len[s]];
      causal: query i sees key j iff j <= kv_len - n_q + i (and, window > 0, j > that - window)
  softcap > 0: scores become softcap * tanh(score / softcap) before the mask and the softmax.
  lse (T, Hq) fp32 is the natural log-sum-exp of the scaled scores; -inf (and out 0) when a row
  sees no key.
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

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).resolve().parents[3] / "csrc"
# Every file of the build, all hashed into the build's name (tests check that every `#include
# "..."` of a source is listed here). The sources are compiled as ONE translation unit,
# csrc/cpu_kernels_unity.cpp, which includes them all (torch's headers parsed once: see there).
_SOURCES = ("cpu_attention.cpp", "cpu_attention_kernel.cpp", "cpu_elementwise.cpp",
            "cpu_gemm.cpp", "cpu_layers.cpp")
_UNITY = "cpu_kernels_unity.cpp"
_HEADERS = ("cpu_attention.h", "cpu_attention_gemm.h", "cpu_attention_bf16.h",
            "cpu_attention_decode.h", "cpu_elementwise_bf16.h", "cpu_vec.h", "quant_pool.h")
CFLAGS = ("-O3", "-march=native", "-fopenmp")
LDFLAGS = ("-fopenmp",)


def _flags() -> tuple[list[str], list[str]]:
    """CFLAGS and LDFLAGS, plus `RADIXLM_KERNEL_CFLAGS` (debugging: "-g -fsanitize=address", or
    "-march=x86-64-v2" for the generic path; such a build gets its own cache entry)."""
    extra = os.environ.get("RADIXLM_KERNEL_CFLAGS", "").split()
    return [*CFLAGS, *extra], [*LDFLAGS, *[f for f in extra if f.startswith("-fsanitize")]]


class CpuKernelsUnavailable(RuntimeError):
    """The C++ kernels could not be built or loaded; the message says why."""


def cache_root() -> Path:
    env = os.environ.get("RADIXLM_KERNEL_CACHE")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(xdg) / "radixlm" / "kernels"


def cpu_features() -> str:
    """The CPU's model and feature flags (what -march=native compiles for)."""
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read().split("\n\n")[0]
        keep = [ln for ln in info.splitlines() if ln.split(":")[0].strip() in
                ("vendor_id", "cpu family", "model", "model name", "flags")]
        return "\n".join(keep)
    except OSError:
        return platform.processor() + platform.machine()


def module_name() -> str:
    return hashed_name("radixlm_cpu_attn_", (_UNITY,) + _SOURCES + _HEADERS)


def hashed_name(prefix: str, files) -> str:
    """prefix + a hash of the csrc `files`, the compile flags, the CPU's features and the torch /
    Python versions: the build folder's name, so any change of them is a new build."""
    h = hashlib.sha256()
    for fname in files:
        h.update((_CSRC / fname).read_bytes())
    for part in (*map(" ".join, _flags()), cpu_features(), torch.__version__,
                 sys.version, platform.machine()):
        h.update(part.encode())
    return prefix + h.hexdigest()[:16]


_lock = threading.Lock()
_module = None
_error: Optional[str] = None
_warned = False


def warn_fallback(reason: str) -> None:
    """Log, once per process, that attention falls back to torch_native and why."""
    global _warned
    if not _warned:
        _warned = True
        logger.warning("CPU attention kernels unavailable, falling back to the torch_native "
                       "attention backend (slower): %s", reason)


def load(verbose: bool = False):
    """The compiled kernels module (built on first use). Raises CpuKernelsUnavailable."""
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
            raise CpuKernelsUnavailable(_error)
    return _module


def _load_or_build(verbose: bool):
    return load_or_build(module_name(), (_UNITY,), _SOURCES + _HEADERS, "radixlm_cpu", "the CPU attention "
                         "kernels", "`python -m radixlm.runtime.attention.cpu_kernels --rebuild` "
                         "retries", verbose)


def load_or_build(name: str, sources, headers, ops_name: str, label: str, retry_hint: str,
                  verbose: bool):
    """torch.ops.<ops_name> from the cached build `name` of csrc `sources` (compiled, one
    translation unit each; `headers`: the other files they include, checked present), building it
    first if needed (the attention kernels and layers/quant_kernels.py share this). Raises with the
    reason when disabled, missing, or when this or an earlier build failed."""
    if os.environ.get("RADIXLM_DISABLE_CPU_KERNELS") == "1":
        raise RuntimeError("disabled by RADIXLM_DISABLE_CPU_KERNELS=1")
    if not all((_CSRC / f).exists() for f in (*sources, *headers)):
        raise FileNotFoundError(f"kernel sources not found in {_CSRC} (an install without csrc/?)")
    build_dir = cache_root() / name
    if _is_built(build_dir, name):  # the common case: no lock, no compiler, a dlopen
        torch.ops.load_library(str(build_dir / f"{name}.so"))
        return getattr(torch.ops, ops_name)
    build_dir.mkdir(parents=True, exist_ok=True)
    # One builder per build_dir across processes. flock is released by the kernel when its holder
    # dies, unlike torch's own "lock" file baton, which a killed build leaves behind (every later
    # build would wait on it forever): holding the flock, any such file is stale and removed.
    with open(build_dir / "build.flock", "w") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        if _is_built(build_dir, name):  # another process built it while we waited
            torch.ops.load_library(str(build_dir / f"{name}.so"))
            return getattr(torch.ops, ops_name)
        failed = build_dir / "failed"
        if failed.exists():  # one failed build per source/CPU/torch: later processes don't retry
            raise RuntimeError(f"an earlier build failed: {_summary(failed.read_text())} (log: "
                               f"{failed}; {retry_hint})")
        (build_dir / "lock").unlink(missing_ok=True)
        try:
            return _build(name, build_dir, sources, ops_name, label, verbose)
        except Exception as e:
            failed.write_text(f"{type(e).__name__}: {e}\n")
            raise RuntimeError(f"building {label} failed: {_summary(str(e))} "
                               f"(log: {failed})") from e


def _is_built(build_dir: Path, name: str) -> bool:
    # "built" is written after the fresh .so loaded fine, so the .so beside it is complete
    return (build_dir / f"{name}.so").exists() and (build_dir / "built").exists()


def _summary(text: str) -> str:
    """The line of a build log that says what went wrong (not the compiler's command line)."""
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    for ln in lines:
        low = ln.lower()
        if (("error" in low or "not found" in low or "no such file" in low)
                and "error building extension" not in low and not low.startswith(("[", "failed:"))):
            return ln[:300]
    return lines[0][:300] if lines else "unknown error"


def _build(name: str, build_dir: Path, sources, ops_name: str, label: str, verbose: bool):
    from torch.utils import cpp_extension

    # cpp_extension runs `ninja` from PATH: let a venv's own ninja (pip's) count without activation
    bin_dir = os.path.dirname(sys.executable)
    if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = os.pathsep.join([os.environ.get("PATH", ""), bin_dir]).strip(os.pathsep)
    t0 = time.perf_counter()
    logger.info("building %s into %s (once per CPU/torch/source)", label, build_dir)
    # is_python_module=False: the .so registers torch.ops.<ops_name>.* with the dispatcher and
    # is loaded with torch.ops.load_library (no pybind11: its headers triple the compile time)
    cflags, ldflags = _flags()
    cpp_extension.load(
        name=name, sources=[str(_CSRC / f) for f in sources], extra_cflags=cflags,
        extra_ldflags=ldflags, extra_include_paths=[str(_CSRC)],
        build_directory=str(build_dir), verbose=verbose, is_python_module=False)
    ops = getattr(torch.ops, ops_name)
    (build_dir / "built").write_text(ops.isa() + "\n")
    logger.info("built %s (%s) in %.1fs", label, ops.isa(), time.perf_counter() - t0)
    return ops


def main(argv=None) -> int:
    """`python -m radixlm.runtime.attention.cpu_kernels [--rebuild]`: build the kernels now
    (`make install` runs it) and say where they are. Exits 0 even when the build fails: attention
    then falls back to torch_native with a warning; `--strict` makes a failure exit 1."""
    import argparse
    import shutil

    p = argparse.ArgumentParser(description=main.__doc__.splitlines()[0])
    p.add_argument("--rebuild", action="store_true", help="forget an earlier build or failure")
    p.add_argument("--strict", action="store_true", help="exit 1 when the kernels are unavailable")
    p.add_argument("--verbose", action="store_true", help="show the compiler's commands")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    build_dir = cache_root() / module_name()
    if args.rebuild and build_dir.exists():
        shutil.rmtree(build_dir)
    t0 = time.perf_counter()
    try:
        ops = load(verbose=args.verbose)
    except CpuKernelsUnavailable as e:
        print(f"warning: CPU attention kernels unavailable, attention will use torch_native: {e}",
              file=sys.stderr)
        return 1 if args.strict else 0
    print(f"CPU attention kernels ({ops.isa()}) ready in {time.perf_counter() - t0:.1f}s: "
          f"{build_dir}")
    return 0


_EMPTY = torch.empty(0)
_EMPTY_I64 = torch.empty(0, dtype=torch.int64)


def _i64(t: Optional[torch.Tensor]) -> torch.Tensor:
    return _EMPTY_I64 if t is None else t.to(torch.int64).contiguous()


def decode(q, k_buf, v_buf, req_to_token, req_pool_indices, seq_lens, scale: float, *,
           kv_start=None, window: int = 0, softcap: float = 0.0, out=None,
           return_lse: bool = False):
    out = torch.empty_like(q) if out is None else out
    lse = q.new_empty(q.shape[:2], dtype=torch.float32) if return_lse else _EMPTY
    load().decode(q, k_buf, v_buf, req_to_token, _i64(req_pool_indices), _i64(kv_start),
                  _i64(seq_lens), float(scale), int(window), float(softcap), out, lse)
    return (out, lse) if return_lse else out


def extend(q, k_buf, v_buf, req_to_token, req_pool_indices, qo_indptr, kv_len, scale: float, *,
           kv_start=None, causal: bool = True, window: int = 0, softcap: float = 0.0, out=None,
           return_lse: bool = False):
    out = torch.empty_like(q) if out is None else out
    lse = q.new_empty(q.shape[:2], dtype=torch.float32) if return_lse else _EMPTY
    load().extend(q, k_buf, v_buf, req_to_token, _i64(req_pool_indices), _i64(qo_indptr),
                  _i64(kv_start), _i64(kv_len), bool(causal), float(scale), int(window),
                  float(softcap), out, lse)
    return (out, lse) if return_lse else out


if __name__ == "__main__":
    sys.exit(main())
