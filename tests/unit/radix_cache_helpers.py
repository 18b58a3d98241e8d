"""Shared by the RadixCache tests (test_radix_cache.py, test_radix_cache_property.py): a cache
over a small allocator and request pool, inserts and request admission done the way callers must,
and readers of the tree that do not touch its LRU clock or split nodes."""

from __future__ import annotations

from radixlm.runtime.mem_cache.allocator import TokenSlotAllocator
from radixlm.runtime.mem_cache.radix_cache import RadixCache, TreeNode
from radixlm.runtime.mem_cache.req_to_token import ReqToTokenPool
from radixlm.runtime.request import Req
from radixlm.runtime.sampling_params import SamplingParams


def make(capacity=32, disable=False, max_reqs=4, max_ctx=32):
    alloc = TokenSlotAllocator(capacity)
    pool = ReqToTokenPool(max_reqs, max_ctx)
    return RadixCache(alloc, pool, disable=disable), alloc, pool


def put(cache, alloc, tokens):
    """Insert `tokens` with fresh slots the way a caller must: free the duplicates it still owns."""
    slots = alloc.alloc(len(tokens))
    already = cache.insert(tokens, slots)
    alloc.free(slots[:already])
    return slots, already


def path_tokens(node: TreeNode) -> tuple:
    keys = []
    while node is not None and node.parent is not None:
        keys.append(node.key)
        node = node.parent
    return tuple(t for key in reversed(keys) for t in key)


def dump(cache) -> dict:
    """Tree content as {prefix tuple: slot of its last token}, read without touching LRU/splits."""
    out = {}

    def walk(node, prefix):
        for child in node.children.values():
            for i, slot in enumerate(child.value.tolist()):
                out[prefix + child.key[: i + 1]] = slot
            walk(child, prefix + child.key)

    walk(cache.root, ())
    return out


def start_req(cache, alloc, pool, tokens):
    """Admit a request the way the scheduler does: match, lock, take a row, allocate the rest."""
    req = Req("r", tokens, SamplingParams())
    req.req_pool_idx = pool.alloc()
    req.prefix_indices, req.last_node = cache.match_prefix(tokens)
    cache.inc_lock_ref(req.last_node)
    n = req.prefix_indices.numel()
    pool.write(req.req_pool_idx, 0, req.prefix_indices)
    pool.write(req.req_pool_idx, n, alloc.alloc(len(tokens) - n))
    return req
