"""HiRadixCache: a stateful property test. Rules insert, match, lock / unlock, evict (device ->
host), evict_host (host -> storage or gone), load (host / storage -> device), corrupt a stored
page, flush; after every step the tiered invariants (check_integrity: shape, locks, per-tier
accounting) hold, every device and host copy holds its path's KV, and a load serves only
correct KV (a corrupt page is recomputed, never served). Five machines: writes to the store
inside the backup, on the writer thread (held in flight across rules), no store at all,
storage prefetches started, landing page by page, taken at admission or cancelled (abort) across
the other rules (the reader runs only when a rule says so), and the same with the head split
(a lookup cuts the first pages off, the request computes them and its read's pages join the tree
below them)."""

from __future__ import annotations

import glob
import os
import shutil
import tempfile

from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition,
                                 rule)

import torch

from hicache_helpers import admit, check_contents, expect_kv, kv_value, make_tiered, put
from radixlm.runtime.mem_cache import head_split

MIN_HEAD_TOKENS = head_split.MIN_HEAD_TOKENS

CAP, HOST_CAP = 12, 18
TOKENS = st.lists(st.integers(0, 2), min_size=1, max_size=8)
PICK = st.integers(0, 1000)


class TieredMachine(RuleBasedStateMachine):
    STORED = True  # with a file store (page of 2 tokens) under the host pool
    WRITE_QUEUE = 0  # page writes land inside the backup

    @initialize(policy=st.sampled_from(["write_through", "write_through_selective",
                                        "write_back"]))
    def setup(self, policy):
        self.dir = tempfile.mkdtemp(prefix="hicache-prop-")
        self.cache, self.pool, self.alloc = make_tiered(
            CAP, HOST_CAP, policy, self.dir if self.STORED else None, page=2,
            write_queue_pages=self.WRITE_QUEUE)
        self._hold_writes()
        self.locks = []  # (node, its device slots, its path tokens)
        self.seen = []  # inserted sequences: loads of them hit every tier
        self.corrupted = 0

    def teardown(self):
        if getattr(self, "cache", None) is not None:
            self.cache.close()
        shutil.rmtree(getattr(self, "dir", ""), ignore_errors=True)

    @rule(tokens=TOKENS)
    def insert(self, tokens):
        if put(self.cache, self.pool, self.alloc, tokens):
            self.seen.append(tokens)

    @rule(tokens=TOKENS)
    def match(self, tokens):
        m = self.cache.match_prefix(tokens)
        expect_kv(self.pool, tokens, m[0])
        assert m[0].numel() + m.lower_len <= len(tokens)

    @rule(tokens=TOKENS)
    def load(self, tokens):
        got = admit(self.cache, self.alloc, tokens)
        if got is not None:
            slots, node, details = got
            expect_kv(self.pool, tokens, slots)  # never a wrong byte, whatever tier it came from
            assert sum(details.values()) == slots.numel()
            for tier in ("host", "storage"):
                if details[tier]:
                    event(f"load from {tier}")
            if self.cache.counters["storage_load_failures"]:
                event("a bad page stopped a load")
            self.locks.append((node, slots, tuple(tokens[:slots.numel()])))

    @precondition(lambda self: self.seen)
    @rule(i=PICK, extra=TOKENS)
    def load_seen(self, i, extra):
        self.load(self.seen[i % len(self.seen)] + extra[:2])

    @precondition(lambda self: self.seen)
    @rule(i=PICK, extra=TOKENS, spoil=st.sampled_from([None, "flip", "truncate"]))
    def comes_back(self, i, extra, spoil):
        """A sequence pushed down every tier (and maybe a page of the store spoiled), then loaded:
        the multi-turn pattern, more often than the rules above happen to line it up."""
        self.cache.evict(CAP)
        self.cache.evict_host(HOST_CAP)
        seq = self.seen[i % len(self.seen)]
        if spoil is not None and self.cache.storage is not None and len(seq) >= 2:
            self.cache.storage.flush()  # spoil one of this sequence's own pages
            pages = len(seq) // 2
            key = self.cache._keys(tuple(seq), pages)[i % pages]
            if os.path.exists(self.cache.storage.path(key)):
                self._spoil(self.cache.storage.path(key), spoil)
        self.load_seen(i, extra)

    @precondition(lambda self: self.locks)
    @rule(i=PICK)
    def unlock(self, i):
        node, _, _ = self.locks.pop(i % len(self.locks))
        self.cache.dec_lock_ref(node)

    @rule(k=st.sampled_from([1, 3, CAP]))
    def evict(self, k):
        self.cache.evict(k)

    @rule(k=st.sampled_from([1, 4, HOST_CAP]))
    def evict_host(self, k):
        self.cache.evict_host(k)

    @precondition(lambda self: self.cache.storage is not None)
    @rule(i=PICK, how=st.sampled_from(["flip", "truncate"]))
    def corrupt(self, i, how):
        self.cache.storage.flush()
        files = sorted(glob.glob(os.path.join(self.cache.storage.dir, "*", "*.kv")))
        if files:
            self._spoil(files[i % len(files)], how)

    def _spoil(self, path, how):
        with open(path, "r+b") as f:
            if how == "truncate":
                f.truncate(os.path.getsize(path) - 1)
            else:  # the sign bit of the page's last value
                f.seek(-1, os.SEEK_END)
                last = f.read(1)
                f.seek(-1, os.SEEK_END)
                f.write(bytes([last[0] ^ 0x80]))
        self.corrupted += 1

    @precondition(lambda self: not self.locks)
    @rule(storage=st.booleans())
    def flush(self, storage):
        self.cache.reset()
        self.alloc.clear()
        if storage:
            self.cache.clear_storage()
        self._hold_writes()  # (reset finished the pending writes, which resumes the writer)

    def _hold_writes(self):
        """With a writer thread: it writes nothing until `writes_land`, so a run does not
        depend on thread timing (hypothesis replays it) and writes stay in flight across rules."""
        if self.cache.writer is not None and not self.cache.writer.synchronous:
            self.cache.writer.pause()

    @invariant()
    def consistent(self):
        if not hasattr(self, "cache"):
            return
        self.cache.check_integrity()
        check_contents(self.cache, self.pool)
        # device: no request owns slots here, so free + tree == capacity
        assert self.alloc.available_size() + self.cache.total_size() == CAP
        for node, slots, _ in self.locks:  # a locked node is never evicted nor moved
            if node is not self.cache.root:
                assert node.parent is not None and node.value is not None
                assert node.value.data_ptr() == slots[-len(node.key):].data_ptr() or \
                    node.value.tolist() == slots[-len(node.key):].tolist()
        locked = sum(len(n.key) for n in set(self._locked_nodes()))
        assert self.cache.protected_size() == locked

    def _locked_nodes(self):
        for node, _, _ in self.locks:
            while node is not self.cache.root:
                yield node
                node = node.parent


