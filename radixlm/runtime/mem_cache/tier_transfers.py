"""HiRadixCache's moves up the tiers: loads (host / storage -> device) for a scheduled request,
and the counters and rates of every tier. (Backups, device -> host, and page writes, host ->
storage, are in tier_writes.py.) A mixin: the state is HiRadixCache's.

Load of a match (`load_back`), for the request the scheduler is admitting, whose device prefix it
has locked:
  1. storage -> host: the pages covering the match's storage part are read (checked: a missing or
     bad page ends the load there; its tree nodes are dropped and its tokens recomputed), decoded
     into fresh host slots, and the storage-only nodes (or a new node for pages found past the
     tree) take them. Skipped when reading would be slower than recomputing (`_storage_pays`).
  2. host -> device: device slots for every host-resident node of the path (evicting others to
     make room), one batched copy (KVMover: synchronous on the CPU; on CUDA queued on the copy
     stream with an event per layer that the forward's layers wait on).
  The path's nodes are pinned (host_ref) throughout, so the evictions a load causes cannot take
  the copies it is moving.
"""

from __future__ import annotations

import time
from typing import Optional

import torch

from radixlm.runtime.mem_cache.storage.keys import extend_chain

EMA = 0.2  # weight of the newest sample in the rate estimates
MIN_PREFILL_SAMPLE = 32  # extends shorter than this measure overhead more than compute
KEY_MEMO_ENTRIES = 256


