"""RadixCache: unit tests per method and edge case, plus a stateful property test against a plain
dict model (prefix tuple -> slot) over a 3-token alphabet, so prefixes collide often."""

from __future__ import annotations

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

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


# --- property test -------------------------------------------------------------------------------
CAP, MAX_CTX = 40, 24
TOKENS = st.lists(st.integers(0, 2), max_size=7)
PICK = st.integers(0, 1000)


class RadixMachine(RuleBasedStateMachine):
    """Reference: `ref` maps every cached prefix (tuple) to the slot of its last token; requests and
    bare locks are tracked so the protected set and KV accounting can be recomputed from scratch."""

    def __init__(self):
        super().__init__()
        self.cache, self.alloc, self.pool = make(CAP, max_reqs=3, max_ctx=MAX_CTX)
        self.ref: dict[tuple, int] = {}
        self.locks: list[tuple[TreeNode, tuple]] = []
        self.reqs: list[tuple[Req, list[int]]] = []  # (request, tokens whose KV is written)

    # reference model
    def ref_match(self, tokens) -> list[int]:
        out = []
        for i in range(1, len(tokens) + 1):
            if tuple(tokens[:i]) not in self.ref:
                break
            out.append(self.ref[tuple(tokens[:i])])
        return out

    def ref_insert(self, tokens, slots: list[int]) -> int:
        already = len(self.ref_match(tokens))
        for i in range(already, len(tokens)):
            self.ref[tuple(tokens[: i + 1])] = slots[i]
        return already

    def protected(self) -> set:
        seqs = [t for _, t in self.locks]
        seqs += [tuple(toks[: req.prefix_indices.numel()]) for req, toks in self.reqs]
        return {s[:i] for s in seqs for i in range(1, len(s) + 1)}

    def evict_checked(self, k: int) -> None:
        before, evictable, locked = dict(self.ref), self.cache.evictable_size(), self.protected()
        freed = self.cache.evict(k)
        after = dump(self.cache)
        removed = set(before) - set(after)
        assert all(before.get(p) == s for p, s in after.items()), "eviction changed surviving slots"
        assert freed == len(removed) and freed >= min(k, evictable)
        assert not removed & locked, "evicted a locked prefix"
        if removed:
            assert torch.isin(torch.tensor([before[p] for p in removed]), self.alloc.free_slots).all()
        self.ref = after

    def alloc_slots(self, n: int):
        if self.alloc.available_size() < n:
            self.evict_checked(n - self.alloc.available_size())
        return self.alloc.alloc(n)

    # rules
    @rule(tokens=TOKENS)
    def insert(self, tokens):
        slots = self.alloc_slots(len(tokens))
        if slots is not None:
            already = self.cache.insert(tokens, slots)
            assert already == self.ref_insert(tokens, slots.tolist())
            self.alloc.free(slots[:already])

    @rule(tokens=TOKENS)
    def match(self, tokens):
        idx, node = self.cache.match_prefix(tokens)
        assert idx.tolist() == self.ref_match(tokens)
        assert path_tokens(node) == tuple(tokens[: idx.numel()])

    @rule(tokens=TOKENS)
    def lock(self, tokens):
        idx, node = self.cache.match_prefix(tokens)
        self.cache.inc_lock_ref(node)
        self.locks.append((node, tuple(tokens[: idx.numel()])))

    @precondition(lambda self: self.locks)
    @rule(i=PICK)
    def unlock(self, i):
        node, _ = self.locks.pop(i % len(self.locks))
        self.cache.dec_lock_ref(node)

    @rule(k=st.integers(0, CAP))
    def evict(self, k):
        self.evict_checked(k)

    @precondition(lambda self: self.pool.available_size() > 0)
    @rule(tokens=TOKENS)
    def start_req(self, tokens):
        req = Req("r", tokens, SamplingParams())
        req.req_pool_idx = self.pool.alloc()
        req.prefix_indices, req.last_node = self.cache.match_prefix(tokens)
        self.cache.inc_lock_ref(req.last_node)  # lock before allocating: eviction may run
        self.pool.write(req.req_pool_idx, 0, req.prefix_indices)
        self.reqs.append((req, tokens[: req.prefix_indices.numel()]))
        self.extend_req(len(self.reqs) - 1, tokens[req.prefix_indices.numel() :])

    @precondition(lambda self: self.reqs)
    @rule(i=PICK, extra=TOKENS)
    def extend_req(self, i, extra):  # a prefill chunk or decoded tokens
        req, toks = self.reqs[i % len(self.reqs)]
        extra = extra[: MAX_CTX - len(toks)]
        slots = self.alloc_slots(len(extra))
        if slots is not None:
            self.pool.write(req.req_pool_idx, len(toks), slots)
            toks.extend(extra)

    @precondition(lambda self: self.reqs)
    @rule(i=PICK)
    def cache_unfinished(self, i):
        req, toks = self.reqs[i % len(self.reqs)]
        row = self.pool.req_to_token[req.req_pool_idx]
        own = row[: len(toks)].tolist()
        self.cache.cache_unfinished_req(req, toks)
        self.ref_insert(toks, own)
        assert req.prefix_indices.tolist() == self.ref_match(toks) == row[: len(toks)].tolist()
        assert path_tokens(req.last_node) == tuple(toks)

    @precondition(lambda self: self.reqs)
    @rule(i=PICK)
    def finish(self, i):
        req, toks = self.reqs.pop(i % len(self.reqs))
        own = self.pool.req_to_token[req.req_pool_idx, : len(toks)].tolist()
        self.cache.cache_finished_req(req, toks)
        self.ref_insert(toks, own)

    @invariant()
    def consistent(self):
        self.cache.check_integrity()
        assert dump(self.cache) == self.ref
        owned = [self.pool.req_to_token[r.req_pool_idx, r.prefix_indices.numel() : len(t)] for r, t in self.reqs]
        tree = torch.tensor(list(self.ref.values()), dtype=torch.int64)
        assert self.alloc.available_size() + self.cache.total_size() + sum(o.numel() for o in owned) == CAP
        every = torch.cat([self.alloc.free_slots, tree, *owned]).tolist()
        assert sorted(every) == list(range(1, CAP + 1)), "a slot is lost or in two places"
        assert self.cache.protected_size() == len(self.protected())
        assert self.cache.evictable_size() == self.cache.total_size() - self.cache.protected_size()
        assert self.pool.available_size() + len(self.reqs) == 3


RadixMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
test_radix_cache_matches_reference = RadixMachine.TestCase
