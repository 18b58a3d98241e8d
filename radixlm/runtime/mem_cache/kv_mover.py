"""The copies between the host pool (L2, host_pool.py) and the device pool (L1).

`KVMover` does the copies:
- CPU: synchronous index copies (the forward runs after them on the same thread).
- CUDA: three streams of its own, so that no copy waits behind a copy the other way and the
  compute stream never waits for a load.
  - Backups (device -> host) on `stream`: after the compute stream's pending work (the forwards
    that wrote the KV), one gather kernel a chunk, then each run of host slots DMA'd straight
    into its rows (a scattered backup into pinned staging, landed by `complete()`). Before the
    device slots of an evicted node are written again the compute stream waits for that node's
    own backup (`guard_device_reuse(events)`), if it is still in flight.
  - Loads (host -> device): each chunk is DMA'd on `load_stream` into a ring of device staging
    buffers (staging_bytes() in all, allocated once), then scattered into the device slots
    by one kernel on `scatter_stream`. A DMA waits only for a backup still writing host rows it
    reads and for the scatter that last read its ring buffer; a load's scatters wait for the
    compute stream's pending work (evicted slots' readers may still be queued, and evictions
    waited for their backups there). `to_device` returns the event after the load's last
    scatter: a preload polls it (scheduler/prefill.py: the request is admitted once it has
    completed), `load_back` has the compute stream wait for it.
  Before (until 2026-11-28) loads and backups shared one copy stream: a backup queued behind a
  wave's loads made every eviction's wait on the compute stream a wait for those loads, and each
  load's scatter waited for the compute stream in the queue before the next load's DMA (an H100
  profile saw the host -> device copies serialized with the forwards, 16.5% of its window). The
  split did not change the multi-turn benchmark's throughput (docs/hicache.md: when a wave of
  turns arrives, little else is left to run beside its copies).
"""

from __future__ import annotations

from collections import deque
from typing import Optional

import torch

from radixlm.runtime.mem_cache.host_pool import (HostKVPool, as_words, direct_runs,
                                                 split_runs)
from radixlm.runtime.mem_cache.kv_pool import KVPool

# Device staging of loads: a ring of buffers of STAGING_CHUNK_BYTES each, staging_bytes() in
# all, allocated at the first load and kept (the model runner leaves that much of the device out
# of the KV pool). A DMA into a buffer waits for the scatter that last read it, so loads of any
# size go through it in chunks; the ring lets the DMAs run ahead of scatters that wait for a
# forward: a split request's tail (mem_cache/head_split.py) streams to the device while its head
# computes, and with 512 MiB ~0.9 GB of a 16k-token tail crossed after the head (H200, 8B,
# 2026-11-28), so the ring holds one long tail: 1/64 of the device's memory (2 GiB on an H200,
# 1.25 on an H100), at least 512 MiB. Each chunk costs the scheduler's thread its calls (copies,
# two events, waits): with 32 MiB chunks an H200 host spent 2.5 ms in a preload of ~3k tokens of
# an 8B model (2026-11-28), so chunks are large. The chunk is also a backup's gather unit.
STAGING_CHUNK_BYTES = 128 << 20
STAGING_MIN_BYTES, STAGING_MAX_BYTES, STAGING_SHARE = 512 << 20, 2 << 30, 64
STAGING_BYTES: Optional[int] = None  # set: the ring's bytes on every device (probes)


