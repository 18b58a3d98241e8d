"""HiRadixCache.check_integrity: walk the whole tree and assert the invariants of
hiradix_cache.py's docstring (shape per path, locks, per-tier sizes and slot ownership). Holds
with page writes and storage prefetches in flight: the host slots they hold count as neither free
nor in the tree."""

from __future__ import annotations

import torch

from radixlm.runtime.mem_cache.node_logprobs import check_node_logprobs


def _fail(msg: str) -> None:
    raise AssertionError(msg)


def _check_node(cache, node, parent) -> None:
    n = len(node.key)
    if not n:
        _fail(f"{node}: empty key")
    for name, slots in (("device", node.value), ("host", node.host_value)):
        if slots is not None and slots.numel() != n:
            _fail(f"{node}: {name} slots for {slots.numel()} of {n} tokens")
    on_dev, on_host = node.value is not None, node.host_value is not None
    if not (on_dev or on_host or node.storage_len == n):
        _fail(f"{node}: in no tier")
    if node.start != parent.start + len(parent.key):
        _fail(f"{node}: starts at {node.start}, its parent ends at {parent.start + len(parent.key)}")
    if parent is not cache.root:
        if on_dev and parent.value is None:
            _fail(f"{node}: on the device under {parent}, which is not")
        if (on_dev or on_host) and parent.value is None and parent.host_value is None:
            _fail(f"{node}: on the device or host under storage-only {parent}")
        if node.lock_ref > parent.lock_ref:
            _fail(f"{node}: locked more than its parent")
    if not 0 <= node.storage_len <= n:
        _fail(f"{node}: storage_len out of range")
    if node.lock_ref < 0 or (node.lock_ref and not on_dev):
        _fail(f"{node}: bad lock_ref {node.lock_ref}")
    if node.host_ref:
        _fail(f"{node}: host_ref {node.host_ref} outlived its transfer")
    check_node_logprobs(node)


def _check_slots(name: str, slots: list, allocator) -> None:
    all_slots = torch.cat(slots) if slots else torch.empty(0, dtype=torch.int64)
    if torch.unique(all_slots).numel() != all_slots.numel():
        _fail(f"a {name} slot is owned by two tree positions")
    if all_slots.numel() and bool((all_slots < 1).any() | (all_slots > allocator.capacity).any()):
        _fail(f"the tree holds a {name} slot outside 1..capacity")
    if torch.isin(all_slots, allocator.free_slots.to(all_slots.device)).any():
        _fail(f"a {name} tree slot is also free")


def check_tiered_tree(cache) -> None:
    evictable = protected = host_tokens = store_tokens = 0
    dev_slots, host_slots = [], []
    leaves = (set(), set(), set())
    stack = [cache.root]
    while stack:
        node = stack.pop()
        for first, child in node.children.items():
            if child.key[:1] != (first,) or child.parent is not node:
                _fail(f"{child}: bad link under first token {first}")
            _check_node(cache, child, node)
            stack.append(child)
        if node is cache.root:
            continue
        n, kids = len(node.key), node.children.values()
        if node.value is not None:
            dev_slots.append(node.value)
            if node.lock_ref:
                protected += n
            else:
                evictable += n
            if not any(c.value is not None for c in kids):
                leaves[0].add(node)
        if node.host_value is not None:
            host_slots.append(node.host_value)
            host_tokens += n
            if node.value is None and not any(c.value is not None or c.host_value is not None
                                              for c in kids):
                leaves[1].add(node)
        if node.value is None and node.host_value is None:
            store_tokens += n
            if not node.children:
                leaves[2].add(node)
    sizes = (evictable, protected, host_tokens, store_tokens)
    tracked = (cache._evictable, cache._protected, cache._host_tokens, cache._store_tokens)
    if sizes != tracked:
        _fail(f"sizes (evictable, protected, host, storage-only): walked {sizes}, "
              f"tracked {tracked}")
    if leaves != (cache._dev_leaves, cache._host_leaves, cache._store_leaves):
        _fail("a tracked leaf set differs from the tree's")
    _check_slots("device", dev_slots, cache.allocator)
    held = cache.host_slots_held()  # out of the tree: pending page writes, prefetches
    _check_slots("host", host_slots + [held], cache.host.allocator)
    if cache.prefetch_held_slots().numel() != cache._pages_held * cache.page:
        _fail(f"prefetch bookkeeping: {cache._pages_held} pages counted held, "
              f"{cache.prefetch_held_slots().numel()} slots held")
    host_free = cache.host.allocator.available_size()
    if host_free + host_tokens + held.numel() != cache.host.capacity:
        _fail(f"host KV leak: free {host_free} + tree {host_tokens} + held (writes, "
              f"prefetches) {held.numel()} != capacity {cache.host.capacity}")
