"""RadixCache: unit tests per method and edge case (the stateful property test against a plain
dict model is in test_radix_cache_property.py)."""

from __future__ import annotations

import pytest
import torch

from radix_cache_helpers import dump, make, path_tokens, put, start_req


# --- unit tests ----------------------------------------------------------------------------------
def test_empty_tokens():
    cache, alloc, _ = make()
    idx, node = cache.match_prefix([])
    assert idx.numel() == 0 and idx.dtype == torch.int64 and node is cache.root
    assert cache.insert([], torch.empty(0, dtype=torch.int64)) == 0
    assert cache.total_size() == 0 and cache.evict(5) == 0
    cache.check_integrity()


def test_insert_then_match_returns_first_inserted_slots():
    cache, alloc, _ = make()
    a, already = put(cache, alloc, [1, 2, 3])
    assert already == 0
    b, already = put(cache, alloc, [1, 2, 4, 5])
    assert already == 2  # [1, 2] was there; the tree keeps a[:2], the caller freed b[:2]
    idx, node = cache.match_prefix([1, 2, 4, 5, 6])
    assert idx.tolist() == a[:2].tolist() + b[2:].tolist()
    assert path_tokens(node) == (1, 2, 4, 5)
    assert cache.match_prefix([9])[0].numel() == 0
    assert cache.total_size() == 5 and alloc.available_size() + 5 == 32
    cache.check_integrity()


def test_insert_prefix_of_existing_key_splits():
    cache, alloc, _ = make()
    a, _ = put(cache, alloc, [1, 2, 3, 4])
    _, already = put(cache, alloc, [1, 2])
    assert already == 2 and cache.total_size() == 4
    (upper,) = cache.root.children.values()
    assert upper.key == (1, 2) and list(upper.children) == [3]
    assert cache.match_prefix([1, 2, 3, 4])[0].tolist() == a.tolist()
    cache.check_integrity()


def test_match_ending_inside_node_splits_it():
    cache, alloc, _ = make()
    a, _ = put(cache, alloc, [1, 2, 3, 4])
    idx, node = cache.match_prefix([1, 2, 9])
    assert idx.tolist() == a[:2].tolist()
    assert node.key == (1, 2) and node.children[3].key == (3, 4)
    cache.check_integrity()


def test_match_across_several_nodes():
    cache, alloc, _ = make()
    put(cache, alloc, [1, 2, 3, 4])
    put(cache, alloc, [1, 2, 5, 6])
    put(cache, alloc, [1, 2, 5, 7, 8])
    idx, node = cache.match_prefix([1, 2, 5, 7, 8, 9])
    assert idx.numel() == 5 and path_tokens(node) == (1, 2, 5, 7, 8)
    assert len(set(idx.tolist())) == 5
    cache.check_integrity()


def test_lock_accounting_root_noop_and_split_under_lock():
    cache, alloc, _ = make()
    put(cache, alloc, [1, 2, 3, 4])
    put(cache, alloc, [1, 2, 5])
    cache.inc_lock_ref(cache.root)  # no-op
    assert (cache.evictable_size(), cache.protected_size()) == (5, 0)
    _, node = cache.match_prefix([1, 2, 3, 4])
    cache.inc_lock_ref(node)
    cache.inc_lock_ref(node)
    assert (cache.evictable_size(), cache.protected_size()) == (1, 4)
    cache.match_prefix([1, 2, 3])  # splits a locked node: sizes must not move
    assert (cache.evictable_size(), cache.protected_size()) == (1, 4)
    cache.check_integrity()
    cache.dec_lock_ref(node)
    assert cache.protected_size() == 4
    cache.dec_lock_ref(node)
    assert (cache.evictable_size(), cache.protected_size()) == (5, 0)
    with pytest.raises(AssertionError):
        cache.dec_lock_ref(node)
    cache.dec_lock_ref(cache.root)
    cache.check_integrity()


