"""The scheduler: continuous batching over a RadixCache-backed KV pool.

One `step()`:  schedule (an extend batch if any waiting request fits, else a decode batch of all
running requests) -> one model forward -> sample -> process outputs (finish, cache, free).

Request states:  waiting --admit--> [chunked] --last chunk--> running --finish--> done
                     ^------------------- retract (decode ran out of KV) ------------|
Invariant (checked by `check_integrity`): free slots + slots in the tree + slots owned by requests
== capacity, and every slot is in exactly one of those places.
"""

from __future__ import annotations

import logging
import time
from typing import Optional

import torch

from radixlm.runtime import speculative
from radixlm.runtime.attention.shared_prefix import PrefixGrouper
from radixlm.runtime.config import resolve_chunked_prefill_size
from radixlm.runtime.constrained.grammar import GrammarCompilerPool, MaskBuffer
from radixlm.runtime.executor.host_staging import staged
from radixlm.runtime.mem_cache.hicache_config import make_tree_cache
from radixlm.runtime.request import Finish, FinishReason, Req
from radixlm.runtime.sampling.sampler import Sampler
from radixlm.runtime.sampling.sampling_batch_info import SamplingBatchInfo
from radixlm.runtime.scheduler import decode
from radixlm.runtime.scheduler.batch_builder import as_decode, build_extend
from radixlm.runtime.scheduler.decode_steps import DecodeSteps
from radixlm.runtime.scheduler.isolation import FaultIsolation
from radixlm.runtime.scheduler.maintenance import Maintenance
from radixlm.runtime.scheduler.output import record_embeddings
from radixlm.runtime.scheduler.overlap import InFlightDecode, chained_input_ids, surely_finishes
from radixlm.runtime.scheduler.overlap_extend import OverlapExtend
from radixlm.runtime.scheduler.policy import order_waiting
from radixlm.runtime.scheduler.prefill import AddResult, PrefillAdder
from radixlm.runtime.scheduler.split_heads import SplitHeads
from radixlm.runtime.scheduler.token_processing import TokenProcessing
from radixlm.runtime.scheduler.waiting import WaitingQueue

logger = logging.getLogger(__name__)


