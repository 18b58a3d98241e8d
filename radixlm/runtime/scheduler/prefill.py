"""Admission of waiting requests into an extend (prefill) batch.

Budget, in KV slots: free + evictable tokens, minus what the running requests will still need
(`min(remaining_new_tokens, CLIP) * new_token_ratio` each). A request is admitted when its whole
remaining prompt plus its own reserve fits; it is then computed this step, or, past the per-step
token budget (`chunked_prefill_size`, `max_prefill_tokens`), in chunks over several steps.

The matched prefix is locked as soon as a request is considered, so evictions made for later
requests in the same round cannot take it; a request that is not admitted is unlocked again.
"""

from __future__ import annotations

import enum
import math

from radixlm.runtime.request import Req
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


class PrefillAdder:
    def __init__(self, tree_cache, allocator, running: list[Req], new_token_ratio: float,
                 max_prefill_tokens: int, chunked_prefill_size: int):
        self.tree_cache = tree_cache
        self.ratio = new_token_ratio
        self.rem_total = (allocator.available_size() + tree_cache.evictable_size()
                          - sum(reserved_decode_tokens(r, new_token_ratio) for r in running))
        self.rem_step = max_prefill_tokens
        if chunked_prefill_size > 0:
            self.rem_step = min(self.rem_step, chunked_prefill_size)
        self.chunking = chunked_prefill_size > 0
        self.admitted: list[Req] = []

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
        return self._take(req, req.seqlen - req.kv_len)

    def add(self, req: Req) -> AddResult:
        if self.rem_step <= 0:
            return AddResult.NO_COMPUTE
        if req.match is None:
            req.match = self.tree_cache.match_prefix(req.fill_ids[: match_len_cap(req)])
        slots, node = req.match
        if self._shares_prefix_with_admitted(req, len(slots)):
            return AddResult.DEFERRED
        self._lock(node)
        req.prefix_indices, req.last_node = slots, node
        req.kv_len = len(slots)
        result = self._take(req, req.seqlen - len(slots))
        if result != AddResult.ADDED:
            self._unlock(node)
            req.prefix_indices, req.last_node, req.kv_len = slots[:0], None, 0
        return result

    def _take(self, req: Req, remaining: int) -> AddResult:
        need = remaining + reserved_decode_tokens(req, self.ratio)
        if need > self.rem_total:
            return AddResult.NO_MEMORY
        if remaining > self.rem_step and not self.chunking and self.admitted:
            return AddResult.NO_COMPUTE  # an unchunked long prompt runs alone in its own step
        ext = remaining if not self.chunking else min(remaining, self.rem_step)
        req.extend_len = ext
        req.is_chunked = ext < remaining
        # only what is allocated now leaves the budget for good; the rest of a chunked prompt
        # and the decode reserve stay counted so later admissions cannot take them
        self.rem_total -= need
        self.rem_step -= ext
        self.admitted.append(req)
        return AddResult.ADDED
