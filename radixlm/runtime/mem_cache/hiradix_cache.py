"""The hierarchical radix cache: one radix tree whose nodes keep their KV in up to three tiers.

A node (TierNode, page size 1) records where its tokens' KV lives:
    value        device slots (int64 (L,)), or None when not on the device   (L1, the KV pool)
    host_value   host slots (int64 (L,)), or None                            (L2, HostKVPool)
    storage_len  how many leading tokens lie in pages the store holds        (L3, storage/)
    start        absolute position of key[0] (storage pages are aligned to absolute positions)
A node is in the tree while at least one tier holds all of it (storage: storage_len == len(key));
the tree is dropped node by node only when none does.

Shape invariants (check_integrity asserts each):
- Device-resident nodes form a subtree containing the root (a node on the device has its parent on
  the device): attention reads a request's prefix as one run of device slots, and `evict` takes
  device leaves only. Below it, host-resident nodes extend that subtree (device or host => parent
  device or host), and storage-only nodes hang below those. Every path reads D* H* S*.
- Storage coverage is per node and need not be a prefix of the path: pages are found by content
  key, so a page can outlive (or be written without) the pages before it (a corrupt page is
  deleted; a later one of the same path stays).
- Locks: `lock_ref` (a request's path lock, as in RadixCache) only on device nodes; `host_ref`
  (a transfer in progress) pins a node's host copy. Neither kind is evicted.
Accounting per tier, each slot in exactly one place:
    device: allocator free + device tokens in the tree + request-owned == device capacity
    host:   host allocator free + host tokens in the tree + held back == host capacity
            (held back: slots the tree let go of while a pending page write still reads them,
             and slots a storage prefetch holds until its request is admitted or cancelled)

Eviction moves KV down a tier, LRU first (one clock; a separate candidate set per tier):
- `evict` (device): device leaves -> their host copy stays (a node without one is backed up first:
  write_back, or host full at insert time); the node stays in the tree.
- `evict_host`: host-only leaves -> storage-only when the store holds them (a partly stored leaf
  keeps its stored head), else dropped.
- storage-only leaves are dropped (LRU) past `store_index_tokens`; their pages stay on disk and a
  later match finds them again by key.
Write policy (SGLang's): write_through backs every inserted node up to the host at once,
write_through_selective once a node is hit a second time, write_back only when evicted. Every
host backup queues the path's completed pages for the store (when one is configured); a node
records them (storage_len) once the store has confirmed them (tier_writes.py, page_writer.py).
Loads (host -> device) are in tier_transfers.py; storage reaches the host only through the
prefetch of a waiting request's pages (tier_prefetch.py, page_reader.py), which hands what landed
to the tree as host nodes when the request is admitted.
"""

from __future__ import annotations

import heapq
from typing import Optional

import torch

from radixlm.runtime.mem_cache.radix_cache import RadixCache
from radixlm.runtime.mem_cache.node_logprobs import TokenLogprobs, merge_logprobs, split_logprobs
from radixlm.runtime.mem_cache.tier_integrity import check_tiered_tree
from radixlm.runtime.mem_cache.tier_nodes import TierMatch, TierNode, lru_heap, store_only
from radixlm.runtime.mem_cache.tier_prefetch import TierPrefetch
from radixlm.runtime.mem_cache.tier_transfers import TierTransfers
from radixlm.runtime.mem_cache.tier_writes import TierWrites

