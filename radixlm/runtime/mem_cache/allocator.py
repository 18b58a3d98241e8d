"""Token-slot allocator for the paged KV pool (page size 1: one slot holds one token's K and V).

Slots are numbered 1..capacity; slot 0 is a scratch slot that padded positions write into, so
kernels never need a branch for padding. The free list is a tensor so alloc/free are slices and
concatenations, not Python loops over tokens.

Freed slots queue as chunks behind the head tensor and are joined only when an alloc needs them
(or `free_slots` is read): a speculative verify frees its rejected slots every step, and joining
them into a ~200k-slot list each time copied the whole list (1.5 MB) per step; on the CPU that
copy also ran a 2-thread OpenMP region, whose spinning thread then took the core from the
quantized GEMMs' helper. The order is unchanged: slots are handed out first freed, first used
after the initial ones, exactly as with one tensor.
"""

from __future__ import annotations

from typing import Optional

import torch


class TokenSlotAllocator:
    def __init__(self, capacity: int, device: str | torch.device = "cpu"):
        if capacity <= 0:
            raise ValueError(f"KV capacity must be positive (got {capacity})")
        self.capacity = capacity
        self.device = torch.device(device)
        self.clear()

    def clear(self) -> None:
        self._head = torch.arange(1, self.capacity + 1, dtype=torch.int64, device=self.device)
        self._queued: list[torch.Tensor] = []  # freed chunks, in order, after _head
        self._queued_n = 0

    @property
    def free_slots(self) -> torch.Tensor:
        """Every free slot (int64, 1-D) in the order alloc hands them out."""
        self._join()
        return self._head

    def _join(self) -> None:
        if self._queued:
            self._head = torch.cat([self._head, *self._queued])
            self._queued, self._queued_n = [], 0

    def available_size(self) -> int:
        return int(self._head.numel()) + self._queued_n

    def can_alloc(self, n: int) -> bool:
        return n <= self.available_size()

    def alloc(self, n: int) -> Optional[torch.Tensor]:
        """Return `n` free slot indices (int64, shape (n,)), or None if fewer are free."""
        if n > self.available_size():
            return None
        if n > self._head.numel():
            self._join()
        out = self._head[:n]
        self._head = self._head[n:]
        return out

    def free(self, slots: torch.Tensor, copy: bool = True) -> None:
        """`copy=False`: `slots` (int64 on this device) is never written again, e.g. a view of
        what alloc() returned (the free list is only ever replaced, not written): queued as it
        is, one device op fewer (a speculative verify frees its rejected slots every step)."""
        if slots.numel():
            # a copy: callers free views of tensors they later overwrite (req_to_token rows)
            self._queued.append(slots.to(self.device, torch.int64, copy=copy).reshape(-1))
            self._queued_n += int(slots.numel())
