"""Compute the head, read the tail (mem_cache/head_split.py), the scheduler's side (a mixin of
Scheduler).

A split request (its prefetch's lookup found pages while the GPU had nothing else to do, and the
tree cache cut the first of them off to compute) is admitted at once with its extend ending at
the head's end (prefill.py), in the plain order (overlap_extend `_plain`: its next move depends
on the step). Once its head is computed it goes back to the front of the queue (`_park`): no row,
its head's node locked, so the tail read meanwhile finds the path it hangs below, and the head
cannot be evicted while the forward that writes it may still run. The read's landed pages then
stream to the device like any prefetch's (waiting.py), and the request is admitted as usual once
the read has ended; the tokens its head computed do not count as cached (cached_tokens,
cached_tokens_details).

The head's forward is timed with CUDA events, read once they have completed (no sync): the rate
the next split is cut by. So is any extend that is as a head (`_head_like`), on the plain step's
path and on the overlapped one (overlap_extend), so that the first split has a head's rate.
"""

from __future__ import annotations

from radixlm.runtime.mem_cache import head_split
from radixlm.runtime.request import Req
from radixlm.runtime.scheduler.overlap_extend import GpuTiming


class SplitHeads:
    def _init_split_heads(self) -> None:
        self._head_timings: list = []  # (tokens, GpuTiming, t0) of head forwards not yet read

    def _may_split(self, req: Req) -> bool:
        """Whether the request may compute the head of its stored prefix while the rest is read:
        a plain prompt (no images, embeddings or prompt logprobs, which its second admission
        would not see again), no speculation (its draft model's KV of the head) and no
        disaggregation."""
        return (self.spec is None and self.pd is None and req.mm is None
                and not req.embed_pooling and not req.wants_input_logprobs)

    def _gpu_idle(self) -> bool:
        """Nothing wants the GPU now: no running batch, chunk or step in flight, and every
        waiting request waits for its prefetch (which a split would put to work)."""
        return (not self.running and self.chunked is None and self.inflight is None
                and all(r.prefetch is not None for r in self.waiting))

    def _time_head(self, reqs: list[Req], tail: list[Req]):
        """The timer of the plain step's extend when it computes a head or is as one (None
        otherwise); stopped by `_head_timed`."""
        return GpuTiming(self.device) if _is_head(reqs, tail) else None

    def _head_timed(self, reqs: list[Req], timing, t0: float) -> None:
        if timing is not None:
            timing.stop()
            self._note_head(reqs, timing, t0)

    def _head_like_timed(self, reqs: list[Req], tail: list[Req], timing, t0: float) -> None:
        """An overlapped extend's forward (overlap_extend), timed and stopped: a head's rate
        sample if it is as one."""
        if self.tiered and _is_head(reqs, tail):
            self._note_head(reqs, timing, t0)

    def _note_head(self, reqs: list[Req], timing, t0: float) -> None:
        self._head_timings.append((sum(r.extend_len for r in reqs), timing, t0))

    def _observe_heads(self) -> None:
        """Give the tree cache the rates of head forwards that have completed."""
        pending = []
        for tokens, timing, t0 in self._head_timings:
            if timing.done():
                self.tree_cache.observe_head(tokens, timing.seconds(t0))
            else:
                pending.append((tokens, timing, t0))
        self._head_timings = pending

    def _park(self, req: Req) -> None:
        """A split request has computed its head (its last chunk's KV just entered the tree,
        locked for it): back to the front of the queue, holding that lock (not a row) until a
        round admits it with the rest of its prefix read from the store."""
        node = req.last_node
        self.req_pool.free(req.req_pool_idx)
        req.reset_for_retract(count=False)
        req.parked, req.match = node, None
        req.prefetch.head_done = True
        self.waiting.insert(0, req)


def _is_head(reqs: list[Req], tail: list[Req]) -> bool:
    """An extend whose rate is a head's: one that computes a split's head, or `_head_like`."""
    return any(r.computing_head for r in reqs) or _head_like(reqs, tail)


def _head_like(reqs: list[Req], tail: list[Req]) -> bool:
    """An extend that computes what a split's head would: one prompt from its first token, at
    least MIN_HEAD_TOKENS of it, no decode rows beside it. Its rate is the head rate's sample
    where no head has been split yet (a new conversation's prompt, a long prompt's first
    chunk), so that the first split after a start is cut by a head's rate, not by the mean of
    every extend (~2.6x lower on the H200: 13.7k against 35-37k tokens/s)."""
    return (len(reqs) == 1 and not tail and len(reqs[0].prefix_indices) == 0
            and reqs[0].extend_len >= head_split.MIN_HEAD_TOKENS)
