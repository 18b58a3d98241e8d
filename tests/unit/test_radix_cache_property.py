"""RadixCache: a stateful property test against a plain dict model (prefix tuple -> slot) over a
3-token alphabet, so prefixes collide often. Unit tests per method are in test_radix_cache.py."""

from __future__ import annotations

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from radix_cache_helpers import dump, make, path_tokens
from radixlm.runtime.mem_cache.radix_cache import TreeNode
from radixlm.runtime.request import Req
from radixlm.runtime.sampling_params import SamplingParams

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