class Scheduler(DecodeSteps, OverlapExtend, TokenProcessing, Maintenance, WaitingQueue,
                SplitHeads, FaultIsolation):
    def __init__(self, args, runner, tokenizer=None):
        self.args = args
        self.runner = runner
        self.tokenizer = tokenizer
        self.device = runner.device
        self.vocab_size = runner.model_config.vocab_size
        self.context_len = runner.context_len
        self.chunked_prefill_size = resolve_chunked_prefill_size(args.chunked_prefill_size,
                                                                 runner.device)
        self.allocator = runner.allocator
        self.req_pool = runner.req_to_token_pool
        self.tree_cache = make_tree_cache(args, runner)  # RadixCache, or HiRadixCache's tiers
        self.tiered = getattr(self.tree_cache, "tiered", False)
        self.sampler = Sampler()
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.running_info: Optional[SamplingBatchInfo] = None
        self.chunked: Optional[Req] = None
        self.new_token_ratio = decode.INIT_NEW_TOKEN_RATIO * args.schedule_conservativeness
        self.grammars: Optional[GrammarCompilerPool] = None  # created on the first constraint
        self.masks = MaskBuffer(self.vocab_size)
        self.prefix_grouper: Optional[PrefixGrouper] = None
        if (not args.disable_shared_prefix_attention and not args.disable_radix_cache
                and getattr(runner.attn_backend, "supports_shared_prefix", False)):
            self.prefix_grouper = PrefixGrouper(self.device)
        self.inflight: Optional[InFlightDecode] = None  # a launched decode step not yet completed
        # a round that admitted nothing for want of memory: (the queue, the budget it needs;
        # overlap_extend.py skips rounds until either changes), and that round's shortfall
        self._blocked: Optional[tuple] = None
        self._short_of: Optional[int] = None
        self._deferred: list[Req] = []  # requests completed outside step(), reported by the next
        self._failed: list[Req] = []  # failed during this step (isolation.py); step() sweeps them
        self._init_split_heads()
        self.stats = {"prompt_tokens": 0, "cached_tokens": 0, "generated_tokens": 0,
                      "retractions": 0, "forward_steps": 0, "extend_steps": 0,
                      "overlapped_extend_steps": 0,  # left in flight (overlap_extend.py)
                      "jump_forward_tokens": 0, "shared_prefix_steps": 0,
                      "request_failures": 0, "oom_steps": 0,  # isolation.py
                      "busy_s": 0.0}  # wall time inside step(): busy_s / elapsed = saturation
        # speculative decoding (runtime/speculative): drafts verified in one forward per step
        self.spec = speculative.create(args, self)
        # overlap schedule (see overlap.py): on CUDA unless disabled; on the CPU nothing runs
        # asynchronously, so it would only waste the rows of finishing requests. With
        # speculation only for steps that verify nothing: drafts need the previous step's tokens
        # on the host (the speculator's wants_verify says which steps those are)
        self.overlap = not args.disable_overlap_schedule and self.device.type == "cuda"
        # disaggregation: pd_prefill.PrefillSide or pd_decode.DecodeSide, set by the server
        self.pd = None

    # --- requests in and out --------------------------------------------------------------------
    def abort_request(self, rid: str) -> Optional[Req]:
        """Finish `rid` with reason abort and release its KV. Returns the request if found."""
        self._settle()
        for queue in (self.waiting, self.running):
            for i, req in enumerate(queue):
                if req.rid == rid:
                    queue.pop(i)
                    self._drop_prefetch(req)
                    if queue is self.running:
                        self._filter_running_info(keep=[r for r in self.running])
                    self._finish(req, Finish(FinishReason.ABORT, message="aborted by request"))
                    return req
        if self.chunked is not None and self.chunked.rid == rid:
            req, self.chunked = self.chunked, None
            self._drop_prefetch(req)  # (a split's head in chunks: its read goes on until now)
            self._finish(req, Finish(FinishReason.ABORT, message="aborted by request"))
            return req
        return None

    def is_idle(self) -> bool:
        return not (self.waiting or self.running or self.chunked or self.inflight
                    or self._deferred or self._failed or (self.pd is not None and self.pd.busy()))

    # --- one step -------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[Req]:
        """Run one batch. Returns the requests that produced tokens or finished in this step."""
        t0 = time.perf_counter()
        try:
            done = self._step_or_chain()
            done = self._sweep_failed(done) if self._failed else done
            # once each: with overlap and mixed batches, a request can both complete the step in
            # flight and decode in this step's extend. Listed twice, a request that finished had
            # its update sent twice, the second (after its sent count was dropped) with every
            # output id again: the client got them twice (completion_tokens up to 2x)
            return list({id(r): r for r in done}.values())
        finally:
            self.stats["busy_s"] += time.perf_counter() - t0

    def _step_or_chain(self) -> list[Req]:
        done, self._deferred = self._deferred, []
        if self.tiered:  # page writes and prefetch reads since the last step: applied now
            self.tree_cache.settle_page_writes(release=False)
            self.tree_cache.apply_prefetch_news(release=False, idle=self._gpu_idle())
        if self.inflight is not None:
            prev, self.inflight = self.inflight, None
            chain = self._chainable()
            if chain:  # launch step N+1 first, then do step N's CPU work while the GPU runs
                # (None after an OOM: the chain's requests failed; N's rows of them are dropped)
                self.inflight = self._launch_decode(chain, chained_input_ids(prev, chain))
            elif self._extend_beside_ok():  # admit and launch the extend first (overlap_extend)
                self.inflight = self._launch_extend_beside(prev)
            if self.tiered and self.waiting and self.inflight is not None:  # beside the launch
                self._stream_prefetched()
                self._preload_waiting()
            done += self._complete_decode(prev)
            if self.inflight is not None:
                if self.spec is not None:  # the GPU runs the next step: host work is free now
                    self.spec.idle_work(self)
                return done
        return done + self._step()

    def _settle(self) -> None:
        """Complete the step in flight now (before an out-of-band change to the batch)."""
        if self.inflight is not None:
            prev, self.inflight = self.inflight, None
            self._deferred += self._complete_decode(prev)

    def _chainable(self) -> list[Req]:
        """The running requests to launch the next decode step for before completing the one in
        flight, or [] when chaining could change a result (see overlap.py)."""
        if not self.overlap or self.chunked:
            return []
        if self._admission_pending():
            return []
        if not self._overlappable():
            return []
        if self.spec is not None and self.spec.wants_verify(self):
            return []
        if all(surely_finishes(r, self.context_len) for r in self.running):
            return []
        return self._chain_rows() or []

    def _overlappable(self) -> bool:
        """Whether the running batch may decode with overlap: not with a grammar (the next mask
        needs this step's token) nor with token_ids_logprob (read from logits the in-flight step
        does not keep)."""
        return not any(r.grammar is not None or r.token_ids_logprob for r in self.running)

    def _step(self) -> list[Req]:
        if self.tiered:  # no forward in flight: CUDA DMA lands, page writes and reads can start
            self.tree_cache.settle_page_writes(release=True)
            self.tree_cache.apply_prefetch_news(release=True, idle=self._gpu_idle())
            self._observe_heads()
            if self.waiting:
                self._stream_prefetched()
        mixed = bool(self.running) and not self.args.disable_mixed_batch
        aborted = []
        if mixed:  # the running requests decode in this step whatever it admits: room first
            aborted = [r for r in decode.ensure_decode_memory(self) if r.finished]
            mixed = bool(self.running)
        admitted = self._admit()
        failed = [r for r in self.waiting if r.finished]  # e.g. a grammar that failed to compile
        if failed:
            self.waiting = [r for r in self.waiting if not r.finished]
            for req in failed:
                self._drop_prefetch(req)
        if admitted:
            if self._extend_async_ok(admitted, mixed):  # in flight until the next step
                self.inflight = self._launch_extend(admitted, list(self.running) if mixed
                                                    else [], None)
                return failed + aborted
            return self._run_extend(admitted, mixed) + failed + aborted
        if self.running:
            return self._run_decode() + failed + aborted
        return failed + aborted

    def _admit(self, start_loads: bool = True) -> list[Req]:
        """A round of admission (prefill.py). `start_loads` False: requests whose prefix must
        first be copied from the host are left for `_preload_waiting` (a round run before a
        launch: their copies start after it, beside the step)."""
        self._short_of = None
        if not self.waiting and self.chunked is None:
            return []
        if len(self.running) >= self.args.max_running_requests and self.chunked is None:
            return []
        adder = PrefillAdder(self.tree_cache, self.allocator, self.running, self.new_token_ratio,
                             self.args.max_prefill_tokens, self.chunked_prefill_size,
                             start_loads)
        if self.chunked is not None:
            if adder.add_chunked(self.chunked) != AddResult.ADDED:
                return []
            self.chunked = None
        slots_left = min(self.args.max_running_requests - len(self.running),
                         self.req_pool.available_size()) - len(adder.admitted)
        ready = [r for r in self.waiting if self._grammar_ready(r) and self._prefetch_ready(r)]
        for req in order_waiting(ready, self.args.schedule_policy, self.tree_cache):
            if slots_left <= 0:
                break
            result = adder.add(req)
            if result == AddResult.ADDED:
                slots_left -= 1
                if req.is_chunked:
                    break  # a chunked request closes the batch
            elif result != AddResult.DEFERRED:
                break
        self._short_of = adder.short_of if not adder.admitted else None
        admitted_ids = {id(r) for r in adder.admitted}
        if self.pd is not None:  # their own prefix locks now hold what the hand-off locked
            for req in adder.admitted:
                self.pd.release_wait_lock(req)
        self.waiting = [r for r in self.waiting if id(r) not in admitted_ids]
        for req in self.waiting:
            req.match = None  # stale once the tree changes
        return adder.admitted

    def _run_extend(self, reqs: list[Req], mixed: bool = False) -> list[Req]:
        """Prefill `reqs`; with `mixed`, the running requests decode in the same forward (as
        one-token extends placed last, so the backend can batch them as a decode)."""
        self._count_prompt_stats(reqs)
        reqs = self._encode_images(reqs)  # per request: a failing image fails only its own
        decoding = list(self.running) if mixed else []
        if not reqs and not decoding:
            return []
        for req in decoding:
            req.extend_len = 1
        t0 = time.perf_counter()
        timing = self._time_head(reqs, decoding) if self.tiered else None
        fb, rows = build_extend(reqs + decoding, self.req_pool, self.allocator, self.tree_cache,
                                self.device)
        fb.num_decode_tail = len(decoding)
        fb = as_decode(fb, rows, reqs + decoding)
        logits = self._forward_or_oom(fb, reqs + decoding)  # (N, vocab)
        if logits is None:  # a CUDA OOM failed the batch (step() reports it)
            return []
        self._head_timed(reqs, timing, t0)
        self.stats["forward_steps"] += 1
        self.stats["extend_steps"] += 1
        for req in reqs + decoding:
            req.kv_len += req.extend_len
        if self.pd is not None:  # prefill role: this step's KV starts for the decode side
            self.pd.after_extend(reqs)
        if self.spec is not None:  # EAGLE-3 keeps the target features of these rows
            self.spec.after_extend(fb, reqs + decoding)
        if any(r.embed_pooling for r in reqs):
            record_embeddings(rows, getattr(fb, "hidden_states", None),
                              lambda r, e: self._fail_request(r, e, "pooling its embedding"))
        self._record_input_logprobs(logits, rows)

        n_new = len(rows.sample_reqs) - len(decoding)
        sample_reqs = rows.sample_reqs[:n_new]
        for req in reqs:
            if req.is_chunked and not req.finished:  # (finished: failed in its logprobs)
                self.tree_cache.cache_unfinished_req(req, req.fill_ids[: req.kv_len])
                if req.computing_head and req.kv_len >= req.prefetch.head_end:
                    self._park(req)  # (split_heads.py) its tail is still being read
                else:
                    self.chunked = req
        if decoding:
            self._decode_results(decoding, logits[staged(rows.sample_rows[n_new:], self.device)])
        if not sample_reqs:
            return decoding
        info, sample_reqs, sample_rows = self._sampling_info(sample_reqs, rows.sample_rows[:n_new])
        if not sample_reqs:
            return decoding
        sample_logits = logits[staged(sample_rows, self.device)]
        out = self._sample(sample_logits, info, sample_reqs)
        if out is None:  # a CUDA OOM failed them (step() reports it)
            return decoding
        keep = self._process_tokens(sample_reqs, out)
        if self.tiered:  # the prefill rate storage loads must beat (the tokens synced the step)
            self.tree_cache.observe_prefill(sum(r.extend_len for r in reqs),
                                            time.perf_counter() - t0)
        if keep:
            info.filter(keep)
            joining = [sample_reqs[i] for i in keep]
            for req in joining:  # share the fresh prompt KV now, not only when the request ends
                self.tree_cache.cache_unfinished_req(req, req.fill_ids[: req.kv_len])
            self._merge_running(joining, info)
        return sample_reqs + decoding

    # --- helpers --------------------------------------------------------------------------------
    def _finish(self, req: Req, finish: Finish) -> None:
        req.finish = finish
        req.finished_at = time.perf_counter()
        if self.spec is not None:
            self.spec.on_finish(req)
        if self.pd is not None:
            self.pd.on_finish(req)
        if req.req_pool_idx is not None:
            self.tree_cache.cache_finished_req(req, req.fill_ids[: req.kv_len])
            req.req_pool_idx = None
            req.last_node = None
