"""The copies between the host pool (L2, host_pool.py) and the device pool (L1).

`KVMover` does the copies:
- CPU: synchronous index copies (the forward runs after them on the same thread).
- CUDA: on its own stream. A load (host -> device) DMAs each run of consecutive host slots into a
  device staging block (n, layers, 2, H, D) (a scattered load gathers the rows into a pinned
  staging block on the CPU first, then one DMA), records an event, and the compute stream waits
  for it and scatters the block into the device slots with one kernel: the copy stream never
  waits for compute on a load, so the DMAs of every load of a round overlap the work queued
  before them, and the forward that follows on the compute stream is ordered after the scatter
  (no per-layer events; with the layer-major pool, layer l's copies were awaited by layer l).
  Staging blocks awaiting their scatter are bounded (STAGING_BYTES); past that a load goes in
  chunks whose scatters run on the copy stream after it waits for the compute stream (evictions'
  readers of the device slots may still be queued), and the next forward's attention waits for
  that load's event at its first layer (`LayerWaitingBackend`). A backup (device -> host)
  gathers on the copy stream after the compute stream's pending work (one kernel a chunk) and
  DMAs each run straight into the host rows (a scattered one into pinned staging, landed in the
  rows by `complete()`);
  `complete()` runs before any host read or write and waits for the copies in flight, and the
  compute stream waits for a backup before a freed device slot can be written again
  (`guard_device_reuse`). Loads and backups share the one copy stream, so a backup into slots
  that a queued load still reads runs after it.
- The scheduler's loads on CUDA are preloads (`to_device(detached=True)`): DMA and scatter both on
  the copy stream, nothing on the compute stream; the caller waits for the returned event
  before a forward reads the slots (scheduler/prefill.py).
"""

from __future__ import annotations

from collections import deque
from typing import Optional

import torch

from radixlm.runtime.mem_cache.host_pool import (HostKVPool, as_words, direct_runs,
                                                 split_runs)
from radixlm.runtime.mem_cache.kv_pool import KVPool

# Device staging: loads whose blocks await their scatter on the compute stream hold at most this
# much (a longer load, or one past the budget, goes in chunks of this size through copy-stream
# memory that is reused at once); also the chunk of a backup's gather. Large enough for a long
# chat's history (4k tokens of an 8B model) in one DMA a run, small beside the activations'
# share of device memory (1 - mem_fraction_static).
STAGING_BYTES = 512 << 20


