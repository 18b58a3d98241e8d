"""HiRadixCache's storage prefetch: the scheduler's side of page_reader.py. A mixin: the state is
HiRadixCache's; every method here runs on the scheduler's thread.

A waiting request's life with a store (SGLang's `--hicache-storage-prefetch-policy`):
  queued    `start_prefetch`: the prompt's full pages past the device + host match (by key) go to
            the reader for a lookup (no I/O here).
  each step `apply_prefetch_news` (start of the step): a lookup's result gets host slots (evicting
            host LRU leaves, never the request's own host path) and a read job; landed pages are
            counted; a read's end frees the slots of pages that did not land. Nothing waits.
  split     (head_split.py) when the lookup finds pages while nothing else wants the GPU: the
            request goes at once to compute the prefix's first pages (`head_pending`), the
            reader reads the rest meanwhile; the request then waits again (scheduler `_park`)
            and its pages join the tree below the head it computed.
  admission `prefetch_ready` decides whether the request may go now:
              best_effort    always: what has landed is used, the rest recomputed;
              wait_complete  only once the read has ended;
              timeout        (default) once it ended, or its deadline passed (SGLang's
                             prefetch_timeout_base + prefetch_timeout_per_ki_token x tokens/1024),
                             or at once when the measured rates say reading a token is slower
                             than computing it (then it is recomputed: `storage_loads_skipped`).
            `adopt_prefetch` then puts the landed pages into the tree as host-resident nodes
            (below the request's device + host path, which may have changed since) and the
            normal load (host -> device) follows; once the request is admitted the rest of its
            prefetch is cancelled (not admitted after all: the read goes on).
  abort     `cancel_prefetch`: the op stops; its slots go back.
Accounting: an op's host slots are "held" (out of the tree, out of the free list) from their
allocation until adopted or freed; slots the reader may still be writing (a cancelled op whose
read is running) stay held until the read ends. check_integrity counts them:
    host free + host tokens in the tree + held (page writes, prefetches) == host capacity
Pages that fail their checks are never served: the read stops there, the store deletes the file,
the tree forgets the storage-only nodes from that page on, and the tokens are recomputed.
CUDA: the reader writes host rows with the CPU, so a read starts only when no backup's DMA is in
flight (else it waits, staged, until the backups queued before it have landed: checked without a
wait at each step's start, `KVMover.land_ready`, or waited for by one `KVMover.complete` at a
step with no forward in flight; as for page writes; a load's DMA only reads rows that cannot be
freed before it is done).
"""

from __future__ import annotations

import time
from typing import Optional

import torch

from radixlm.runtime.mem_cache.head_split import head_split_pages
from radixlm.runtime.mem_cache.page_reader import PageReader, PrefetchOp
from radixlm.runtime.mem_cache.tier_transfers import _ema

PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")
# SGLang's defaults (its storage extra config): prefetch when >= 256 tokens are in the store;
# the timeout policy waits 1 s + 0.25 s per 1024 tokens at most
DEFAULT_PREFETCH_THRESHOLD = 256
DEFAULT_TIMEOUT_BASE = 1.0
DEFAULT_TIMEOUT_PER_KI_TOKEN = 0.25
MAX_QUEUED_LOOKUPS = 256  # past this many pending lookups a new request is not prefetched
PROBE_PAGES = 16  # pages a start reads to measure the store (probe_read_rate): 2 fetcher rounds
# in-flight pages: this many bytes, and at most 1 / READ_QUEUE_HOST_SHARE of the host pool. Large
# enough for one long prompt: at 1 GiB (until 2026-11-28) an 8B model's request read at most 8k
# tokens and recomputed the rest (H200, 16k-token prompts after a restart: 65536 of 131k tokens
# from the store, TTFT p50 1.30x lower than recomputing)
READ_QUEUE_BYTES = 16 << 30
READ_QUEUE_HOST_SHARE = 2


