"""L2: the host-memory KV pool, and the copies between it and the device pool (L1).

`HostKVPool.kv` is (layers, 2 [K, V], capacity + 1, KV heads, head dim) in the device pool's dtype,
indexed by host slot (slot 0 unused, as on the device); its slots come from its own
`TokenSlotAllocator`. Layer-major, so one layer's K and V of a run of slots gather into one
contiguous (2, n, H, D) block: the unit a per-layer copy moves. On the CPU it is a second RAM pool
(lazily mapped, like the device pool); on CUDA it is pinned, so copies are DMA.

`KVMover` does the copies:
- CPU: synchronous index copies (the forward runs after them on the same thread).
- CUDA: on its own stream. A load (host -> device) copies each run of consecutive host slots up
  by DMA from the pinned pool (a scattered load gathers the rows into a pinned staging block
  first) and scatters it into the device slots, recording one event per layer; the next forward's
  attention waits, at each layer, for that layer's event only (`LayerWaitingBackend`), so layer
  l's load overlaps layers < l of the forward. A backup (device -> host) gathers on the copy
  stream after the compute stream's pending work and copies each run straight into the host rows
  (a scattered one into pinned staging, landed in the rows by `complete()`); `complete()` runs
  before any host read or write and waits for the copies in flight, and the compute stream waits
  for a backup before a freed device slot can be written again (`guard_device_reuse`). Loads and
  backups share the one copy stream, so a backup into slots that a queued load still reads
  runs after it.
"""

from __future__ import annotations

from collections import deque
from typing import Optional

import torch

from radixlm.runtime.mem_cache.allocator import TokenSlotAllocator
from radixlm.runtime.mem_cache.kv_pool import KVPool, zeros_lazy


# A copy whose host slots form at most this many runs of consecutive slots moves each run by DMA
# straight from / to the pinned pool (2 x layers x runs copies); a more scattered one goes through
# a pinned staging block gathered on the CPU. The host allocator hands out and frees whole nodes'
# slots, so runs are long: a 5k-token load of an 8B model is 640 MB, ~0.1 s of CPU gather.
MAX_DIRECT_RUNS = 8
# ... or more runs when they average at least this many tokens: a run costs 2 x layers DMA calls
# (~4 us each to issue), gathering costs every byte once more on the scheduler's thread (an 8B
# model's token is 128 KiB: 16 tokens ~0.3 ms at 8 GB/s). Multi-turn chats come back in one run
# per turn and answer; with the 8-run limit their loads were gathered on the CPU, and an H200
# host loaded 196 GB in a 53 s run at ~7 GB/s (1.23x over recomputing everything).
MIN_RUN_TOKENS = 16