def test_evict_lru_order():
    cache, alloc, _ = make()
    a, _ = put(cache, alloc, [1, 1])
    b, _ = put(cache, alloc, [2, 2])
    c, _ = put(cache, alloc, [3, 3])
    cache.match_prefix([1, 1])  # a is now the most recent; b the least
    assert cache.evict(1) == 2
    assert set(dump(cache)) == {(1,), (1, 1), (3,), (3, 3)}
    assert torch.isin(b, alloc.free_slots).all()
    assert cache.evict(2) == 2 and set(dump(cache)) == {(1,), (1, 1)}
    assert alloc.available_size() + cache.total_size() == 32
    cache.check_integrity()


def test_evict_parent_becomes_leaf_and_never_more_than_exists():
    cache, alloc, _ = make()
    put(cache, alloc, [1, 2, 3])
    put(cache, alloc, [1, 2, 4])
    assert cache.evict(3) == 4  # both 1-token leaves, then their parent (1, 2)
    assert cache.total_size() == 0 and not cache.root.children
    put(cache, alloc, [5, 6])
    assert cache.evict(100) == 2 and alloc.available_size() == 32
    cache.check_integrity()


def test_evict_skips_locked_paths():
    cache, alloc, _ = make()
    put(cache, alloc, [1, 2, 3])
    put(cache, alloc, [1, 2, 4])
    _, node = cache.match_prefix([1, 2, 3])
    cache.inc_lock_ref(node)
    assert cache.evict(100) == 1  # only leaf (4); (1, 2) and (3) are locked
    assert set(dump(cache)) == {(1,), (1, 2), (1, 2, 3)}
    cache.dec_lock_ref(node)
    assert cache.evict(100) == 3
    with pytest.raises(AssertionError, match="stale"):
        cache.inc_lock_ref(node)  # a match taken before an eviction must not be locked
    cache.check_integrity()


def test_cache_finished_req_shares_prefix_and_frees_row():
    cache, alloc, pool = make()
    r1 = start_req(cache, alloc, pool, [1, 2, 3])
    row1 = r1.req_pool_idx
    s1 = pool.req_to_token[row1, :3].clone()
    cache.cache_finished_req(r1, [1, 2, 3])
    pool.req_to_token[row1].zero_()  # the row is reused: the tree must hold its own copy
    assert cache.match_prefix([1, 2, 3])[0].tolist() == s1.tolist()
    assert cache.total_size() == 3 and alloc.available_size() == 29 and pool.available_size() == 4
    r2 = start_req(cache, alloc, pool, [1, 2, 3, 4, 5])
    assert r2.prefix_indices.numel() == 3 and cache.protected_size() == 3
    cache.cache_finished_req(r2, [1, 2, 3, 4, 5])
    assert (cache.total_size(), cache.protected_size(), alloc.available_size()) == (5, 0, 27)
    assert pool.available_size() == 4 and row1 is not None
    cache.check_integrity()


def test_cache_finished_req_frees_duplicates_of_concurrent_request():
    cache, alloc, pool = make()
    r1 = start_req(cache, alloc, pool, [7, 8, 9])
    r2 = start_req(cache, alloc, pool, [7, 8, 9, 1])  # admitted before r1 finished: no prefix hit
    s1 = pool.req_to_token[r1.req_pool_idx, :3].clone()
    cache.cache_finished_req(r1, [7, 8, 9])
    cache.cache_finished_req(r2, [7, 8, 9, 1])
    assert cache.match_prefix([7, 8, 9])[0].tolist() == s1.tolist()
    assert cache.total_size() == 4 and alloc.available_size() == 28
    cache.check_integrity()


def test_cache_finished_req_with_prefix_and_duplicates():
    cache, alloc, pool = make()
    r0 = start_req(cache, alloc, pool, [1, 2, 3])
    cache.cache_finished_req(r0, [1, 2, 3])
    r1 = start_req(cache, alloc, pool, [1, 2, 3, 4, 5])  # prefix hit of 3, computes [4, 5]
    r2 = start_req(cache, alloc, pool, [1, 2, 3, 4])
    cache.cache_finished_req(r2, [1, 2, 3, 4])  # now [4] is in the tree with r2's slot
    tree = cache.match_prefix([1, 2, 3, 4])[0]
    cache.cache_finished_req(r1, [1, 2, 3, 4, 5])  # frees r1's slot for 4 only, not the prefix's
    assert cache.match_prefix([1, 2, 3, 4, 5])[0][:4].tolist() == tree.tolist()
    assert (cache.total_size(), alloc.available_size(), cache.protected_size()) == (5, 27, 0)
    cache.check_integrity()


