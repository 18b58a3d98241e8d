"""L2: the host-memory KV pool, and the copies between it and the device pool (L1).

`HostKVPool.kv` is (layers, 2 [K, V], capacity + 1, KV heads, head dim) in the device pool's dtype,
indexed by host slot (slot 0 unused, as on the device); its slots come from its own
`TokenSlotAllocator`. Layer-major, so one layer's K and V of a run of slots gather into one
contiguous (2, n, H, D) block: the unit a per-layer copy moves. On the CPU it is a second RAM pool
(lazily mapped, like the device pool); on CUDA it is pinned, so copies are DMA.

`KVMover` does the copies:
- CPU: synchronous index copies (the forward runs after them on the same thread).
- CUDA: on its own stream. A load (host -> device) gathers the host rows into a pinned staging
  block, then per layer copies it up and scatters it into the device slots, recording one event per
  layer; the next forward's attention waits, at each layer, for that layer's event only
  (`LayerWaitingBackend`), so layer l's load overlaps layers < l of the forward. A backup
  (device -> host) gathers on the copy stream into pinned staging after the compute stream's
  pending work; it lands in the host rows when `complete()` runs (before any host read or write),
  and the compute stream waits for it before a freed device slot can be written again
  (`guard_device_reuse`).
"""

from __future__ import annotations

from collections import deque
from typing import Optional

import torch

from radixlm.runtime.mem_cache.allocator import TokenSlotAllocator
from radixlm.runtime.mem_cache.kv_pool import KVPool, zeros_lazy


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

    def guard_device_reuse(self) -> None:
        """Before freeing device slots: later compute-stream writes wait for backups reading them."""
        if self.cuda and self._last_backup is not None:
            torch.cuda.current_stream(self.device).wait_event(self._last_backup)

    def complete(self) -> None:
        """Land finished backups in the host rows; call before reading or writing host rows."""
        while self._backups:
            staging, host_idx, event = self._backups.popleft()
            event.synchronize()
            self.host.kv.index_copy_(2, host_idx, staging)
        while self._staged_loads and self._staged_loads[0][1].query():
            self._staged_loads.popleft()

    # --- host -> device ------------------------------------------------------------------------
    def to_device(self, host_idx: torch.Tensor, dev_idx: torch.Tensor) -> None:
        """Copy host slots host_idx (n,) into device slots dev_idx (n,). On CUDA asynchronous: the
        next forward must be handed `take_layer_events()`."""
        self.complete()
        if not self.cuda:
            kv = self.host.kv
            for layer in range(self.host.num_layers):
                self.dev.k_buffers[layer].index_copy_(0, dev_idx, kv[layer, 0].index_select(0, host_idx))
                self.dev.v_buffers[layer].index_copy_(0, dev_idx, kv[layer, 1].index_select(0, host_idx))
            return
        staging = torch.empty(self.host.block_shape(host_idx.numel()), dtype=self.host.dtype,
                              pin_memory=True)
        torch.index_select(self.host.kv, 2, host_idx, out=staging)  # (L, 2, n, H, D)
        # the slots may have been freed by evictions whose readers are still queued
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
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
