"""Python ints -> int64 device tensors in one host -> device copy through pinned memory.

A copy from pageable memory (`torch.tensor(values, device="cuda")`, or `.to("cuda")` of a fresh
CPU tensor) is synchronous with the host and waits for the GPU work queued before it on the
stream: speculative drafting, which builds its inputs while forwards are queued, stalled on such
copies until they ran (2026-11-28). Through a pinned buffer the copy is queued like a kernel and
the host goes on at once. The extend batch (scheduler/batch_builder.py) uses it too: one copy of
its five index arrays instead of five synchronous ones. Where a kernel can read pinned host memory
(uva_copy.py: CUDA with UVA) that kernel makes the copy, not the copy engine, so that it does not
wait behind the hierarchical cache's loads queued there.

`staged(values, device)`: one list; `staged_parts(parts, device)`: several lists or 1-D int
arrays in one copy, returned as views of one device tensor.
"""

from __future__ import annotations

import threading

import numpy as np
import torch

from radixlm.runtime.executor import uva_copy


class _HostStaging:
    """On CUDA through pinned buffers kept across calls (pinning a fresh tensor each step took
    ~30 us of host time on an H200's host, cProfile), a ring of RING of them: before refilling
    one, the copy that last read it must have completed, and that copy may sit behind the GPU
    work queued before it (a step's draft forwards): with one buffer the next staging of the
    same step waited for them all."""

    RING = 8

    def __init__(self):
        self._slots: list = [[None, None, None] for _ in range(self.RING)]  # pinned, numpy, done
        self._next = 0

    def to_device(self, parts: list, device: torch.device) -> torch.Tensor:
        n = sum(len(p) for p in parts)
        if device.type != "cuda":
            return torch.from_numpy(_concat(parts, n)).to(device)
        slot = self._slots[self._next]
        self._next = (self._next + 1) % self.RING
        pinned, host, done = slot
        if pinned is None or pinned.numel() < n:
            pinned = torch.empty(max(n, 2 * (0 if pinned is None else pinned.numel()), 4096),
                                 dtype=torch.int64).pin_memory()
            host, done = pinned.numpy(), None
        elif done is not None:
            done.synchronize()  # (issued RING stagings ago: a step or more before)
        at = 0
        for p in parts:
            host[at:at + len(p)] = p
            at += len(p)
        if n and uva_copy.available(device):  # not behind the copy engine's queue (loads)
            out = uva_copy.copy_words(pinned[:n], torch.empty(n, dtype=torch.int64,
                                                              device=device))
        else:
            out = pinned[:n].to(device, non_blocking=True)
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(device))
        slot[:] = [pinned, host, done]
        return out


def _concat(parts: list, n: int) -> np.ndarray:
    out = np.empty(n, dtype=np.int64)
    at = 0
    for p in parts:
        out[at:at + len(p)] = p
        at += len(p)
    return out


class _PerThread(threading.local):  # one staging ring per scheduler thread (engine)
    def __init__(self):
        self.staging = _HostStaging()


_STAGING = _PerThread()


def staged(values, device: torch.device) -> torch.Tensor:
    """Python ints (or a 1-D int array) -> an int64 tensor on `device`, in one copy."""
    return _STAGING.staging.to_device([values], device)


def staged_parts(parts: list, device: torch.device) -> list[torch.Tensor]:
    """Several lists / 1-D int arrays -> int64 tensors on `device` (views of one), one copy."""
    flat = _STAGING.staging.to_device(parts, device)
    out, at = [], 0
    for p in parts:
        out.append(flat[at:at + len(p)])
        at += len(p)
    return out
