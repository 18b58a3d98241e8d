"""Admission of waiting requests into an extend (prefill) batch.

Budget, in KV slots: free + evictable tokens, minus what the running requests will still need
(`min(remaining_new_tokens, CLIP) * new_token_ratio` each). A request is admitted when its whole
remaining prompt plus its own reserve fits; it is then computed this step, or, past the per-step
token budget (`chunked_prefill_size`, `max_prefill_tokens`), in chunks over several steps.

The matched prefix is locked as soon as a request is considered, so evictions made for later
requests in the same round cannot take it; a request that is not admitted is unlocked again.

With the hierarchical cache, what the request's storage prefetch has landed joins the tree as
host nodes first; then the part of the prefix that sits in the host pool is loaded into device
slots when the request is considered (`_load_lower`), before its forward reads it: the loaded
tokens spend the slots their compute would have and none of the step's compute.
On CUDA the load is a preload: its copy runs on the mover's streams beside the forwards queued
after it, and the request waits (it holds the loaded path locked, `req.preload`) until the
copy's event has completed; a later round admits it with its prefix on the device, and the
running requests decode meanwhile. While a batch decodes with overlap the copies start before a
round considers the request (`preload`, called from scheduler.waiting), and a request's pages
landing from the store start theirs while its read goes on (`stream`). Before, the round's forward waited for its loads: a round admitting
many requests with long host prefixes (a wave of turns, 32 x ~230 MB) ran nothing for the ~0.2 s
its copies took (H100, 120 conversations x 8 turns at concurrency 32: TTFT p50 0.29 -> 0.21 s;
throughput unchanged, see docs/hicache.md). Any request whose match reaches a node still being
loaded waits too (`tree.loading`); an abort waits for its copy (`tree.finish_loading`).
"""

from __future__ import annotations

import enum
import math
from typing import Optional

from radixlm.runtime.request import Req
from radixlm.runtime.scheduler.cached_logprobs import serve_cached_input_logprobs
from radixlm.runtime.scheduler.policy import match_len_cap

CLIP_MAX_NEW_TOKENS = 4096  # reserve at most this many future tokens per request
# A request whose cached prefix is short but shares this many more tokens with a request admitted
# in the same round waits one round: next round that prefix is in the cache instead of computed twice.
IN_BATCH_SHARED_PREFIX_MIN = 32


class AddResult(enum.Enum):
    ADDED = 0
    NO_MEMORY = 1  # stop admitting: the budget is spent
    NO_COMPUTE = 2  # stop admitting: the step's token budget is spent
    DEFERRED = 3  # skip this one, keep going


def reserved_decode_tokens(req: Req, ratio: float) -> int:
    return math.ceil(min(req.remaining_new_tokens(), CLIP_MAX_NEW_TOKENS) * ratio)


def admission_budget(tree_cache, allocator, running: list[Req], ratio: float) -> int:
    """KV slots a round may give: free + evictable, minus the running requests' reserves."""
    return (allocator.available_size() + tree_cache.evictable_size()
            - sum(reserved_decode_tokens(r, ratio) for r in running))


