"""Shared by the tiered cache tests: a HiRadixCache over tiny pools (1 layer, 1 head, head dim 1,
fp32) whose KV is a known function of the token prefix, so every copy between tiers can be
checked value by value: the K and V of position p of `tokens` are kv_value(tokens[:p + 1])."""

from __future__ import annotations

import zlib

import torch

from radixlm.runtime.mem_cache.allocator import TokenSlotAllocator
from radixlm.runtime.mem_cache.hiradix_cache import HiRadixCache
from radixlm.runtime.mem_cache.host_pool import HostKVPool
from radixlm.runtime.mem_cache.kv_mover import KVMover
from radixlm.runtime.mem_cache.kv_pool import KVPool
from radixlm.runtime.mem_cache.req_to_token import ReqToTokenPool
from radixlm.runtime.mem_cache.storage.file_backend import FileStorage

CPU = torch.device("cpu")


def kv_value(prefix) -> float:
    return float(zlib.crc32(bytes(prefix)) % 100003)


def make_tiered(capacity=16, host_capacity=24, policy="write_through", storage_dir=None,
                page=2, seed=b"test-seed", write_queue_pages=0, store_max_bytes=None,
                **prefetch):
    """write_queue_pages 0: page writes land inside the backup (tests that look at the store
    right after an insert); > 0: on the writer thread, as in the engine. `prefetch`: the storage
    prefetch's keywords; by default its reader has no thread (`admit` and the tests run its jobs)
    and every page counts (threshold 1)."""
    prefetch = dict(dict(threaded=False, threshold=1), **prefetch)
    pool = KVPool(capacity, 1, 1, 1, torch.float32, CPU)
    alloc = TokenSlotAllocator(capacity)
    host = HostKVPool(host_capacity, pool, CPU)
    storage = None
    if storage_dir is not None:
        storage = FileStorage(storage_dir, "ns", page * host.token_bytes,
                              max_bytes=store_max_bytes)
    cache = HiRadixCache(alloc, ReqToTokenPool(4, 32), host, KVMover(pool, host, CPU), policy,
                         storage, seed, page, write_queue_pages=write_queue_pages,
                         prefetch=prefetch)
    return cache, pool, alloc


def compute(pool, tokens, slots, start=0) -> None:
    """Write the KV a forward would for tokens[start:] into `slots` (one per token from start)."""
    vals = torch.tensor([kv_value(tokens[:p + 1]) for p in range(start, len(tokens))])
    pool.k_buffers[0][slots, 0, 0] = vals
    pool.v_buffers[0][slots, 0, 0] = -vals


def room(cache, alloc) -> int:
    return alloc.available_size() + cache.evictable_size()


def put(cache, pool, alloc, tokens) -> bool:
    """Insert `tokens` the way a finished request does: compute all of them into fresh slots,
    insert, free the slots the tree already had. False when the device has no room."""
    n = len(tokens)
    if not n or room(cache, alloc) < n:
        return False
    if not alloc.can_alloc(n):
        cache.evict(n - alloc.available_size())
    slots = alloc.alloc(n)
    compute(pool, tokens, slots)
    already = cache.insert(list(tokens), slots)
    alloc.free(slots[:already])
    return True


def prefetch_all(cache, tokens):
    """The storage prefetch of a request queued with `tokens`, run to its end (manual reader):
    lookup, read, each applied as a step's start does. Returns the op (None: nothing to read)."""
    op = cache.start_prefetch(list(tokens))
    while op is not None and not op.done:
        cache.reader.work(1 << 30)
        cache.apply_prefetch_news(release=True)
    return op


def admit(cache, alloc, tokens, prefetch=True):
    """Match, lock and load the way admission does (after the request's storage prefetch, run to
    its end, unless `prefetch` is False). Returns (slots, node, details) with the request's lock
    on node, or None when the device has no room for the load."""
    stored = None
    if prefetch and cache.reader is not None:
        stored = cache.take_prefetch(prefetch_all(cache, tokens))
    m = cache.match_prefix(list(tokens))
    cache.inc_lock_ref(m[1])
    if room(cache, alloc) < m.lower_len:
        cache.dec_lock_ref(m[1])
        return None
    slots, node, details = cache.load_back(m, stored)
    if node is not m[1]:
        cache.inc_lock_ref(node)
        cache.dec_lock_ref(m[1])
    return slots, node, details


def expect_kv(pool, tokens, slots) -> None:
    want = torch.tensor([kv_value(tokens[:p + 1]) for p in range(slots.numel())])
    assert torch.equal(pool.k_buffers[0][slots, 0, 0], want), "wrong K served"
    assert torch.equal(pool.v_buffers[0][slots, 0, 0], -want), "wrong V served"


def check_contents(cache, pool) -> None:
    """Every device and host copy in the tree holds its path's KV."""
    stack = [(cache.root, ())]
    while stack:
        node, prefix = stack.pop()
        for child in node.children.values():
            path = prefix + child.key
            want = torch.tensor([kv_value(path[:p + 1]) for p in range(len(prefix), len(path))])
            if child.value is not None:
                assert torch.equal(pool.k_buffers[0][child.value, 0, 0], want), child
            if child.host_value is not None:
                host = cache.host.kv[child.host_value, 0, :, 0, 0].T  # (2, n)
                assert torch.equal(host[0], want) and torch.equal(host[1], -want), child
            stack.append((child, path))
