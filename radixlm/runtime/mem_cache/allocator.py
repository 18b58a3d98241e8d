"""Token-slot allocator for the paged KV pool (page size 1: one slot holds one token's K and V).

Slots are numbered 1..capacity; slot 0 is a scratch slot that padded positions write into, so
kernels never need a branch for padding. The free list is a tensor so alloc/free are slices and
concatenations, not Python loops over tokens.
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
        self.free_slots = torch.arange(1, self.capacity + 1, dtype=torch.int64, device=self.device)

    def available_size(self) -> int:
        return int(self.free_slots.numel())

    def can_alloc(self, n: int) -> bool:
        return n <= self.free_slots.numel()

    def alloc(self, n: int) -> Optional[torch.Tensor]:
        """Return `n` free slot indices (int64, shape (n,)), or None if fewer are free."""
        if n > self.free_slots.numel():
            return None
        out = self.free_slots[:n]
        self.free_slots = self.free_slots[n:]
        return out

    def free(self, slots: torch.Tensor) -> None:
        if slots.numel():
            self.free_slots = torch.cat((self.free_slots, slots.to(self.device, torch.int64)))
