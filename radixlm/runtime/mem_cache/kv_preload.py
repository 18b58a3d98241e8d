"""Preloads (CUDA): a host -> device load whose copy runs beside the forwards queued after it.

A preload DMAs the host rows into a device staging block on the mover's load stream, which waits
for nothing on the compute stream (only for an in-flight backup into the same host rows), and
`land_preloads` scatters each block whose DMA has finished into its device slots on the compute
stream, so the scatter is ordered after every earlier reader of those slots (evictions make them
free while forwards that read them may still be queued) and before every later forward. Until it
has landed, no forward may read the slots: the tree marks the loaded nodes (`TierNode.loading`)
and the scheduler admits no request whose match reaches one (scheduler/prefill.py).

Why not the copy stream of the other loads: a backup there first waits for the compute stream's
queued work (the KV it copies is written by those forwards), so every load queued behind a backup
waited for the forward in flight, and a load's copy never overlapped a decode step (on an H100 a
multi-turn run's copies stayed serialized with compute, 16% of its GPU time). Backups wait for the
preloads in flight instead (a preload reads host rows a new backup may write, once their node's
host copy was evicted), which take milliseconds and wait for no forward.

The staging blocks (device memory outside the KV pool) are bounded by the mover's staging budget:
past it a request waits for a later round rather than preloading (`can_preload`).
"""

from __future__ import annotations

from collections import deque
from typing import Optional

import torch


class Preload:
    __slots__ = ("event", "block", "dev_idx", "nbytes", "landed")

    def __init__(self, event, block, dev_idx, nbytes: int):
        self.event, self.block, self.dev_idx, self.nbytes = event, block, dev_idx, nbytes
        self.landed = False


class PreloadMixin:
    """KVMover's preloads (host_pool.py); the mixin's state is set by `_init_preloads`, and it
    uses the mover's `_host_runs`, `_dma_up`, `_scatter`, `complete` and backup records."""

    def _init_preloads(self) -> None:
        self.load_stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._preloads: deque = deque()  # in issue order (one stream: they finish in order)
        self.preload_bytes = 0

    @property
    def preloads(self) -> bool:
        """Whether loads can be preloads (CUDA; the CPU's loads are synchronous copies)."""
        return self.cuda

    def can_preload(self, n: int) -> bool:
        """Room for n more tokens' staging (one preload always, so a long one is not starved)."""
        nbytes = n * self.host.token_bytes
        return not self._preloads or self.preload_bytes + nbytes <= self.staging_bytes

    def preload(self, host_idx: torch.Tensor, dev_idx: torch.Tensor) -> Preload:
        n = host_idx.numel()
        runs = self._host_runs(host_idx)
        # a gathered backup lands in its host rows on the CPU (complete), and a scattered load
        # reads them on the CPU: as in to_device
        if self._backups and (runs is None or any(b[0] is not None for b in self._backups)):
            self.complete()
        staging = None
        if runs is None:
            staging = torch.empty(self.host.block_shape(n), dtype=self.host.dtype,
                                  pin_memory=True)
            self.host.rows(host_idx, out=staging)
        with torch.cuda.stream(self.load_stream):
            for ev in self._backups_into(host_idx):
                self.load_stream.wait_event(ev)
            block = self._dma_up(runs, staging, 0, n)
            event = torch.cuda.Event()
            event.record(self.load_stream)
        p = Preload(event, block, dev_idx, n * self.host.token_bytes)
        self._preloads.append(p)
        self.preload_bytes += p.nbytes
        if staging is None:
            self._direct_loads.append(event)  # (the DMA reads the host rows until then)
        else:
            self._staged_loads.append((staging, event))
        return p

    def land_preloads(self) -> None:
        """Scatter, on the compute stream, every preload whose DMA has finished."""
        compute = torch.cuda.current_stream(self.device) if self.cuda else None
        while self._preloads and self._preloads[0].event.query():
            p = self._preloads.popleft()
            self._scatter(p.dev_idx, p.block)
            p.block.record_stream(compute)  # its memory waits for the scatter before reuse
            p.block, p.landed = None, True
            self.preload_bytes -= p.nbytes

    def finish_preloads(self) -> None:
        """Land every preload now (waiting for its DMA): before the loaded slots can be freed
        without having landed (a preloading request aborted, the tree reset), since a later
        landing would write slots another request may own by then."""
        for p in self._preloads:
            p.event.synchronize()
        self.land_preloads()

    def last_preload_event(self) -> Optional[torch.cuda.Event]:
        """For a backup: the newest preload still reading host rows (it implies the others)."""
        return self._preloads[-1].event if self._preloads else None

    def _backups_into(self, host_idx: torch.Tensor) -> list:
        """Events of the direct backups in flight that write any of these host rows."""
        out = []
        for staging, rows, event in self._backups:
            if staging is None and rows is not None and not event.query():
                if torch.isin(rows, host_idx).any():
                    out.append(event)
        return out