class KVMover:
    def __init__(self, device_pool: KVPool, host: HostKVPool, device: torch.device):
        self.dev, self.host, self.device = device_pool, host, device
        # (capacity + 1, L, 2, H, D) view of the device pool, and the host pool, as words
        # (as_words) when both can be (the CPU paths copy between the two directly)
        self.slot_words, self.host_words = as_words(device_pool.slot_view()), host.words
        if self.slot_words.dtype != self.host_words.dtype:
            self.slot_words, self.host_words = device_pool.slot_view(), host.kv
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.staging_bytes = STAGING_BYTES
        self.chunk = max(1, STAGING_BYTES // host.token_bytes)  # tokens per staging chunk
        self._backups: deque = deque()  # (pinned staging, host slots, event), in issue order
        self._staged_loads: deque = deque()  # (pinned staging, event): alive until copied
        self._direct_loads: deque = deque()  # events of loads that read the host rows
        self._last_backup = None
        self._layer_events: Optional[list] = None
        # loads scattered on the compute stream: (event after the scatter, staging bytes)
        self._compute_staged: deque = deque()

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
    def to_host(self, dev_idx: torch.Tensor, host_idx: torch.Tensor) -> None:
        """Copy the KV at device slots dev_idx (n,) into host slots host_idx (n,)."""
        kv = self.host.kv
        runs = direct_runs(host_idx, self.host.token_bytes)
        n = host_idx.numel()
        if not self.cuda:  # each run gathered straight into its host rows, no block in between
            if runs is None:
                self.host.put_rows(host_idx, self._gather(dev_idx))
            for off, start, length in runs or ():
                torch.index_select(self.slot_words, 0, dev_idx[off:off + length],
                                   out=self.host_words[start:start + length])
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # the KV's forwards first
        staging = None
        if runs is None:
            staging = torch.empty(self.host.block_shape(n), dtype=kv.dtype, pin_memory=True)
        with torch.cuda.stream(self.stream):
            for lo in range(0, n, self.chunk):
                hi = min(n, lo + self.chunk)
                block = self._gather(dev_idx[lo:hi])  # on the copy stream, freed back to it
                if staging is not None:
                    staging[lo:hi].copy_(block, non_blocking=True)
                    continue
                for off, start, length in split_runs(runs, lo, hi):  # straight into the rows
                    kv[start:start + length].copy_(block[off:off + length], non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        dev_idx.record_stream(self.stream)
        self._backups.append((staging, None if staging is None else host_idx, event))
        self._last_backup = event

    def backups_in_flight(self) -> bool:
        """Whether a backup may not have landed in its host rows yet (CUDA until `complete()`;
        never on the CPU, where to_host copies at once)."""
        return bool(self._backups)

    def loads_in_flight(self) -> bool:
        """Whether a load's DMA may still be reading host rows (CUDA until `complete()`)."""
        return bool(self._direct_loads)

    def guard_device_reuse(self) -> None:
        """Before freeing device slots: later compute-stream writes wait for backups reading them."""
        if self.cuda and self._last_backup is not None:
            torch.cuda.current_stream(self.device).wait_event(self._last_backup)

    def complete(self) -> None:
        """Land finished backups in the host rows; call before reading or writing host rows."""
        while self._direct_loads:  # DMA still reading host rows that the CPU may write next
            self._direct_loads.popleft().synchronize()
        while self._backups:
            staging, host_idx, event = self._backups.popleft()
            event.synchronize()
            if staging is not None:  # direct backups are in the host rows already
                self.host.put_rows(host_idx, staging)
        while self._staged_loads and self._staged_loads[0][1].query():
            self._staged_loads.popleft()

    # --- host -> device ------------------------------------------------------------------------
    def to_device(self, host_idx: torch.Tensor, dev_idx: torch.Tensor,
                  detached: bool = False) -> Optional[torch.cuda.Event]:
        """Copy host slots host_idx (n,) into device slots dev_idx (n,). On CUDA asynchronous: the
        next forward must be handed `take_layer_events()` (events only for a chunked load; a
        load scattered on the compute stream is ordered before the forward already).
        `detached` (CUDA): DMA and scatter both on the copy stream, nothing queued on the compute
        stream and no event for the next forward: returns the load's event, which the caller
        waits for (event.query()) before any forward reads dev_idx. The forwards queued
        meanwhile run beside the copy (a preload: scheduler/prefill.py). None otherwise."""
        kv, n = self.host.kv, host_idx.numel()
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
        while self._staged_loads and self._staged_loads[0][1].query():
            self._staged_loads.popleft()
        # (a load by DMA waits for no earlier copy: it only reads host rows, and the one copy
        # stream orders it after earlier loads and the direct backups into those rows)
        staging = None
        if runs is None:  # scattered: gathered on the CPU into pinned memory, then one DMA
            staging = torch.empty(self.host.block_shape(n), dtype=kv.dtype, pin_memory=True)
            self.host.rows(host_idx, out=staging)
        compute = torch.cuda.current_stream(self.device)
        while self._compute_staged and self._compute_staged[0][0].query():
            self._compute_staged.popleft()
        nbytes = n * self.host.token_bytes
        detached_event = None
        if detached:
            event = detached_event = self._load_on_copy_stream(runs, staging, dev_idx, n, compute)
        elif nbytes <= self.staging_bytes - sum(b for _, b in self._compute_staged):
            # DMA on the copy stream, scatter on the compute stream: the copy stream never waits
            # for compute, so the DMAs of every load of a round overlap the work queued before
            # them, and the forward, queued after the scatter, needs no event of its own
            with torch.cuda.stream(self.stream):
                up = self._dma_up(runs, staging, 0, n)
                event = torch.cuda.Event()
                event.record(self.stream)
            compute.wait_event(event)
            up.record_stream(compute)  # its memory waits for the scatter before reuse
            self._scatter(dev_idx, up)
            done = torch.cuda.Event()
            done.record(compute)
            self._compute_staged.append((done, nbytes))
        else:  # past the staging budget: chunks through copy-stream memory, reused at once
            event = self._load_on_copy_stream(runs, staging, dev_idx, n, compute)
            # one copy stream: this load's event implies every earlier load is done too; every
            # layer waits for it (a slot-major run moves all layers in one copy)
            self._layer_events = [event] * self.host.num_layers
        if staging is None:
            self._direct_loads.append(event)  # (the DMAs' end: host rows read)
        else:
            self._staged_loads.append((staging, event))
        return detached_event

    def _load_on_copy_stream(self, runs, staging, dev_idx: torch.Tensor, n: int,
                             compute) -> torch.cuda.Event:
        """DMA and scatter on the copy stream, in chunks through copy-stream memory (reused at
        once); the event after the last scatter."""
        with torch.cuda.stream(self.stream):
            for lo in range(0, n, self.chunk):
                hi = min(n, lo + self.chunk)
                up = self._dma_up(runs, staging, lo, hi)
                if lo == 0:
                    # the device slots may have been freed by evictions whose readers are
                    # still queued: the scatter waits for them; the DMA above touches no
                    # slot, so it overlaps them
                    self.stream.wait_stream(compute)
                self._scatter(dev_idx[lo:hi], up)
            event = torch.cuda.Event()
            event.record(self.stream)
        dev_idx.record_stream(self.stream)
        return event

    def _dma_up(self, runs, staging, lo: int, hi: int) -> torch.Tensor:
        """Copy stream: rows [lo, hi) of a load into a new device block, from the pinned staging
        block or run by run from the host rows."""
        up = torch.empty(self.host.block_shape(hi - lo), dtype=self.host.dtype, device=self.device)
        if staging is not None:
            up.copy_(staging[lo:hi], non_blocking=True)
        else:
            for off, start, length in split_runs(runs, lo, hi):
                up[off:off + length].copy_(self.host.kv[start:start + length], non_blocking=True)
        return up

    def take_layer_events(self) -> Optional[list]:
        events, self._layer_events = self._layer_events, None
        return events

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


class LayerWaitingBackend:
    """An attention backend whose layer l first waits (on the GPU, not the host) for the event of
    the load that brought layer l's KV: handed to one forward when loads are pending (CUDA)."""

    def __init__(self, backend, events: list):
        self._backend, self._events = backend, events

    def __getattr__(self, name):
        attr = getattr(self._backend, name)
        if name not in ("forward", "forward_rows"):
            return attr

        def call(q, k, v, layer, fb, *rest):
            torch.cuda.current_stream().wait_event(self._events[layer])
            return attr(q, k, v, layer, fb, *rest)

        return call
