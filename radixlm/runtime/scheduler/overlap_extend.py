"""Extends inside the overlap schedule (a mixin of Scheduler): while decode step N is on the GPU,
admit the waiting requests, launch the mixed extend (their prefill, and one decode row of every
running request, chained onto step N's samples on the device), and only then complete step N.
The extend's samples come back like a decode step's (overlap.InFlightDecode): the next step
chains its decode (or another extend) onto them and completes the extend while that runs. A
plain step's extend (nothing in flight before it) is left in flight the same way.

Why: with admission after completion (the plain order) the GPU idled around every extend: step N
completed, then the admission round (matches, loads, evictions; ~15 ms of the scheduler's time
per round on an H200 host with 32 requests waiting), the batch's build, the extend's forward and
the host sync on its samples, then the next decode's launch. A multi-turn run with the
hierarchical cache (120 conversations x 8 turns, 32 in flight, 113 extends) spent ~6 s of its
~24 s so (benchmarks/probes/multiturn_profile.py). With this, 23.4 -> 22.2 s (H200, the code
before in the same call; docs/hicache.md).

Same results as the plain order (tests/unit/test_overlap_extend.py): admission sees the in-flight
step's requests as running (their reserve kept, their slots held): a little more conservative,
never over budget. A request that finishes at step N has had a row in the extend (its token is
dropped when the extend completes, as for chained decodes, overlap.py); one that surely finishes
at step N is left out. A chunked prompt's chunks follow one another the same way (each chunk's
KV enters the tree at its launch; before, every chunk after the first waited for the step in
flight: a long prompt joining a decoding batch left the GPU idle between its chunks). Only where
nothing in the step needs the host before the next launch: not with speculation,
disaggregation, a grammar, prompt logprobs, embeddings, images or token_ids_logprob, nor with
mixed batches off; those take the plain order.
"""

from __future__ import annotations

import time
from typing import Optional

import torch

from radixlm.runtime.executor.host_staging import staged
from radixlm.runtime.request import Req
from radixlm.runtime.scheduler.batch_builder import as_decode, build_extend
from radixlm.runtime.scheduler.overlap import (InFlightDecode, chained_input_ids, start_host_copy,
                                               surely_finishes)
from radixlm.runtime.scheduler.prefill import admission_budget


def _plain(req: Req) -> bool:
    """Nothing of this request's extend needs the host before the next step's launch."""
    return (req.mm is None and not req.embed_pooling and not req.wants_input_logprobs
            and req.grammar_future is None and req.grammar is None and not req.token_ids_logprob
            and not req.computing_head)