class AsyncWritesMachine(TieredMachine):
    """Page writes queued (at most 3 pages; more are dropped) and held in flight while the other
    rules evict, split, drop and reload their nodes; they land only in `writes_land`."""
    WRITE_QUEUE = 3

    @rule()
    def writes_land(self):
        self.cache.finish_writes()
        if self.cache.counters["pages_write_dropped"]:
            event("a full write queue dropped pages")
        self._hold_writes()

    @precondition(lambda self: self.seen)
    @rule(i=PICK, other=TOKENS, extra=TOKENS)
    def lands_after_churn(self, i, other, extra):
        """The case pins exist for: nodes leave the host while their writes are in flight, other
        KV is backed up into host slots, then the writes land and a load reads their pages."""
        self.cache.evict(CAP)
        self.cache.evict_host(HOST_CAP)
        for k in range(3):  # enough new KV to go through every free host slot
            self.insert([k] + other)
            self.cache.evict(CAP)
        self.writes_land()
        self.comes_back(i, extra, None)

    @rule()
    def step_starts(self):
        self.cache.settle_page_writes(release=True)


class PrefetchMachine(TieredMachine):
    """Prefetches of queued requests in every state (lookup pending, read part-way, ended, pages
    adopted while the read goes on) while the other rules evict, split, drop, corrupt and reload
    around them. (Each rule draws one integer: hypothesis orders rules by their argument count
    and rarely reaches those with many.)"""

    # random tokens, rarely stored: here they would dilute the rules below (still called)
    match = None
    SPLIT = False  # lookups that find pages may split them (mem_cache/head_split.py)
    MAX_OPS = 1 << 30  # requests queued at once

    def load(self, tokens):
        TieredMachine.load(self, tokens)

    def load_seen(self, i, extra):
        TieredMachine.load_seen(self, i, extra)

    @initialize()
    def no_ops(self):
        self.ops = []  # (op, the request's tokens), not yet admitted nor aborted

    def teardown(self):
        head_split.MIN_HEAD_TOKENS = MIN_HEAD_TOKENS
        TieredMachine.teardown(self)

    def _apply_news(self) -> None:
        """A step's start. SPLIT: the rates are set so that every split cuts half the pages
        found (again each time: reads update them), a head of one page at least."""
        if self.SPLIT:
            head_split.MIN_HEAD_TOKENS = 1
            c = self.cache
            c.split_heads = True
            c._head_tps = c._prefill_tps = 1.0
            c._read_bps = float(c.host.token_bytes)
        before = self.cache.counters["head_splits"]
        self.cache.apply_prefetch_news(release=True, idle=self.SPLIT)
        if self.cache.counters["head_splits"] > before:
            event("split: a lookup cut a head off")

    def _reader_steps(self, units):
        """`units` of reader work then a step's start, twice (a lookup, then its read)."""
        for _ in range(2 if units else 0):
            self.cache.reader.work(units)
            self._apply_news()

    @precondition(lambda self: self.seen and len(self.ops) < self.MAX_OPS)
    @rule(i=PICK)
    def queued(self, i):
        """A request is queued (its sequence + 0-2 more tokens); for even i (any, SPLIT) its
        sequence was just computed and pushed down every tier (only the store holds it: what
        prefetch is for)."""
        seq = self.seen[i % len(self.seen)]
        if i % 2 == 0 or self.SPLIT:
            self.insert(seq)
            self.cache.evict(CAP)
            self.cache.evict_host(HOST_CAP)
        tokens = seq + [i % 3, i % 5 % 3][:i % 3]
        op = self.cache.start_prefetch(tokens, may_split=self.SPLIT and i % 4 != 0)
        if op is not None:
            self.ops.append((op, tokens))

    @precondition(lambda self: self.ops)
    @rule(units=st.sampled_from([1, 2, 100]))
    def reader_works(self, units):
        """The reader runs while a step goes by; its reports apply at the next step's start."""
        self.cache.reader.work(units)
        self._apply_news()

    def _compute_head(self, op, tokens) -> None:
        """A split request computes its head (as the scheduler admits it at once) and waits
        again holding it locked (split_heads `_park`); no room: it stays pending."""
        head = tokens[:op.head_end]
        if not put(self.cache, self.pool, self.alloc, head):
            event("split: no room for the head")
            return
        m = self.cache.match_prefix(head)
        assert m[0].numel() == len(head)
        self.cache.inc_lock_ref(m[1])
        self.locks.append((m[1], m[0], tuple(head)))
        op.head_done = True
        event("split: head computed, its pages come below it")

    @precondition(lambda self: self.ops)
    @rule(i=PICK)
    def served(self, i):
        """Queued request i % len(ops) reaches admission after some reader work (i // 3 % 4:
        all of it, none, 1 unit, 2 units), then by i % 3: it is admitted (what landed joins the
        tree, the rest is cancelled, the load serves only correct KV); admission adopts what
        landed but finds no room (the read goes on, the request stays queued); it is aborted."""
        k = i % len(self.ops)
        op, tokens = self.ops[k]
        self._reader_steps([100, 0, 1, 2][i // 3 % 4])
        if op.head_pending:  # split: the request computes its head first, the read goes on
            self._compute_head(op, tokens)
            self._reader_steps([100, 0, 1, 2][i // 3 % 4])
        if i % 3 == 1:
            if self.cache.adopt_prefetch(op) is not None and not op.done:
                event("pages adopted, the read goes on")
            return
        self.ops.pop(k)
        if i % 3 == 2:
            if op.reading:
                event("aborted with a read in flight")
            self.cache.cancel_prefetch(op)
            return
        stored = self.cache.take_prefetch(op)
        m = self.cache.match_prefix(tokens)
        self.cache.inc_lock_ref(m[1])
        if self.alloc.available_size() + self.cache.evictable_size() < m.lower_len:
            self.cache.dec_lock_ref(m[1])
            return
        slots, node, details = self.cache.load_back(m, stored)
        if node is not m[1]:
            self.cache.inc_lock_ref(node)
            self.cache.dec_lock_ref(m[1])
        expect_kv(self.pool, tokens, slots)  # never a wrong byte, prefetched or not
        if details["storage"]:
            event("admitted with prefetched tokens")
        self.locks.append((node, slots, tuple(tokens[:slots.numel()])))

    @invariant()
    def landed_pages_hold_their_kv(self):
        page = getattr(self, "cache", None) and self.cache.page
        for op, tokens in getattr(self, "ops", ()):
            if op.cancelled or op.slots is None:
                continue
            for j in range(op.released, op.landed):
                a = (op.first + j) * page
                want = torch.tensor([kv_value(tokens[:p + 1]) for p in range(a, a + page)])
                got = self.cache.host.kv[op.slots[j * page:(j + 1) * page], 0, :, 0, 0].T  # (2, P)
                assert torch.equal(got[0], want) and torch.equal(got[1], -want), op


class SplitPrefetchMachine(PrefetchMachine):
    """The same with the head split on: a lookup that finds pages cuts the first half off for
    the request to compute; the read's pages join the tree below the head once it is there.
    Two requests queued at most: the host pool's room for prefetched pages (4 pages of 2
    tokens) is otherwise taken, and a lookup with under 2 pages of room does not split."""
    SPLIT = True
    MAX_OPS = 2


class HostOnlyMachine(TieredMachine):
    STORED = False  # host eviction drops nodes


TieredMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
HostOnlyMachine.TestCase.settings = settings(max_examples=25, stateful_step_count=30,
                                             deadline=None)
AsyncWritesMachine.TestCase.settings = settings(max_examples=40, stateful_step_count=30,
                                                deadline=None)
test_tiered_cache_invariants = TieredMachine.TestCase
test_host_only_cache_invariants = HostOnlyMachine.TestCase
PrefetchMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=40,
                                             deadline=None)
test_storage_prefetch_invariants = PrefetchMachine.TestCase
SplitPrefetchMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40,
                                                  deadline=None)
test_split_prefetch_invariants = SplitPrefetchMachine.TestCase
test_async_page_writes_invariants = AsyncWritesMachine.TestCase