def default_prefetch_pages(host, page_tokens: int) -> int:
    return max(1, min(READ_QUEUE_BYTES // (page_tokens * host.token_bytes),
                      host.capacity // (READ_QUEUE_HOST_SHARE * page_tokens)))


class TierPrefetch:
    def _init_prefetch(self, policy: str = "timeout", threshold: Optional[int] = None,
                       timeout_base: Optional[float] = None,
                       timeout_per_ki_token: Optional[float] = None,
                       queue_pages: Optional[int] = None, threaded: bool = True) -> None:
        if policy not in PREFETCH_POLICIES:
            raise ValueError(f"hicache_storage_prefetch_policy: must be one of "
                             f"{PREFETCH_POLICIES} (got {policy!r})")
        self.prefetch_policy = policy
        self.prefetch_threshold = DEFAULT_PREFETCH_THRESHOLD if threshold is None else threshold
        self.prefetch_timeout_base = DEFAULT_TIMEOUT_BASE if timeout_base is None else timeout_base
        self.prefetch_timeout_per_ki_token = (DEFAULT_TIMEOUT_PER_KI_TOKEN
                                              if timeout_per_ki_token is None
                                              else timeout_per_ki_token)
        self.reader: Optional[PageReader] = None
        self.prefetch_pages = 0
        if self.storage is not None:
            self.reader = PageReader(self.host, self.page, threaded)
            self.prefetch_pages = (default_prefetch_pages(self.host, self.page)
                                   if queue_pages is None else queue_pages)
        self._ops: set[PrefetchOp] = set()  # ops with a job pending or slots held
        self._staged: list[PrefetchOp] = []  # slots allocated, read waiting for the host rows
        self._lookups = 0  # lookups queued or running
        self._pages_held = 0  # pages of host slots the ops hold
        # compute the head, read the tail (head_split.py): on CUDA, where the reader's threads
        # use host cores the forward leaves free (tests turn it on for the CPU)
        self.split_heads = self.mover.loads_async

    # --- queued ----------------------------------------------------------------------------------
    def start_prefetch(self, token_ids, may_split: bool = False) -> Optional[PrefetchOp]:
        """A request entered the waiting queue with these (matchable) prompt tokens: look its
        pages past the tree's device + host match up in the store, off this thread. `may_split`:
        the request may compute the head of what the store holds (head_split.py)."""
        if self.reader is None or self.prefetch_pages <= 0:
            return None
        tokens, page = tuple(token_ids), self.page
        m = self.match_prefix(tokens)
        have = len(m[0]) + m.host_len
        first, last = have // page, len(tokens) // page
        if last <= first or last * page - have < max(self.prefetch_threshold, 1):
            return None
        if self._lookups >= MAX_QUEUED_LOOKUPS:
            self.counters["prefetch_dropped"] += 1
            return None
        wait = (self.prefetch_timeout_base
                + self.prefetch_timeout_per_ki_token * (last * page - have) / 1024)
        op = PrefetchOp(self.storage, tokens, first, list(self._keys(tokens, last)[first:]), page,
                        time.monotonic() + wait, may_split=may_split)
        self._lookups += 1
        self._ops.add(op)
        self.reader.lookup(op)
        self.counters["prefetch_started"] += 1
        return op

    # --- start of a step -------------------------------------------------------------------------
    def prefetch_news(self) -> bool:
        """Whether the reader has reported something a step should apply."""
        return self.reader is not None and bool(self.reader.news)

    def apply_prefetch_news(self, release: bool, idle: bool = False) -> None:
        """Apply the reader's reports in order; start the reads that waited for backups' DMA
        (CUDA): with `release` (no forward of ours in flight) all, landing every backup; else
        those whose backups have completed. `idle`: nothing else wants the GPU now (a lookup
        that finds pages may split them, head_split.py)."""
        if self.reader is None:
            return
        news = self.reader.news
        while news:
            kind, op, *rest = news.popleft()
            if kind == "found":
                self._lookups -= 1
                self._on_found(op, rest[0], idle)
            elif kind == "landed":
                op.landed = max(op.landed, rest[0])
            else:
                self._on_read_end(op, *rest)
        if self._staged:  # all with `release`; else those whose backups have landed (no wait)
            if release:
                self.mover.complete()
            landed = self.mover.backups_landed if release else self.mover.land_ready()
            start = [op for op in self._staged if op.staged_after <= landed]
            self._staged = [op for op in self._staged if op.staged_after > landed]
            for op in start:
                op.staged, op.reading = False, True
                self.reader.read(op)

    def _on_found(self, op: PrefetchOp, n: int, idle: bool = False) -> None:
        op.found = n
        room = self.prefetch_pages - self._pages_held
        take = min(n, room)
        if op.cancelled or n * self.page < max(self.prefetch_threshold, 1) or take <= 0:
            if not op.cancelled and n and take <= 0:
                self.counters["prefetch_dropped"] += 1
            self._finish(op)
            return
        if idle and op.may_split and self.split_heads and self.prefetch_policy != "best_effort":
            take -= self._split_head(op, take)
        slots = self._alloc_pinning_path(op, take * self.page)
        if slots is None:  # every host copy is pinned: recompute instead
            self._finish(op)
            return
        op.slots = slots
        self._pages_held += take
        if self.mover.backups_in_flight():
            op.staged = True  # (CUDA) a backup's DMA may still write rows the reader would
            op.staged_after = self.mover.backups_queued
            self._staged.append(op)
        else:
            op.reading = True
            self.reader.read(op)

    def probe_read_rate(self) -> bool:
        """A start on a store holding pages, with no read rate kept from an earlier run: read
        PROBE_PAGES of them (any) into host slots that go back at the read's end, and keep the
        rate as the store's prior. Without one, the first request after a restart could not
        split (it read all: ~30% above the steady TTFT, H200 2026-11-28) and the second split
        by a head too small. A prior only: the head split alone uses it (`_rate`). True when
        a probe started."""
        if (self.reader is None or self._read_bps is not None
                or "read_bps" in self._rate_priors):
            return False
        keys = self.storage.sample_keys(PROBE_PAGES)
        slots = self._alloc_host(len(keys) * self.page) if keys else None
        if slots is None:
            return False
        op = PrefetchOp(self.storage, (), 0, keys, self.page, float("inf"), found=len(keys),
                        slots=slots, probe=True)
        self._ops.add(op)
        self._pages_held += len(keys)
        op.reading = True  # (at start: no backup's DMA can be writing host rows)
        self.reader.read(op)
        return True

    def _split_head(self, op: PrefetchOp, take: int) -> int:
        """Cut the first pages of what the op would read off to compute (head_split.py): the op
        then starts past them. Returns the pages cut (0: no split)."""
        read = self._rate("read_bps")
        read_tps = None if read is None else read / self.host.token_bytes
        head = head_split_pages(take, self.page,
                                self._rate("head_tps") or self._rate("prefill_tps"), read_tps)
        if head:
            op.first += head
            op.keys = op.keys[head:]
            op.found -= head
            op.head_end = op.first * self.page
            self.counters["head_splits"] += 1
            self.counters["head_split_tokens"] += head * self.page
        return head

    def _alloc_pinning_path(self, op: PrefetchOp, n: int) -> Optional[torch.Tensor]:
        """n host slots; the request's own host path is pinned while host eviction makes room (its
        pages would be no use without it)."""
        m = self.match_prefix(op.tokens[:op.first * self.page])
        pinned = [x for x in m.lower if x.host_value is not None]
        for x in pinned:
            x.host_ref += 1
        try:
            return self._alloc_host(n)
        finally:
            for x in pinned:
                x.host_ref -= 1

    def _on_read_end(self, op: PrefetchOp, seconds: float, nbytes: int) -> None:
        op.reading = False
        if op.probe:  # its rate is a prior; its slots go back (nothing joins the tree)
            if not op.cancelled and op.landed == op.page_count and seconds > 0:
                self._rate_priors.setdefault("read_bps", nbytes / seconds)
            self._release_to(op, op.page_count)
            self._finish(op)
            return
        pages = nbytes // self.storage.page_bytes if self.storage is not None else 0
        if nbytes and seconds > 0:
            self._read_bps = _ema(self._read_bps, nbytes / seconds)
        self.counters["pages_loaded"] += pages
        self.counters["bytes_storage_to_host"] += nbytes
        if not op.cancelled and op.landed < op.page_count:  # a page failed to read
            self.counters["storage_load_failures"] += 1
            if op.storage is self.storage:
                self._forget_stored(op.tokens, op.landed_end)
        if op.cancelled:
            self._release_to(op, op.page_count)
        else:  # the pages that did not land were never written: free them now
            tail = op.slots[op.landed * self.page:]
            self._pages_held -= op.page_count - op.landed
            op.slots = op.slots[:op.landed * self.page]
            self._free_host(tail)
        self._finish(op)

    # --- admission -------------------------------------------------------------------------------
    def prefetch_ready(self, op: Optional[PrefetchOp]) -> bool:
        """Whether a request with this prefetch may be admitted now (see the policies above)."""
        if op is None or op.done or op.cancelled or self.prefetch_policy == "best_effort":
            return True
        if op.head_pending:  # it goes now to compute its head, the read going on
            return True
        if self.prefetch_policy == "wait_complete":
            return False
        if time.monotonic() >= op.deadline:
            return True
        if op.head_end:  # a split's tail was cut to be read in the time its head took
            return False
        if not self._storage_pays():  # computing beats reading: do not wait for it
            self.counters["storage_loads_skipped"] += 1
            op.deadline = 0.0  # (counted once)
            return True
        return False

    def adopt_prefetch(self, op: Optional[PrefetchOp]) -> Optional[tuple[int, int]]:
        """Admission: the pages landed so far join the tree as host-resident nodes; the op goes on
        (a request that is not admitted after all keeps its read). Returns the absolute token
        range [lo, hi) the tree took, or None."""
        if (op is None or op.cancelled or op.head_pending or op.landed <= op.released
                or op.storage is not self.storage):
            return None
        return self._adopt(op)

    def take_prefetch(self, op: Optional[PrefetchOp]) -> Optional[tuple[int, int]]:
        """adopt_prefetch, then cancel the rest (the request is admitted)."""
        taken = self.adopt_prefetch(op)
        self.cancel_prefetch(op)
        return taken

    def cancel_prefetch(self, op: Optional[PrefetchOp]) -> None:
        """Stop the op (abort, or taken); free what the reader is done with."""
        if op is None or op.cancelled:
            return
        op.cancelled = True
        if op.staged:
            self._staged.remove(op)
            op.staged = False
        if op.slots is not None:  # a running read may still write pages past `landed`
            self._release_to(op, op.landed if op.reading else op.page_count)
        if not op.reading and op.found is not None:
            self._finish(op)

    def _adopt(self, op: PrefetchOp) -> Optional[tuple[int, int]]:
        """Give the tree the op's landed, unreleased pages: positions [lo, hi) of op.tokens. The
        part below the path's current device + host end is redundant (freed); from there the
        storage-only nodes take host copies and a new host node holds what lies past the tree."""
        page = self.page
        lo, hi = (op.first + op.released) * page, op.landed_end
        slots = op.slots[op.released * page:op.landed * page]  # (hi - lo,)
        tokens, tick = op.tokens[:hi], self._tick()
        node, pos = self.root, 0
        while pos < hi:  # the device + host part of the path (every path reads D* H* S*)
            child = self._descend(node, tokens, pos, tick)
            if child is None or (child.value is None and child.host_value is None):
                break
            node, pos = child, pos + len(child.key)
        if not lo <= pos < hi:  # a gap before the pages (the path lost its host copy), or none
            self._release_to(op, op.landed)
            return None
        self._free_host(slots[:pos - lo])
        while pos < hi:
            child = self._descend(node, tokens, pos, tick)
            if child is None:  # past the tree: one new host node (its pages are stored)
                child = type(self.root)(tokens[pos:], None, node, pos)
                child.storage_len, child.last_access = hi - pos, tick
                node.children[tokens[pos]] = child
            else:  # below the device + host part a path is storage-only
                self._store_tokens -= len(child.key)
            n = len(child.key)
            child.host_value = slots[pos - lo:pos - lo + n]
            self._host_tokens += n
            self._sync(child)
            self._sync(node)
            node, pos = child, pos + n
        self._pages_held -= op.landed - op.released
        op.released = op.landed
        return lo, hi

    # --- bookkeeping -----------------------------------------------------------------------------
    def _release_to(self, op: PrefetchOp, pages: int) -> None:
        """Free the op's slots of pages [released, pages)."""
        if pages > op.released:
            self._free_host(op.slots[op.released * self.page:pages * self.page])
            self._pages_held -= pages - op.released
            op.released = pages

    def _finish(self, op: PrefetchOp) -> None:
        op.done = True
        if op.slots is None or op.released * self.page >= op.slots.numel():
            self._ops.discard(op)

    def _forget_stored(self, tokens: tuple, pos: int) -> None:
        """The store has no valid page at position pos of `tokens`: drop the path's storage-only
        nodes from there on (the tree's index of the store must not point at it)."""
        node, p = self.root, 0
        while p < len(tokens):
            child = node.children.get(tokens[p])
            if child is None or tokens[p:p + len(child.key)] != child.key:
                return
            end = p + len(child.key)
            stored_only = (child.value is None and child.host_value is None)
            if end > pos and stored_only and not child.host_ref:
                if p < pos:
                    self._split(child, pos - p)  # `child` keeps the part from pos on
                self._drop_subtree(child)
                return
            node, p = child, end

    def prefetch_held_slots(self) -> torch.Tensor:
        held = [op.slots[op.released * self.page:] for op in self._ops if op.slots is not None]
        return torch.cat(held) if held else torch.empty(0, dtype=torch.int64)

    def drain_prefetch(self) -> None:
        """Cancel every op and wait for the reader (reset, flush, shutdown)."""
        if self.reader is None:
            return
        for op in list(self._ops):
            self.cancel_prefetch(op)
        self.reader.drain()
        self.apply_prefetch_news(release=False)

    def prefetch_stats(self) -> dict:
        return {"policy": self.prefetch_policy, "capacity_pages": self.prefetch_pages,
                "held_pages": self._pages_held, "pending_lookups": self._lookups,
                "ops": len(self._ops),
                "read_errors": 0 if self.reader is None else self.reader.read_errors}