def direct_runs(idx: torch.Tensor) -> Optional[list[tuple[int, int, int]]]:
    """idx's runs (contiguous_runs) when a copy of them by DMA beats gathering them first."""
    return contiguous_runs(idx, max(MAX_DIRECT_RUNS, idx.numel() // MIN_RUN_TOKENS))


def contiguous_runs(idx: torch.Tensor, max_runs: int) -> Optional[list[tuple[int, int, int]]]:
    """idx (n,) host slots as runs of consecutive slots: [(offset in idx, first slot, length)],
    or None when there are more than max_runs."""
    n = idx.numel()
    if n == 0:
        return []
    starts = (torch.nonzero(idx[1:] - idx[:-1] != 1).flatten() + 1).tolist()
    if len(starts) + 1 > max_runs:
        return None
    starts = [0] + starts
    firsts = idx[starts].tolist()
    return [(a, first, b - a) for a, b, first in zip(starts, starts[1:] + [n], firsts)]


class HostKVPool:
    def __init__(self, capacity: int, device_pool: KVPool, device: torch.device):
        heads, head_dim = device_pool.k_buffers[0].shape[1:]
        self.num_layers = device_pool.num_layers
        self.dtype = device_pool.dtype
        self.capacity = capacity
        self.pinned = device.type == "cuda"
        shape = (self.num_layers, 2, capacity + 1, heads, head_dim)
        self.kv = (torch.empty(shape, dtype=self.dtype, pin_memory=True) if self.pinned
                   else zeros_lazy(shape, self.dtype, "cpu"))
        self.allocator = TokenSlotAllocator(capacity, "cpu")
        self.token_bytes = KVPool.bytes_per_token(self.num_layers, heads, head_dim, self.dtype)

    def block_shape(self, n: int) -> tuple[int, ...]:
        """Shape of n tokens' KV gathered out of the pool: (layers, 2, n, H, D)."""
        return (self.num_layers, 2, n) + tuple(self.kv.shape[3:])


class KVMover:
    def __init__(self, device_pool: KVPool, host: HostKVPool, device: torch.device):
        self.dev, self.host, self.device = device_pool, host, device
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self._backups: deque = deque()  # (pinned staging, host slots, event), in issue order
        self._staged_loads: deque = deque()  # (pinned staging, last event): alive until copied
        self._direct_loads: deque = deque()  # last events of loads that read the host rows
        self._last_backup = None
        self._layer_events: Optional[list] = None

    # --- device -> host ------------------------------------------------------------------------
    def to_host(self, dev_idx: torch.Tensor, host_idx: torch.Tensor) -> None:
        """Copy the KV at device slots dev_idx (n,) into host slots host_idx (n,)."""
        kv = self.host.kv
        if not self.cuda:
            for layer in range(self.host.num_layers):
                kv[layer, 0].index_copy_(0, host_idx, self.dev.k_buffers[layer].index_select(0, dev_idx))
                kv[layer, 1].index_copy_(0, host_idx, self.dev.v_buffers[layer].index_select(0, dev_idx))
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # the KV's forwards first
        runs = direct_runs(host_idx)
        if runs is not None:  # straight into the pinned host rows: no staging, no CPU copy
            with torch.cuda.stream(self.stream):
                for layer in range(self.host.num_layers):
                    for i, buf in ((0, self.dev.k_buffers[layer]), (1, self.dev.v_buffers[layer])):
                        rows = buf.index_select(0, dev_idx)  # (n, H, D)
                        for off, start, length in runs:
                            kv[layer, i, start:start + length].copy_(rows[off:off + length],
                                                                     non_blocking=True)
                event = torch.cuda.Event()
                event.record(self.stream)
            dev_idx.record_stream(self.stream)
            self._backups.append((None, None, event))
            self._last_backup = event
            return
        staging = torch.empty(self.host.block_shape(host_idx.numel()), dtype=kv.dtype,
                              pin_memory=True)
        with torch.cuda.stream(self.stream):
            for layer in range(self.host.num_layers):
                staging[layer, 0].copy_(self.dev.k_buffers[layer].index_select(0, dev_idx),
                                        non_blocking=True)
                staging[layer, 1].copy_(self.dev.v_buffers[layer].index_select(0, dev_idx),
                                        non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        dev_idx.record_stream(self.stream)
        self._backups.append((staging, host_idx, event))
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
                self.host.kv.index_copy_(2, host_idx, staging)
        while self._staged_loads and self._staged_loads[0][1].query():
            self._staged_loads.popleft()

    # --- host -> device ------------------------------------------------------------------------
    def to_device(self, host_idx: torch.Tensor, dev_idx: torch.Tensor) -> None:
        """Copy host slots host_idx (n,) into device slots dev_idx (n,). On CUDA asynchronous: the
        next forward must be handed `take_layer_events()`."""
        if not self.cuda or any(staging is not None for staging, _, _ in self._backups):
            self.complete()  # a gathered backup lands in its host rows on the CPU: first
        while self._staged_loads and self._staged_loads[0][1].query():
            self._staged_loads.popleft()
        # (not waiting for earlier loads: this one only reads host rows, and the one copy stream
        # orders it after them and after the direct backups, which DMA into the rows themselves)
        if not self.cuda:
            kv = self.host.kv
            for layer in range(self.host.num_layers):
                self.dev.k_buffers[layer].index_copy_(0, dev_idx, kv[layer, 0].index_select(0, host_idx))
                self.dev.v_buffers[layer].index_copy_(0, dev_idx, kv[layer, 1].index_select(0, host_idx))
            return
        # the slots may have been freed by evictions whose readers are still queued
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        runs = direct_runs(host_idx)
        if runs is not None:  # DMA from the pinned host rows themselves: no CPU gather
            kv, events, n = self.host.kv, [], host_idx.numel()
            with torch.cuda.stream(self.stream):
                for layer in range(self.host.num_layers):
                    for i, buf in ((0, self.dev.k_buffers[layer]), (1, self.dev.v_buffers[layer])):
                        # each run's rows DMA'd into one device block (n, H, D), scattered
                        # into the slots by one index_copy (allocated on the copy stream)
                        up = torch.empty((n, *buf.shape[1:]), dtype=buf.dtype, device=self.device)
                        for off, start, length in runs:
                            up[off:off + length].copy_(kv[layer, i, start:start + length],
                                                       non_blocking=True)
                        buf.index_copy_(0, dev_idx, up)
                    events.append(torch.cuda.Event())
                    events[-1].record(self.stream)
            dev_idx.record_stream(self.stream)
            self._direct_loads.append(events[-1])
            self._layer_events = events
            return
        staging = torch.empty(self.host.block_shape(host_idx.numel()), dtype=self.host.dtype,
                              pin_memory=True)
        torch.index_select(self.host.kv, 2, host_idx, out=staging)  # (L, 2, n, H, D)
        events = []
        with torch.cuda.stream(self.stream):
            for layer in range(self.host.num_layers):
                block = staging[layer].to(self.device, non_blocking=True)  # (2, n, H, D)
                self.dev.k_buffers[layer].index_copy_(0, dev_idx, block[0])
                self.dev.v_buffers[layer].index_copy_(0, dev_idx, block[1])
                events.append(torch.cuda.Event())
                events[-1].record(self.stream)
        dev_idx.record_stream(self.stream)
        self._staged_loads.append((staging, events[-1]))
        # one copy stream: the last load's event l implies every earlier load is done too
        self._layer_events = events

    def take_layer_events(self) -> Optional[list]:
        events, self._layer_events = self._layer_events, None
        return events

    # --- host rows for storage -------------------------------------------------------------------
    def read_host(self, host_idx: torch.Tensor) -> torch.Tensor:
        """(L, 2, n, H, D) copy of host slots host_idx."""
        self.complete()
        return self.host.kv.index_select(2, host_idx)

    def write_host(self, host_idx: torch.Tensor, block: torch.Tensor) -> None:
        """block (L, 2, n, H, D) -> host slots host_idx."""
        self.complete()
        self.host.kv.index_copy_(2, host_idx, block)

    def read_device(self, dev_idx: torch.Tensor) -> torch.Tensor:
        """(L, 2, n, H, D) host copy of device slots dev_idx (synchronous)."""
        k = torch.stack([b.index_select(0, dev_idx) for b in self.dev.k_buffers])
        v = torch.stack([b.index_select(0, dev_idx) for b in self.dev.v_buffers])
        return torch.stack((k, v), dim=1).cpu()


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