class PrefillAdder:
    def __init__(self, tree_cache, allocator, running: list[Req], new_token_ratio: float,
                 max_prefill_tokens: int, chunked_prefill_size: int, start_loads: bool = True):
        """`start_loads` False: a request whose prefix needs a copy from the host is skipped,
        not preloaded (a round run before a launch; the copy starts after it)."""
        self.tree_cache = tree_cache
        self.start_loads = start_loads
        self.allocator = allocator
        self.tiered = getattr(tree_cache, "tiered", False)
        self.ratio = new_token_ratio
        self.rem_total = admission_budget(tree_cache, allocator, running, new_token_ratio)
        self.rem_step = max_prefill_tokens
        if chunked_prefill_size > 0:
            self.rem_step = min(self.rem_step, chunked_prefill_size)
        self.chunking = chunked_prefill_size > 0
        self.admitted: list[Req] = []
        self.short_of: Optional[int] = None  # a NO_MEMORY's need past the budget, in slots

    def _lock(self, node) -> None:
        before = self.tree_cache.evictable_size()
        self.tree_cache.inc_lock_ref(node)
        self.rem_total -= before - self.tree_cache.evictable_size()

    def _unlock(self, node) -> None:
        before = self.tree_cache.evictable_size()
        self.tree_cache.dec_lock_ref(node)
        self.rem_total += self.tree_cache.evictable_size() - before

    def _shares_prefix_with_admitted(self, req: Req, cached: int) -> bool:
        k = cached + IN_BATCH_SHARED_PREFIX_MIN
        if req.seqlen <= k:
            return False
        head = req.fill_ids[:k]
        return any(a.seqlen >= k and a.fill_ids[:k] == head for a in self.admitted)

    def add_chunked(self, req: Req) -> AddResult:
        """Continue a request whose prefill was chunked; its prefix is already locked."""
        return self._take(req, req.seqlen - req.kv_len, _head_left(req, req.kv_len))

    def add(self, req: Req) -> AddResult:
        if self.rem_step <= 0:
            return AddResult.NO_COMPUTE
        if req.preload is not None and self.tree_cache.loading(req.preload[0]):
            return AddResult.DEFERRED  # still copying: not worth a match (it waits anyway)
        if req.prefetch is not None:  # what landed from the store joins the tree (host nodes)
            req.prefetch_range = _union(req.prefetch_range,
                                        self.tree_cache.adopt_prefetch(req.prefetch))
        head = req.computing_head  # a split: only its head now (split_heads.py)
        if req.match is None or self.tiered:  # tiered: this round's loads may have moved KV
            cap = match_len_cap(req, self.tree_cache)
            if head:
                cap = min(cap, req.prefetch.head_end)
            req.match = self.tree_cache.match_prefix(req.fill_ids[:cap])
        slots, node = req.match
        lower = getattr(req.match, "lower_len", 0)
        if head and len(slots) + lower >= req.prefetch.head_end:
            req.prefetch.head_done = True  # the tree has its head now: it waits for the tail
            return AddResult.DEFERRED
        if lower and not self.start_loads and req.preload is None:
            return AddResult.DEFERRED  # its copy starts beside the step about to be launched
        if self._shares_prefix_with_admitted(req, len(slots) + lower):
            return AddResult.DEFERRED
        if self.tiered and self.tree_cache.loading(node):
            return AddResult.DEFERRED  # its prefix is still being copied to the device
        self._lock(node)
        details = None
        if self.tiered:
            slots, node, details = self._load_lower(req, slots, node, keep_prefetch=head)
            if details is None:  # preloading: the request waits for the copy
                return AddResult.DEFERRED
        req.prefix_indices, req.last_node = slots, node
        req.kv_len = len(slots)
        result = self._take(req, req.seqlen - len(slots), _head_left(req, len(slots)))
        if result != AddResult.ADDED:
            self._unlock(node)
            req.prefix_indices, req.last_node, req.kv_len = slots[:0], None, 0
            return result
        if req.preload is not None:  # its lock hands over to the admission's
            details = _preloaded_details(req.preload[1], len(slots))
            self._unlock(req.preload[0])
            req.preload = None
        if req.parked is not None:  # the lock on its head hands over to the admission's
            self._unlock(req.parked)
            req.parked = None
        if head:  # its hits are reported at its second admission, with the tail's
            req.head_tokens, req.head_details = req.prefetch.head_end - len(slots), details
            return result
        serve_cached_input_logprobs(req)
        if req.prefetch is not None:  # admitted: what has not landed is recomputed
            self.tree_cache.cancel_prefetch(req.prefetch)
            req.prefetch = None
        if details is not None and req.head_tokens:
            details = _without_head(details, req.head_tokens, req.head_details)
        if details is not None:
            self.tree_cache.record_hits(details)
            if req.retractions == 0 and not req.output_ids:  # what meta_info reports
                req.cached_tokens_details = details
        return result

    def preload(self, req: Req) -> bool:
        """Start copying a waiting request's host-resident prefix to the device before a round
        admits it, while a forward runs (CUDA; scheduler.waiting `_preload_waiting`): what
        `add` does up to the load, with the same budget, and this request's whole need kept out
        of the budget for the rest of the pass. True when a copy is in flight; a later round
        admits the request once it has landed."""
        if not self.tiered or req.preload is not None or req.prefetch is not None:
            return False
        slots = self._start_load(req)
        if slots is None:
            return False
        self.rem_total -= req.seqlen - len(slots) + reserved_decode_tokens(req, self.ratio)
        return True

    def stream(self, req: Req) -> bool:
        """A waiting request whose pages are still coming from the store: the pages landed so
        far join the tree and their copy to the device starts (a preload below any earlier
        one), while the reader goes on (scheduler.waiting `_stream_prefetched`; asynchronous
        loads only). Admission still waits for the read as the policy says, then adopts and
        loads the rest. True when a copy started."""
        op = req.prefetch
        if op is None or op.cancelled or op.landed <= op.released:
            return False
        req.prefetch_range = _union(req.prefetch_range, self.tree_cache.adopt_prefetch(op))
        return self._start_load(req, keep_prefetch=True) is not None

    def _start_load(self, req: Req, keep_prefetch: bool = False):
        """Match the request again and start the copy of its host-resident part (a preload that
        holds the loaded path locked): the device slots of the prefix then, or None when no copy
        started (nothing to load, the path still loading, no room, or copied already: the CPU's
        loads, after which the path is simply unlocked). A copy below the request's own preload
        still in flight starts at once: the mover's streams run them in order, so its event
        completes after the earlier one's (a stream of landed pages does not wait for the
        previous run's copy: a restart's tail read went ~10 ms past its last page doing so)."""
        req.match = self.tree_cache.match_prefix(req.fill_ids[:match_len_cap(req,
                                                                              self.tree_cache)])
        slots, node = req.match
        own = req.preload is not None and node is req.preload[0]
        if not req.match.lower_len or (self.tree_cache.loading(node) and not own):
            return None
        self._lock(node)
        slots, node, details = self._load_lower(req, slots, node, keep_prefetch)
        if details is not None:
            self._unlock(node)
            return None
        return slots

    def _load_lower(self, req: Req, slots, node, keep_prefetch: bool = False):
        """Load the match's host / storage part into device slots (unless the request cannot be
        admitted anyway); moves the request's lock to the loaded path's end. Returns the new
        (slots, node) and the tokens each tier gave (None while a preload is in flight). A
        preload ends the request's prefetch (what landed is in, the rest is recomputed) unless
        `keep_prefetch` (`stream`: the read goes on)."""
        details = {"device": len(slots), "host": 0, "storage": 0}
        need = req.seqlen - len(slots) + reserved_decode_tokens(req, self.ratio)
        if req.match.lower_len and need <= self.rem_total:
            tree = self.tree_cache
            room = self.allocator.available_size() + tree.evictable_size()
            slots, new_node, details, event = tree.preload_back(req.match, req.prefetch_range)
            if new_node is not node:
                tree.inc_lock_ref(new_node)
                tree.dec_lock_ref(node)
            # the loaded tokens now sit in locked device slots: out of free + evictable
            self.rem_total -= room - (self.allocator.available_size() + tree.evictable_size())
            node = new_node
            if event is not None:  # (CUDA) the copy is in flight: the request keeps the lock
                if req.preload is not None:  # a second load, below its first one
                    details = {k: v + req.preload[1][k] for k, v in details.items()}
                    tree.dec_lock_ref(req.preload[0])
                req.preload = (node, details)
                if req.prefetch is not None and not keep_prefetch:  # what landed is in; the
                    # rest is recomputed
                    tree.cancel_prefetch(req.prefetch)
                    req.prefetch = None
                return slots, node, None
        return slots, node, details

    def _take(self, req: Req, remaining: int, stop: Optional[int] = None) -> AddResult:
        """Admit `req` for its next `remaining` prompt tokens (the budget counts all of them);
        this step computes up to `stop` of them (a split's head) and the step's share."""
        need = remaining + reserved_decode_tokens(req, self.ratio)
        if need > self.rem_total:
            self.short_of = need - self.rem_total
            return AddResult.NO_MEMORY
        want = remaining if stop is None else min(remaining, stop)
        if want > self.rem_step and not self.chunking and self.admitted:
            return AddResult.NO_COMPUTE  # an unchunked long prompt runs alone in its own step
        ext = want if not self.chunking else min(want, self.rem_step)
        req.extend_len = ext
        req.is_chunked = ext < remaining
        # only what is allocated now leaves the budget for good; the rest of a chunked prompt
        # and the decode reserve stay counted so later admissions cannot take them
        self.rem_total -= need
        self.rem_step -= ext
        self.admitted.append(req)
        return AddResult.ADDED


def _preloaded_details(loaded: dict, total: int) -> dict:
    """A preloaded request's hits by tier: those of its load, with the device's grown to the
    prefix matched at admission (`total` tokens)."""
    out = dict(loaded)
    out["device"] = max(0, total - out["host"] - out["storage"])
    return out


def _head_left(req: Req, computed: int) -> Optional[int]:
    """Tokens of a split request's head still to compute past `computed` (None: no head)."""
    return req.prefetch.head_end - computed if req.computing_head else None


def _without_head(details: dict, head_tokens: int, first: Optional[dict]) -> dict:
    """A split request's hits at its second admission: its first admission's (the prefix it had
    before its head, now all on the device) and its tail's; the head it computed is no hit."""
    first = first or {"device": 0, "host": 0, "storage": 0}
    return {"device": max(0, details["device"] - head_tokens - first["host"] - first["storage"]),
            "host": details["host"] + first["host"],
            "storage": details["storage"] + first["storage"]}


def _union(a, b):
    """The span of two token ranges [lo, hi) (either may be None)."""
    if a is None or b is None:
        return a or b
    return min(a[0], b[0]), max(a[1], b[1])
