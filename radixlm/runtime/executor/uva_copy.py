"""Small host -> device copies made by a kernel that reads pinned host memory over PCIe (UVA),
not by the GPU's copy engine.

Why: the copy engine runs host -> device copies in the order they were queued, whatever their
stream. A forward's inputs (a few KB through host_staging.py, on the compute stream) queued after
the hierarchical cache's loads (hundreds of MB a request, mem_cache/kv_mover.py's own stream)
waited for all of them: on an H200, 120 conversations x 8 turns with the host tier, extends
waited 13-114 ms each on the GPU between the event before their batch's build and their first
kernel, 0.86 s of a 22.4 s run (benchmarks/probes/step_timeline.py; copy_engine.py measures the
queueing alone). A kernel's loads from pinned memory cross PCIe beside the DMAs instead of behind
them: the same run 21.25 s against 22.26 s for the code before in the same call, throughput
2.632x the device pool alone (docs/hicache.md; tests/gpu/test_host_staging_gpu.py checks that
staged inputs land while 512 MiB of DMAs queued before them are still copying).

`copy_words(src, out)`: src a pinned int64 CPU tensor, out an int64 CUDA tensor of the same
length, queued on the current stream like any kernel (the caller keeps src alive and unchanged
until it has run, as for a non_blocking copy). `available(device)` is checked once a process:
the kernel copies a pattern and the result is compared; if Triton refuses the host pointer or the
bytes differ, it is False (one warning) and callers use the copy engine as before.
"""

from __future__ import annotations

import logging
import threading

import torch

logger = logging.getLogger(__name__)

BLOCK = 1024  # int64 words a program

_lock = threading.Lock()
_checked: dict = {}  # device index -> bool

try:
    import triton
    import triton.language as tl
except ImportError:  # (a CPU-only install: available() is False)
    triton = None


if triton is not None:
    @triton.jit
    def _words_from_host(Src, Dst, n, BLOCK: tl.constexpr):
        # Src (n,) int64 in pinned host memory (read through UVA), Dst (n,) int64 on the device
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        tl.store(Dst + offs, tl.load(Src + offs, mask=m), mask=m)


def copy_words(src: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out[:] = src (int64, src pinned on the host, out on the device) by a kernel."""
    n = src.numel()
    _words_from_host[(triton.cdiv(n, BLOCK),)](src, out, n, BLOCK=BLOCK, num_warps=4)
    return out


def available(device: torch.device) -> bool:
    """Whether copy_words works on this device (checked once, with a pattern)."""
    if device.type != "cuda" or triton is None:
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    ok = _checked.get(index)
    if ok is None and torch.cuda.is_current_stream_capturing():
        return False  # (the check synchronizes: not inside a CUDA graph's capture)
    if ok is None:
        with _lock:
            ok = _checked.get(index)
            if ok is None:
                ok = _check(torch.device("cuda", index))
                _checked[index] = ok
    return ok


def _check(device: torch.device) -> bool:
    try:
        src = torch.arange(3 * BLOCK + 5, dtype=torch.int64).mul_(0x9E3779B97F4A7C15 >> 8)
        src = src.pin_memory()
        with torch.cuda.device(device):
            out = copy_words(src, torch.empty(src.numel(), dtype=torch.int64, device=device))
            torch.cuda.synchronize(device)
        if torch.equal(out.cpu(), src):
            return True
        reason = "the copied words differ"
    except Exception as e:  # noqa: BLE001 - any failure: the copy engine, as before
        reason = f"{type(e).__name__}: {e}"[:300]
    logger.warning("small host -> device copies go through the copy engine (they may wait "
                   "behind the cache's loads): a kernel cannot read pinned host memory here "
                   "(%s)", reason)
    return False