def staging_bytes(device: torch.device) -> int:
    """The load ring's device bytes (0 off CUDA, where loads are copies on the caller's thread)."""
    if device.type != "cuda":
        return 0
    if STAGING_BYTES is not None:
        return STAGING_BYTES
    total = torch.cuda.get_device_properties(device).total_memory
    return min(STAGING_MAX_BYTES, max(STAGING_MIN_BYTES, total // STAGING_SHARE))


class KVMover:
    def __init__(self, device_pool: KVPool, host: HostKVPool, device: torch.device):
        self.dev, self.host, self.device = device_pool, host, device
        # (capacity + 1, L, 2, H, D) view of the device pool, and the host pool, as words
        # (as_words) when both can be (the CPU paths copy between the two directly)
        self.slot_words, self.host_words = as_words(device_pool.slot_view()), host.words
        if self.slot_words.dtype != self.host_words.dtype:
            self.slot_words, self.host_words = device_pool.slot_view(), host.kv
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None  # backups
        self.load_stream = torch.cuda.Stream(device) if self.cuda else None  # load DMAs
        self.scatter_stream = torch.cuda.Stream(device) if self.cuda else None  # load scatters
        # tokens a staging chunk (a ring buffer; never more than the device pool holds)
        self.chunk = max(1, min(STAGING_CHUNK_BYTES // host.token_bytes, device_pool.capacity))
        # buffers in the ring: staging_bytes() in all, at most what the device pool holds (the
        # model runner left staging_bytes() out of its budget: an upper bound)
        ring_bytes = min(staging_bytes(device), device_pool.capacity * host.token_bytes)
        ring = max(2, ring_bytes // (self.chunk * host.token_bytes))
        self._ring: list[Optional[torch.Tensor]] = [None] * ring
        self._ring_free: list[Optional[torch.cuda.Event]] = [None] * ring  # its last scatter
        self._ring_pos = 0
        self._backups: deque = deque()  # (pinned staging, host slots, event), in issue order
        # backups ever queued, and how many of the first of them have landed (one stream: they
        # complete in order): work waiting for the host rows as they were when `backups_queued`
        # was n may start once `backups_landed` >= n (land_ready, without a host sync)
        self.backups_queued = 0
        self.backups_landed = 0
        # backups whose DMA may still write host rows: (first row, last row, event); a load
        # reading rows in that span waits for it on the GPU
        self._backup_spans: deque = deque()
        self._staged_loads: deque = deque()  # (pinned staging, event): alive until copied
        self._direct_loads: deque = deque()  # events of loads that read the host rows

    @property
    def loads_async(self) -> bool:
        """Whether a load returns before its copy is done (an event to wait for): CUDA."""
        return self.cuda

    def _gather(self, dev_idx: torch.Tensor) -> torch.Tensor:
        """(n, L, 2, H, D) contiguous copy of device slots dev_idx: one kernel."""
        return self.slot_words.index_select(0, dev_idx).view(self.host.dtype)

    def _scatter(self, dev_idx: torch.Tensor, block: torch.Tensor) -> None:
        """block (n, L, 2, H, D) -> device slots dev_idx: one kernel."""
        words = as_words(block)
        if words.dtype == self.slot_words.dtype:
            self.slot_words.index_copy_(0, dev_idx, words)
        else:
            self.slot_words.view(self.host.dtype).index_copy_(0, dev_idx, block)

    # --- device -> host ------------------------------------------------------------------------
    def to_host(self, dev_idx: torch.Tensor, host_idx: torch.Tensor
                ) -> Optional[torch.cuda.Event]:
        """Copy the KV at device slots dev_idx (n,) into host slots host_idx (n,). CUDA: returns
        the copy's event (the device slots are read until it completes; pass it to
        `guard_device_reuse` before freeing them). None on the CPU, where the copy is done."""
        kv = self.host.kv
        runs = direct_runs(host_idx, self.host.token_bytes)
        n = host_idx.numel()
        if not self.cuda:  # each run gathered straight into its host rows, no block in between
            if runs is None:
                self.host.put_rows(host_idx, self._gather(dev_idx))
            for off, start, length in runs or ():
                torch.index_select(self.slot_words, 0, dev_idx[off:off + length],
                                   out=self.host_words[start:start + length])
            return None
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # the KV's forwards first
        staging = None
        if runs is None:
            staging = torch.empty(self.host.block_shape(n), dtype=kv.dtype, pin_memory=True)
        with torch.cuda.stream(self.stream):
            for lo in range(0, n, self.chunk):
                hi = min(n, lo + self.chunk)
                block = self._gather(dev_idx[lo:hi])  # on this stream, freed back to it
                if staging is not None:
                    staging[lo:hi].copy_(block, non_blocking=True)
                    continue
                for off, start, length in split_runs(runs, lo, hi):  # straight into the rows
                    kv[start:start + length].copy_(block[off:off + length], non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        dev_idx.record_stream(self.stream)
        self._backups.append((staging, None if staging is None else host_idx, event))
        self.backups_queued += 1
        if staging is None:  # (a staged one lands on the CPU: loads complete() it first)
            self._backup_spans.append((int(host_idx.min()), int(host_idx.max()), event))
        return event

    def backups_in_flight(self) -> bool:
        """Whether a backup may not have landed in its host rows yet (CUDA: one still copying,
        or a staged one that `complete()` has not landed; never on the CPU, where to_host copies
        at once)."""
        while self._backups and self._backups[0][0] is None and self._backups[0][2].query():
            self._backups.popleft()
            self.backups_landed += 1
        return bool(self._backups)

    def land_ready(self) -> int:
        """Land the backups that have completed, in order, without waiting for any (a forward
        may be in flight: the overlap schedule); returns `backups_landed`."""
        while self._backups and self._backups[0][2].query():
            staging, host_idx, _ = self._backups.popleft()
            if staging is not None:
                self.host.put_rows(host_idx, staging)
            self.backups_landed += 1
        return self.backups_landed

    def guard_device_reuse(self, events: list) -> None:
        """Before freeing device slots: later compute-stream work (and loads, whose scatters
        wait for it) waits for the backups still reading them (`events`: theirs, from to_host)."""
        compute = torch.cuda.current_stream(self.device) if self.cuda else None
        for event in events:
            if event is not None and not event.query():
                compute.wait_event(event)

    def complete(self, loads: bool = False) -> None:
        """Land the backups in the host rows, waiting for those in flight: before the CPU reads
        or writes host rows. A load's DMA only reads rows of nodes it is making device nodes,
        whose host slots cannot be freed (and written by the CPU) before the load is done, so
        loads are not waited for; `loads`: they are too, scatters included (before both pools
        are reset)."""
        if loads and self.cuda:
            self.load_stream.synchronize()
            self.scatter_stream.synchronize()
        while self._backups:
            staging, host_idx, event = self._backups.popleft()
            event.synchronize()
            if staging is not None:  # direct backups are in the host rows already
                self.host.put_rows(host_idx, staging)
            self.backups_landed += 1
        self._backup_spans.clear()
        self._forget_done()

    def _forget_done(self) -> None:
        for queue, event_of in ((self._staged_loads, lambda x: x[1]),
                                (self._backup_spans, lambda x: x[2]),
                                (self._direct_loads, lambda x: x)):
            while queue and event_of(queue[0]).query():
                queue.popleft()

    # --- host -> device ------------------------------------------------------------------------
    def to_device(self, host_idx: torch.Tensor, dev_idx: torch.Tensor
                  ) -> Optional[torch.cuda.Event]:
        """Copy host slots host_idx (n,) into device slots dev_idx (n,). CUDA: asynchronous,
        nothing queued on the compute stream; returns the event after the last scatter, which
        must have completed (or be waited for by the compute stream) before any forward reads
        dev_idx. None on the CPU, where the copy is done."""
        n = host_idx.numel()
        runs = direct_runs(host_idx, self.host.token_bytes)
        if not self.cuda:  # each run scattered straight from its host rows, no block in between
            if runs is None:
                self._scatter(dev_idx, self.host.rows(host_idx))
            for off, start, length in runs or ():
                self.slot_words.index_copy_(0, dev_idx[off:off + length],
                                            self.host_words[start:start + length])
            return None
        # a gathered backup lands in its host rows on the CPU, and a scattered load reads them
        # on the CPU: either waits for the backups in flight first
        if self._backups and (runs is None or any(b[0] is not None for b in self._backups)):
            self.complete()
        self._forget_done()
        staging = None
        if runs is None:  # scattered: gathered on the CPU into pinned memory, then DMA'd
            staging = torch.empty(self.host.block_shape(n), dtype=self.host.dtype,
                                  pin_memory=True)
            self.host.rows(host_idx, out=staging)
        else:  # the DMAs wait for backups still writing rows they read (a node evicted from
            lo, hi = int(host_idx.min()), int(host_idx.max())  # the device as its backup ran)
            for first, last, event in self._backup_spans:
                if first <= hi and lo <= last:
                    self.load_stream.wait_event(event)
        # the scatters follow the compute stream's queued work: it may still read slots that
        # evictions freed for this load (and it waits for their backups: guard_device_reuse)
        self.scatter_stream.wait_stream(torch.cuda.current_stream(self.device))
        dma = done = None
        for lo in range(0, n, self.chunk):
            hi = min(n, lo + self.chunk)
            j = self._ring_pos
            self._ring_pos = (j + 1) % len(self._ring)
            buf = self._ring_buffer(j)[:hi - lo]
            if self._ring_free[j] is not None:
                self.load_stream.wait_event(self._ring_free[j])  # its last scatter read it
            with torch.cuda.stream(self.load_stream):
                if staging is not None:
                    buf.copy_(staging[lo:hi], non_blocking=True)
                else:
                    for off, start, length in split_runs(runs, lo, hi):
                        buf[off:off + length].copy_(self.host.kv[start:start + length],
                                                    non_blocking=True)
                dma = torch.cuda.Event()
                dma.record(self.load_stream)
            self.scatter_stream.wait_event(dma)
            with torch.cuda.stream(self.scatter_stream):
                self._scatter(dev_idx[lo:hi], buf)
                done = torch.cuda.Event()
                done.record(self.scatter_stream)
            self._ring_free[j] = done
        dev_idx.record_stream(self.scatter_stream)
        if staging is None:
            self._direct_loads.append(dma)  # (the DMAs' end: host rows read)
        else:
            self._staged_loads.append((staging, dma))
        return done

    def _ring_buffer(self, j: int) -> torch.Tensor:
        if self._ring[j] is None:
            self._ring[j] = torch.empty(self.host.block_shape(self.chunk), dtype=self.host.dtype,
                                        device=self.device)
        return self._ring[j]

    # --- host rows for storage -------------------------------------------------------------------
    def read_host(self, host_idx: torch.Tensor) -> torch.Tensor:
        """(n, L, 2, H, D) copy of host slots host_idx."""
        self.complete()
        return self.host.rows(host_idx)

    def write_host(self, host_idx: torch.Tensor, block: torch.Tensor) -> None:
        """block (n, L, 2, H, D) -> host slots host_idx."""
        self.complete()
        self.host.put_rows(host_idx, block)

    def read_device(self, dev_idx: torch.Tensor) -> torch.Tensor:
        """(n, L, 2, H, D) host copy of device slots dev_idx (synchronous)."""
        return self._gather(dev_idx).cpu()
