"""The tiered tree's pieces for hiradix_cache.py: its node (`TierNode`: device KV, host slots,
stored pages), a match over the tiers (`TierMatch`, with the weights the scheduler's cache-aware
order gives a host or storage hit) and two helpers of eviction (`lru_heap`, `store_only`)."""

from __future__ import annotations

import heapq
from typing import Optional

import torch

from radixlm.runtime.mem_cache.radix_cache import TreeNode

# the scheduler's cache-aware order counts a host or storage hit as a fraction of a device hit:
# cheaper than computing the token, dearer than finding it on the device
HOST_HIT_WEIGHT = 0.5
STORAGE_HIT_WEIGHT = 0.25


class TierNode(TreeNode):
    __slots__ = ("host_value", "storage_len", "start", "hit_count", "host_ref", "loading",
                 "backup")

    def __init__(self, key: tuple = (), value: Optional[torch.Tensor] = None, parent=None,
                 start: int = 0):
        super().__init__(key, None, parent)
        self.value = value  # None: not on the device (TreeNode's default would be empty)
        self.host_value: Optional[torch.Tensor] = None
        self.storage_len = 0
        self.start = start
        self.hit_count = 0
        self.host_ref = 0
        # CUDA: the event of a preload (tier_transfers.preload_back) still writing `value`; no
        # forward may read the node before it has completed (None: nothing in flight)
        self.loading = None
        # CUDA: the event of the backup that copied `value` to `host_value` (KVMover.to_host):
        # the device slots are read until it completes (None: nothing in flight)
        self.backup = None

    def __repr__(self) -> str:
        tiers = "D" * (self.value is not None) + "H" * (self.host_value is not None)
        return (f"TierNode(id={self.id}, start={self.start}, len={len(self.key)}, {tiers or '-'}"
                f" stored={self.storage_len}, lock={self.lock_ref}/{self.host_ref})")


def lru_heap(leaves: set, lock: str) -> list:
    """Eviction candidates: the leaves not locked by `lock` (an attribute), least recent first."""
    heap = [(n.last_access, n.id, n) for n in leaves if not getattr(n, lock)]
    heapq.heapify(heap)
    return heap


def store_only(node: TierNode) -> bool:
    return node.value is None and node.host_value is None and node.storage_len == len(node.key)


class TierMatch(tuple):
    """What `HiRadixCache.match_prefix` returns: the pair RadixCache returns (the device slots of
    the matched prefix, the deepest device node), plus what lies below the device: `lower`, the
    path's host and storage-only nodes in order; `host_len` tokens loadable from the host, then
    `storage_len` tokens the tree knows to be in the store (storage-only nodes: no I/O here)."""

    def __new__(cls, slots, node, lower=(), tokens=(), host_len=0, storage_len=0):
        self = super().__new__(cls, (slots, node))
        self.lower, self.tokens = list(lower), tokens
        self.host_len, self.storage_len = host_len, storage_len
        return self

    @property
    def lower_len(self) -> int:
        """Tokens `load_back` brings to the device (storage comes through the prefetch)."""
        return self.host_len

    @property
    def lower_score(self) -> float:
        return HOST_HIT_WEIGHT * self.host_len + STORAGE_HIT_WEIGHT * self.storage_len

    def prefetch_score(self, op) -> float:
        """What a request's prefetch adds to lower_score: its landed pages past the host part
        count as host hits, the pages its lookup found past the tree's as storage hits."""
        if op is None or op.cancelled:
            return 0.0
        d = len(self[0])
        h, s = d + self.host_len, d + self.host_len + self.storage_len
        host_end = max(h, op.landed_end)
        store_end = max(s, op.found_end, host_end)
        return (HOST_HIT_WEIGHT * (host_end - d) + STORAGE_HIT_WEIGHT * (store_end - host_end)
                - self.lower_score)