WRITE_THRESHOLDS = {"write_through": 1, "write_through_selective": 2, "write_back": None}
class HiRadixCache(TierTransfers, TierWrites, TierPrefetch, RadixCache):
    def __init__(self, allocator, req_to_token_pool, host, mover, write_policy="write_through",
                 storage=None, seed: bytes = b"", page_tokens: int = 64,
                 store_index_tokens: Optional[int] = None,
                 write_queue_pages: Optional[int] = None, prefetch: Optional[dict] = None):
        """write_queue_pages: bound of the page-write queue (None: tier_writes' default; 0: write
        on the scheduler's thread). prefetch: TierPrefetch._init_prefetch's keywords (policy,
        threshold, timeout_base, timeout_per_ki_token, queue_pages, threaded)."""
        self.host, self.mover = host, mover  # before RadixCache.__init__, whose reset() uses host
        self.write_threshold = WRITE_THRESHOLDS[write_policy]
        self.write_policy = write_policy
        self.storage, self.seed, self.page = storage, seed, page_tokens
        # storage-only tokens the tree keeps as an index (past them: found again by key lookups)
        self.store_index_tokens = store_index_tokens or 4 * (allocator.capacity + host.capacity)
        self.tiered = True
        self._init_transfers()
        self._init_writes(write_queue_pages)
        self._init_prefetch(**(prefetch or {}))
        super().__init__(allocator, req_to_token_pool)
        if self.split_heads:  # the first requests' split needs the store's read rate
            self.probe_read_rate()

    def reset(self) -> None:
        """Drop the tree and every host copy (the caller clears the device allocator); pending
        page writes finish first (their pages stay in the store), prefetches are cancelled."""
        self.finish_writes()
        self.drain_prefetch()
        self.mover.complete(loads=True)
        self.root = TierNode(value=self._empty())
        self.root.host_value = torch.empty(0, dtype=torch.int64)
        self._evictable = self._protected = 0
        self._host_tokens = 0  # tokens with a host copy
        self._store_tokens = 0  # tokens of storage-only nodes
        self._leaves = set()  # RadixCache's; unused here (the three sets below replace it)
        self._dev_leaves: set[TierNode] = set()  # on the device, no child on the device
        self._host_leaves: set[TierNode] = set()  # host only, no child on the device or host
        self._store_leaves: set[TierNode] = set()  # storage only, no children
        self.host.allocator.clear()

    def host_size(self) -> int:
        return self._host_tokens

    def store_index_size(self) -> int:
        return self._store_tokens

    # --- lookup / insert -------------------------------------------------------------------------
    def match_prefix(self, token_ids: list[int]) -> TierMatch:
        if not token_ids:
            return TierMatch(self._empty(), self.root)
        tokens = tuple(token_ids)
        tick = self._tick()
        node, pos, values, dev_node, lower = self.root, 0, [], self.root, []
        while pos < len(tokens):
            child = self._descend(node, tokens, pos, tick)
            if child is None:
                break
            if child.value is not None:  # device nodes come first on any path (D* H* S*)
                values.append(child.value)
                dev_node = child
            else:
                lower.append(child)
            node, pos = child, pos + len(child.key)
        slots = torch.cat(values) if values else self._empty()
        host_len = sum(len(c.key) for c in lower if c.host_value is not None)
        return TierMatch(slots, dev_node, lower, tokens, host_len,
                         sum(len(c.key) for c in lower if c.host_value is None))

    def insert(self, token_ids: list[int], slots: torch.Tensor,
               logprobs: Optional[TokenLogprobs] = None) -> int:
        """RadixCache.insert's contract: returns the length of the prefix whose device slots the tree
        already had (the caller still owns slots[:returned]); the tree takes slots[returned:]. A node
        on the path that is off the device takes the caller's slots for its tokens (the caller just
        computed them there), so the device part of the path stays one run from the root."""
        assert slots.numel() == len(token_ids), (slots.numel(), len(token_ids))
        tokens = tuple(token_ids)
        tick = self._tick()
        node, pos, kept, path = self.root, 0, None, []
        while pos < len(tokens):
            child = self._descend(node, tokens, pos, tick)
            if child is None:
                leaf = TierNode(tokens[pos:], slots[pos:].clone(), node, pos)
                leaf.last_access, leaf.hit_count = tick, 1
                merge_logprobs(leaf, None if logprobs is None else logprobs[pos:])
                node.children[tokens[pos]] = leaf
                self._evictable += len(leaf.key)
                self._sync(leaf)
                self._sync(node)
                path.append(leaf)
                kept = pos if kept is None else kept
                pos = len(tokens)
                break
            n = len(child.key)
            child.hit_count += 1
            if logprobs is not None:
                merge_logprobs(child, logprobs[pos:pos + n])
            if child.value is None:
                kept = pos if kept is None else kept
                if store_only(child):
                    self._store_tokens -= n
                child.value = slots[pos:pos + n].clone()
                self._evictable += n
                self._sync(child)
                self._sync(node)
            path.append(child)
            node, pos = child, pos + n
        self._apply_write_policy(path)
        self._trim_store_index()
        return pos if kept is None else kept

    def _apply_write_policy(self, path: list[TierNode]) -> None:
        if self.write_threshold is None:
            return
        for node in path:  # root-down, so a path's pages reach the store in order
            if node.host_value is None and node.hit_count >= self.write_threshold:
                if not self._backup(node):
                    return  # host full of pinned copies: the rest go at eviction

    # --- eviction --------------------------------------------------------------------------------
    def evict(self, num_tokens: int) -> int:
        """Free >= num_tokens device slots (fewer only if nothing unlocked is left) by moving
        unlocked device leaves, LRU first, down to the host. Returns the slots freed."""
        if num_tokens <= 0:
            return 0
        heap = lru_heap(self._dev_leaves, "lock_ref")
        freed, values, backups = 0, [], []
        while freed < num_tokens and heap:
            node = heapq.heappop(heap)[2]
            if node not in self._dev_leaves or node.lock_ref:
                continue  # changed since pushed (a demotion's host eviction can drop nodes)
            parent, n = node.parent, len(node.key)
            if node.host_value is None and not self._backup(node):
                self._drop_subtree(node)  # no room below the device: the KV goes
                self.counters["dropped_tokens"] += n
            else:
                values.append(node.value)
                backups.append(node.backup)
                node.value, node.backup = None, None
                self._evictable -= n
                self._sync(node)
                self._sync(parent)
            freed += n
            if parent in self._dev_leaves and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, parent.id, parent))
        if values:
            self.mover.guard_device_reuse(backups)
            self.allocator.free(torch.cat(values))
        self.counters["device_evicted_tokens"] += freed
        return freed

    def evict_host(self, num_tokens: int) -> int:
        """Free >= num_tokens host slots (fewer if nothing unpinned is left) from host-only leaves,
        LRU first: a stored node stays as storage-only, a partly stored one keeps its stored head,
        the rest are dropped."""
        heap = lru_heap(self._host_leaves, "host_ref")
        freed, slots = 0, []
        while freed < num_tokens and heap:
            node = heapq.heappop(heap)[2]
            if node not in self._host_leaves or node.host_ref:
                continue
            parent, n = node.parent, len(node.key)
            slots.append(node.host_value)
            node.host_value = None
            self._host_tokens -= n
            freed += n
            if node.storage_len == n:
                self._store_tokens += n
                self._sync(node)
            else:
                kept = node.storage_len
                if kept:  # keep the stored head as storage-only, drop the unstored tail
                    self._split(node, kept)
                    self._store_tokens += kept
                # (with any storage-only children: pages of theirs stay on disk, found by key)
                self._drop_subtree(node)
                self.counters["dropped_tokens"] += n - kept
            self._sync(parent)
            if parent in self._host_leaves and parent.host_ref == 0:
                heapq.heappush(heap, (parent.last_access, parent.id, parent))
        if slots:
            self._free_host(torch.cat(slots))
        self.counters["host_evicted_tokens"] += freed
        return freed

    def _trim_store_index(self) -> None:
        if self._store_tokens <= self.store_index_tokens:
            return
        heap = lru_heap(self._store_leaves, "host_ref")
        while self._store_tokens > self.store_index_tokens and heap:
            node = heapq.heappop(heap)[2]
            if node not in self._store_leaves or node.host_ref:
                continue
            parent = node.parent
            self._drop_subtree(node)
            if parent in self._store_leaves:
                heapq.heappush(heap, (parent.last_access, parent.id, parent))

    def _drop_subtree(self, node: TierNode) -> None:
        """Remove node and everything below it from the tree, freeing their slots in every tier."""
        parent = node.parent
        del parent.children[node.key[0]]
        stack, dev, host, backups = [node], [], [], []
        while stack:
            x = stack.pop()
            stack.extend(x.children.values())
            n = len(x.key)
            if x.value is not None:
                assert x.lock_ref == 0 and x.host_ref == 0, f"dropping locked {x}"
                dev.append(x.value)
                backups.append(x.backup)
                self._evictable -= n
            if x.host_value is not None:
                host.append(x.host_value)
                self._host_tokens -= n
            elif store_only(x):
                self._store_tokens -= n
            for leaves in (self._dev_leaves, self._host_leaves, self._store_leaves):
                leaves.discard(x)
            x.parent, x.children = None, {}  # detached: a stale reference cannot lock it
        self._sync(parent)
        if dev:
            self.mover.guard_device_reuse(backups)
            self.allocator.free(torch.cat(dev))
        if host:
            self._free_host(torch.cat(host))

    # --- tree surgery ----------------------------------------------------------------------------
    def _sync(self, node: TierNode) -> None:
        """Recompute node's membership in the three leaf sets (a function of its tiers and its
        children's): call for a node and its parent after either changes."""
        if node is self.root or node.parent is None:
            return
        kids = node.children.values()
        on_dev = node.value is not None
        is_dev = on_dev and not any(c.value is not None for c in kids)
        is_host = (not on_dev and node.host_value is not None
                   and not any(c.value is not None or c.host_value is not None for c in kids))
        is_store = store_only(node) and not node.children
        for leaves, member in ((self._dev_leaves, is_dev), (self._host_leaves, is_host),
                               (self._store_leaves, is_store)):
            if member:
                leaves.add(node)
            else:
                leaves.discard(node)

    def _split(self, node: TierNode, n: int) -> TierNode:
        """Cut node after its first n tokens; return the new upper node. Both halves keep the node's
        tiers, locks and clock, so no size or leaf set changes but the upper's own (a leaf of none:
        its one child holds the same tiers)."""
        upper = TierNode(node.key[:n], None if node.value is None else node.value[:n],
                         node.parent, node.start)
        if node.host_value is not None:
            upper.host_value, node.host_value = node.host_value[:n], node.host_value[n:]
        if node.value is not None:
            node.value = node.value[n:]
        split_logprobs(upper, node, n)
        upper.storage_len = min(node.storage_len, n)
        node.storage_len = max(node.storage_len - n, 0)
        upper.lock_ref, upper.host_ref = node.lock_ref, node.host_ref
        upper.loading, upper.backup = node.loading, node.backup
        upper.last_access, upper.hit_count = node.last_access, node.hit_count
        upper.children[node.key[n]] = node
        node.parent.children[node.key[0]] = upper
        node.key, node.parent, node.start = node.key[n:], upper, node.start + n
        self._sync(upper)
        return upper

    # --- debugging -------------------------------------------------------------------------------
    def check_integrity(self) -> None:
        check_tiered_tree(self)

    def pretty_print(self) -> str:
        lines = []

        def walk(node, depth):
            for child in node.children.values():
                lines.append(f"{'  ' * depth}{list(child.key)} {child!r}")
                walk(child, depth + 1)

        walk(self.root, 0)
        text = "\n".join(lines) + (f"\n#device={self.total_size()} host={self._host_tokens} "
                                   f"storage-only={self._store_tokens}")
        print(text)
        return text