class TierTransfers:
    def _init_transfers(self) -> None:
        self.counters = {
            "hit_tokens_device": 0, "hit_tokens_host": 0, "hit_tokens_storage": 0,
            "bytes_device_to_host": 0, "bytes_host_to_device": 0,
            "bytes_host_to_storage": 0, "bytes_storage_to_host": 0,
            "pages_stored": 0, "pages_write_dropped": 0, "pages_loaded": 0,
            "storage_load_failures": 0, "storage_loads_skipped": 0, "device_evicted_tokens": 0, "host_evicted_tokens": 0,
            "dropped_tokens": 0,
            # seconds the scheduler's thread spent on page writes (queueing, or writing them
            # itself with write_queue_pages 0) and on applying their completions
            "storage_write_scheduler_s": 0.0}
        self._prefill_tps: Optional[float] = None  # tokens/s the forward computes (EMA)
        self._read_bps: Optional[float] = None  # bytes/s the store reads (EMA)
        self._key_memo: dict = {}  # tokens tuple -> its page keys so far (match re-runs each step)

    # --- statistics ------------------------------------------------------------------------------
    def record_hits(self, details: dict) -> None:
        for tier, n in details.items():
            self.counters["hit_tokens_" + tier] += n

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        if tokens >= MIN_PREFILL_SAMPLE and seconds > 0:
            self._prefill_tps = _ema(self._prefill_tps, tokens / seconds)

    def _storage_pays(self) -> bool:
        """Whether reading a token's KV from the store beats computing it (unknown rates: try)."""
        if self._prefill_tps is None or self._read_bps is None:
            return True
        return self.host.token_bytes / self._read_bps < 1.0 / self._prefill_tps

    def tier_stats(self) -> dict:
        """Each tier's use and the counters (finished page writes applied first: scheduler
        thread)."""
        self.apply_write_completions()
        host = self.host
        out = {"write_policy": self.write_policy,
               "device": {"capacity": self.allocator.capacity,
                          "free": self.allocator.available_size(), "cached": self.total_size()},
               "host": {"capacity": host.capacity, "free": host.allocator.available_size(),
                        "cached": self._host_tokens, "bytes_per_token": host.token_bytes},
               "storage": {"index_tokens": self._store_tokens, "page_tokens": self.page},
               "prefill_tokens_per_s": self._prefill_tps, "storage_read_bytes_per_s": self._read_bps}
        if self.storage is not None:
            out["storage"].update(self.storage.stats())
            out["storage"]["write_queue"] = self.write_queue_stats()
        out.update(self.counters)
        return out

    # --- storage lookups -------------------------------------------------------------------------
    def _keys(self, tokens: tuple, n_pages: int) -> list[bytes]:
        keys = self._key_memo.get(tokens)
        if keys is None:
            if len(self._key_memo) >= KEY_MEMO_ENTRIES:
                del self._key_memo[next(iter(self._key_memo))]
            keys = self._key_memo[tokens] = []
        return extend_chain(keys, self.seed, tokens, self.page, n_pages)

    def _storage_end(self, tokens: tuple, tree_end: int, loadable: int) -> int:
        """Absolute end of what storage can give: the tree path's end rounded down to a page, or
        past it while the store holds the following pages of `tokens`."""
        page = self.page
        j, last = tree_end // page, len(tokens) // page
        while j < last and self.storage.exists(self._keys(tokens, j + 1)[j]):
            j += 1
        return max(j * page, loadable)

    # --- loads -----------------------------------------------------------------------------------
    def load_back(self, match) -> tuple[torch.Tensor, object, dict]:
        """Bring the match's host and storage part into device slots. The caller holds the lock on
        match[1] (the device node). Returns (device slots of the whole loaded prefix, its deepest
        node, {"device": n, "host": n, "storage": n} tokens from each tier)."""
        slots, node = match[0], match[1]
        d = slots.numel()
        details = {"device": d, "host": 0, "storage": 0}
        host_nodes = [n for n in match.lower if n.host_value is not None]
        h = d + match.host_len
        s_end = h + match.storage_len
        if match.storage_len and not self._storage_pays():
            self.counters["storage_loads_skipped"] += 1
            s_end = h
        pinned = list(host_nodes)
        for n in pinned:
            n.host_ref += 1
        try:
            stored = []
            if s_end > h:
                stored = self._storage_to_host(match, h, s_end,
                                               host_nodes[-1] if host_nodes else node)
                pinned += stored
            nodes = host_nodes + stored
            if not nodes:
                return slots, node, details
            n_tok = sum(len(n.key) for n in nodes)
            dev = self._alloc_device(n_tok)
            self.mover.to_device(torch.cat([n.host_value for n in nodes]), dev)
            off = 0
            for n in nodes:  # root-down: each node's parent is on the device before it
                n.value = dev[off:off + len(n.key)]
                off += len(n.key)
                self._evictable += len(n.key)
                self._sync(n)
                self._sync(n.parent)
            self.counters["bytes_host_to_device"] += n_tok * self.host.token_bytes
            details["storage"] = sum(len(n.key) for n in stored)
            details["host"] = n_tok - details["storage"]
            return torch.cat((slots, dev)), nodes[-1], details
        finally:
            for n in pinned:
                n.host_ref -= 1

    def _alloc_device(self, n: int) -> torch.Tensor:
        if not self.allocator.can_alloc(n):
            self.evict(n - self.allocator.available_size())
        slots = self.allocator.alloc(n)
        if slots is None:  # admission budgets a load like a compute of the same tokens
            raise RuntimeError(f"KV pool exhausted loading {n} cached tokens: "
                               f"{self.allocator.available_size()} free after eviction")
        return slots

    def _alloc_host(self, n: int) -> Optional[torch.Tensor]:
        alloc = self.host.allocator
        if not alloc.can_alloc(n):
            self.evict_host(n - alloc.available_size())
        return alloc.alloc(n)

    def _storage_to_host(self, match, h: int, s_end: int, parent) -> list:
        """Read positions [h, s_end) (s_end page-aligned) of the match from the store into host
        copies; returns the nodes now holding them, path order, pinned by the caller's host_ref."""
        page, tokens = self.page, match.tokens
        first = h // page
        keys = self._keys(tokens, s_end // page)[first:]
        t0 = time.perf_counter()
        payloads = self.storage.batch_get(keys)
        if payloads:
            self._read_bps = _ema(self._read_bps, len(payloads) * self.storage.page_bytes
                                  / max(time.perf_counter() - t0, 1e-6))
        got = min(s_end, (first + len(payloads)) * page)
        tree_nodes = [n for n in match.lower if n.host_value is None]
        tree_end = tree_nodes[-1].start + len(tree_nodes[-1].key) if tree_nodes else h
        failed = len(payloads) < len(keys)
        self.counters["storage_load_failures"] += failed
        nodes = []
        for n in tree_nodes:  # the storage-only nodes under `got`; the one across it is split
            if n.start < got < n.start + len(n.key):
                nodes.append(self._split(n, got - n.start))  # n is now the part from `got` on
            elif n.start < got:
                nodes.append(n)
                continue
            if failed:  # the page at `got` is gone or bad: forget what the tree said lies there
                self._drop_subtree(n)
            break
        if got > tree_end:  # pages past the tree's path: a new node under its deepest node
            last = nodes[-1] if nodes else parent
            leaf = type(self.root)(tokens[tree_end:got], None, last, tree_end)
            leaf.storage_len, leaf.last_access = got - tree_end, self._clock
            last.children[leaf.key[0]] = leaf
            self._store_tokens += len(leaf.key)
            self._sync(leaf)
            self._sync(last)
            nodes.append(leaf)
        if not nodes:
            return []
        for n in nodes:
            n.host_ref += 1  # the host allocation below may evict host copies
        try:
            host_slots = self._alloc_host(got - h)
        finally:
            for n in nodes:
                n.host_ref -= 1
        if host_slots is None:  # every host copy is pinned: recompute instead
            return []
        block = _decode_pages(payloads, self.host.block_shape(page), self.host.dtype)
        self.mover.write_host(host_slots, block[:, :, h - first * page:got - first * page])
        off = 0
        for n in nodes:
            n.host_value = host_slots[off:off + len(n.key)]
            off += len(n.key)
            self._store_tokens -= len(n.key)
            self._host_tokens += len(n.key)
            n.host_ref += 1  # released by load_back
            self._sync(n)
            self._sync(n.parent)
        self.counters["pages_loaded"] += len(payloads)
        self.counters["bytes_storage_to_host"] += len(payloads) * self.storage.page_bytes
        return nodes

    def take_load_events(self) -> Optional[list]:
        """CUDA: the per-layer events of this round's loads, for the next forward to wait on."""
        return self.mover.take_layer_events()


def _ema(old: Optional[float], new: float) -> float:
    return new if old is None else (1 - EMA) * old + EMA * new


def _decode_pages(payloads: list[bytes], page_shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    """Pages (each (L, 2, P, H, D) bytes) -> one (L, 2, n*P, H, D) tensor."""
    buf = bytearray(b"".join(payloads))
    pages = torch.frombuffer(buf, dtype=torch.uint8).view(dtype)
    pages = pages.view((len(payloads),) + tuple(page_shape))  # (n, L, 2, P, H, D)
    return pages.permute(1, 2, 0, 3, 4, 5).flatten(2, 3)