class OverlapExtend:
    def _extends_may_overlap(self, reqs: list[Req]) -> bool:
        """Overlap on, no speculation or disaggregation, a running batch that may overlap, and
        nothing of `reqs`' extend needed on the host before the next launch."""
        return (self.overlap and self.spec is None and self.pd is None and self._overlappable()
                and all(_plain(r) for r in reqs))

    def _extend_beside_ok(self) -> bool:
        """Whether the next extend may be launched before the step in flight completes: a
        chunked prompt's next chunk (its earlier chunks' KV is in the tree, their slots known
        on the host: nothing waits for the step in flight), or waiting requests to admit."""
        if self.args.disable_mixed_batch:
            return False
        if self.chunked is not None:  # (the round may admit waiting requests after the chunk)
            return self._extends_may_overlap(self.waiting + [self.chunked])
        return self._extends_may_overlap(self.waiting) and self._admission_pending()

    def _launch_extend_beside(self, prev: InFlightDecode) -> Optional[InFlightDecode]:
        """Admit and launch a mixed extend chained onto `prev` (not completed yet); when the
        round admits nothing (no memory for any: a saturated server), the running batch's
        chained decode instead. None when nothing was launched (no room for the running rows;
        nothing admitted and none running) or nothing of it samples (its requests failed, or
        all are chunks): the caller completes `prev`, then the plain step runs."""
        tail = self._chain_rows()  # the running rows that decode in the extend (running == tail)
        if tail is None:
            return None
        admitted = []
        if not self._admission_blocked():
            # (a host prefix's copy starts after the launch, beside it: _step_or_chain)
            admitted = self._admit(
                start_loads=not (self.tiered and self.tree_cache.mover.loads_async))
            if not admitted:
                self._note_blocked_admission()
        ids = chained_input_ids(prev, tail) if tail else None
        if not admitted:  # before, a plain step: prev completed first, the admission run again
            return self._launch_decode(tail, ids) if tail else None
        self._blocked = None
        return self._launch_extend(admitted, tail, ids)

    def _budget(self) -> int:
        return admission_budget(self.tree_cache, self.allocator, self.running,
                                self.new_token_ratio)

    def _note_blocked_admission(self) -> None:
        """A round before a launch admitted nothing for want of memory: remember the queue and
        the budget its first request needed, when every waiting request was ready (no copy,
        read or grammar pending), so that the next steps skip the round until the queue
        changes or the budget reaches that (a request finished)."""
        if self._short_of is not None and all(
                r.preload is None and r.prefetch is None and r.grammar_future is None
                for r in self.waiting):
            self._blocked = (tuple(r.rid for r in self.waiting), self._budget() + self._short_of)

    def _admission_blocked(self) -> bool:
        """The same queue as at a round that admitted nothing, still short of the budget it
        needed: it would admit nothing again (a saturated server with a long queue matched
        every waiting request every step, ~0.1 ms each, before each chained launch)."""
        blocked = self._blocked
        if blocked is None:
            return False
        if blocked[0] != tuple(r.rid for r in self.waiting) or self._budget() >= blocked[1]:
            self._blocked = None
            return False
        return True

    def _extend_async_ok(self, admitted: list[Req], mixed: bool) -> bool:
        """Whether a plain step's extend of `admitted` may stay in flight (completed by the next
        step, after it launches its own): the same conditions, with the running requests'
        tokens on the host (nothing in flight)."""
        return (mixed or not self.running) and self._extends_may_overlap(admitted)

    def _launch_extend(self, admitted: list[Req], tail: list[Req],
                       tail_ids: Optional[torch.Tensor]) -> Optional[InFlightDecode]:
        """Launch the extend of `admitted` with one decode row of each of `tail` (== the running
        batch), their tokens `tail_ids` on the device (chained) or, None, on the host; sample it
        and start the host copy of its samples. None when nothing of it samples."""
        t0 = time.perf_counter()
        self._count_prompt_stats(admitted)
        for req in tail:
            req.extend_len = 1
        fb, rows = build_extend(admitted + tail, self.req_pool, self.allocator, self.tree_cache,
                                self.device, tail_ids=tail_ids)
        fb.num_decode_tail = len(tail)
        fb = as_decode(fb, rows, admitted + tail)
        timing = GpuTiming(self.device)
        logits = self._forward_or_oom(fb, admitted + tail)  # (N, vocab)
        if logits is None:  # a CUDA OOM failed the batch (step() reports it)
            return None
        timing.stop()
        self._head_like_timed(admitted, tail, timing, t0)
        self.stats["forward_steps"] += 1
        self.stats["extend_steps"] += 1
        self.stats["overlapped_extend_steps"] += 1
        for req in admitted + tail:
            req.kv_len += req.extend_len
        for req in admitted:
            if req.is_chunked:
                self.tree_cache.cache_unfinished_req(req, req.fill_ids[: req.kv_len])
                self.chunked = req
        n_new = len(rows.sample_reqs) - len(tail)
        joining, join_rows = rows.sample_reqs[:n_new], rows.sample_rows[:n_new]
        if joining:
            info, joining, join_rows = self._sampling_info(joining, join_rows)
            if joining:  # their prompt KV is shared now, as a request's that joins does
                for req in joining:
                    self.tree_cache.cache_unfinished_req(req, req.fill_ids[: req.kv_len])
                self._merge_running(joining, info)
        if not self.running:
            return None
        reqs = list(self.running)  # tail + joining, the rows below in that order
        picked = logits[staged(rows.sample_rows[n_new:] + join_rows, self.device)]
        out = self._sample(picked, self.running_info, reqs)
        if out is None:  # a CUDA OOM failed them (step() reports them)
            return None
        step = start_host_copy(reqs, out)
        prefill = sum(r.extend_len for r in admitted)
        step.on_complete = lambda: self._observe_prefill(prefill, timing, t0)
        return step

    def _chain_rows(self) -> Optional[list[Req]]:
        """The running requests that take a row in the step launched before the one in flight
        completes (those that surely finish in it leave the batch now), with a free slot each
        (evicting); None when there are not enough slots without retraction."""
        chain = [r for r in self.running if not surely_finishes(r, self.context_len)]
        if chain and self.allocator.available_size() < len(chain):
            self.tree_cache.evict(len(chain) - self.allocator.available_size())
            if self.allocator.available_size() < len(chain):
                return None
        if len(chain) != len(self.running):  # their last token is in flight: leave the batch now
            staying = {id(r) for r in chain}
            self._drop_from_running({id(r) for r in self.running if id(r) not in staying})
        return chain

    def _count_prompt_stats(self, reqs: list[Req]) -> None:
        for req in reqs:
            if (req.req_pool_idx is None and req.retractions == 0 and not req.output_ids
                    and not req.computing_head):
                # (a split request counts at its second admission; what its head computed is
                # not cached: split_heads.py. Then forgotten: a later re-admission, after a
                # retraction or a jump forward, computed no head)
                req.cached_tokens = req.kv_len - req.head_tokens
                req.head_tokens, req.head_details = 0, None
                self.stats["prompt_tokens"] += len(req.origin_input_ids)
                self.stats["cached_tokens"] += req.cached_tokens

    def _observe_prefill(self, tokens: int, timing: "GpuTiming", t0: float) -> None:
        """Completion of an overlapped extend: its prefill rate, for the hierarchical cache's
        choice between reading a prefix from the store and recomputing it."""
        if self.tiered:
            self.tree_cache.observe_prefill(tokens, timing.seconds(t0))


class GpuTiming:
    """The extend's forward time: CUDA events around it (read once its samples are on the host,
    so no sync of its own); elsewhere the host's clock, the forward being synchronous there."""

    def __init__(self, device: torch.device):
        self.events = None
        if device.type == "cuda":
            self.events = (torch.cuda.Event(enable_timing=True),
                           torch.cuda.Event(enable_timing=True))
            self.events[0].record()
        self.t_end = None

    def stop(self) -> None:
        if self.events is not None:
            self.events[1].record()
        self.t_end = time.perf_counter()

    def done(self) -> bool:
        """Whether seconds() may be read without waiting (its end event has completed)."""
        return self.events is None or self.events[1].query()

    def seconds(self, t0: float) -> float:
        if self.events is not None:
            return self.events[0].elapsed_time(self.events[1]) / 1e3
        return self.t_end - t0
