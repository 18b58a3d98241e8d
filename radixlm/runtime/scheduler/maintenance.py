"""The scheduler's state operations for its owners (the Engine, the server's control messages):
flush the cache, report the counters, check the KV accounting. A mixin of `Scheduler`: it reads
the scheduler's pools, tree, queues and stats, and settles an in-flight overlapped step first."""

from __future__ import annotations

import torch


class Maintenance:
    def flush_cache(self, storage: bool = False) -> bool:
        """Drop the whole radix cache (device and host tiers; with `storage`, the store's pages
        too); only allowed when no request holds KV."""
        self._settle()
        if not self.is_idle():
            return False
        if storage and self.tiered:  # first: pending page writes are cancelled, not waited for
            self.tree_cache.clear_storage()
        self.tree_cache.reset()
        self.allocator.clear()
        self.req_pool.clear()
        return True

    def stats_snapshot(self) -> dict:
        """The stats the engine and the server report (get_stats, /metrics, /get_server_info)."""
        s = dict(self.stats, num_running=len(self.running), num_waiting=len(self.waiting),
                 kv_capacity=self.allocator.capacity, kv_free=self.allocator.available_size(),
                 kv_cached=self.tree_cache.total_size(),
                 # for leak checks (benchmarks/soak.py): locked tree tokens, free request rows
                 kv_locked=self.tree_cache.protected_size(),
                 req_slots_free=self.req_pool.available_size(), req_slots=self.req_pool.max_reqs,
                 gpu_memory_allocated=(torch.cuda.memory_allocated(self.device)
                                       if self.device.type == "cuda" else 0))
        if self.tiered:
            s["hicache"] = self.tree_cache.tier_stats()
        return s

    def check_integrity(self) -> None:
        self._settle()
        self.tree_cache.check_integrity()
        owned = 0
        holders = self.running + ([self.chunked] if self.chunked else [])
        for req in holders:
            owned += req.kv_len - self.tree_cache.tree_owned_len(req)
        if self.pd is not None:  # slots reserved for KV still on its way from a prefill server
            owned += self.pd.held_slots()
        free = self.allocator.available_size()
        tree = self.tree_cache.total_size()
        cap = self.allocator.capacity
        assert free + tree + owned == cap, (
            f"KV leak: free {free} + tree {tree} + owned by requests {owned} != capacity {cap}")
        if self.spec is not None:  # a draft model's own pool (speculative/draft_runner.py)
            self.spec.check_integrity(self)
        if self.is_idle():
            assert self.tree_cache.protected_size() == 0, "idle scheduler but locked tree nodes"
            assert self.req_pool.available_size() == self.req_pool.max_reqs, "req_pool rows leaked"