def test_cache_unfinished_req_chunked_prefill():
    cache, alloc, pool = make()
    other = start_req(cache, alloc, pool, [1, 2, 3])
    req = start_req(cache, alloc, pool, [1, 2, 3, 4, 5, 6])  # computes [1, 2, 3] itself too
    own = pool.req_to_token[req.req_pool_idx, :6].clone()
    cache.cache_finished_req(other, [1, 2, 3])
    tree123 = cache.match_prefix([1, 2, 3])[0]
    cache.cache_unfinished_req(req, [1, 2, 3, 4])  # first chunk
    row = pool.req_to_token[req.req_pool_idx]
    assert row[:4].tolist() == tree123.tolist() + own[3:4].tolist()  # duplicates swapped for tree's
    assert req.prefix_indices.tolist() == row[:4].tolist() and path_tokens(req.last_node) == (1, 2, 3, 4)
    assert cache.protected_size() == 4 and alloc.available_size() + 4 + 2 == 32  # 2: own[4:6]
    cache.check_integrity()
    cache.cache_unfinished_req(req, [1, 2, 3, 4, 5])  # moves the lock down one token
    assert cache.protected_size() == 5 and cache.evictable_size() == 0
    cache.cache_finished_req(req, [1, 2, 3, 4, 5, 6])
    assert (cache.total_size(), cache.protected_size(), alloc.available_size()) == (6, 0, 26)
    assert pool.available_size() == 4
    cache.check_integrity()


def test_disabled_cache():
    cache, alloc, pool = make(disable=True)
    req = start_req(cache, alloc, pool, [1, 2, 3, 4])
    assert req.prefix_indices.numel() == 0 and req.last_node is cache.root
    one = alloc.alloc(1)
    with pytest.raises(RuntimeError):
        cache.insert([1], one)
    alloc.free(one)
    cache.cache_unfinished_req(req, [1, 2, 3])
    # the prefix is the request's own: the tree is empty, so count it once, as request-owned
    assert req.prefix_indices.tolist() == pool.req_to_token[req.req_pool_idx, :3].tolist()
    assert cache.total_size() == 0 and cache.tree_owned_len(req) == 0
    assert alloc.available_size() + cache.total_size() + 4 == 32
    assert cache.match_prefix([1, 2, 3])[0].numel() == 0
    cache.cache_finished_req(req, [1, 2, 3, 4])
    assert alloc.available_size() == 32 and pool.available_size() == 4
    cache.check_integrity()


def test_reset_and_pretty_print():
    cache, alloc, _ = make()
    put(cache, alloc, [1, 2, 3])
    put(cache, alloc, [1, 4])
    assert "[1]" in cache.pretty_print()
    cache.reset()
    alloc.clear()
    assert cache.total_size() == 0 and cache.match_prefix([1, 2])[0].numel() == 0
    cache.check_integrity()


def test_check_integrity_catches_corruption():
    cache, alloc, _ = make()
    slots, _ = put(cache, alloc, [1, 2, 3])
    alloc.free(slots[:1])  # a tree slot also in the free list
    with pytest.raises(AssertionError, match="free list"):
        cache.check_integrity()
    cache, alloc, _ = make()
    put(cache, alloc, [1, 2, 3])
    cache._evictable += 1
    with pytest.raises(AssertionError, match="sizes"):
        cache.check_integrity()
    cache, alloc, _ = make()
    put(cache, alloc, [1, 2])
    put(cache, alloc, [3, 4])
    cache.root.children[3].value = cache.root.children[1].value.clone()
    with pytest.raises(AssertionError, match="two tree positions"):
        cache.check_integrity()
