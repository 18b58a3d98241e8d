"""The waiting queue's side of the scheduler (a mixin of Scheduler): a request enters it with its
grammar compiling and its stored pages coming up from the file store, both off the scheduler
thread; admission takes it once both are ready (or have given up)."""

from __future__ import annotations

import time

from radixlm.runtime.constrained.grammar import GrammarCompilerPool, constraint_of
from radixlm.runtime.request import Finish, FinishReason, Req
from radixlm.runtime.scheduler.policy import match_len_cap
from radixlm.runtime.scheduler.prefill import PrefillAdder


class WaitingQueue:
    def add_request(self, req: Req) -> None:
        try:
            self._enqueue(req)
        except Exception as e:  # this request's grammar or prefetch: it fails alone, reported
            self._fail_request(req, e, "entering the waiting queue")  # by the next step

    def _enqueue(self, req: Req) -> None:
        if self.spec is not None:
            req.spec_verify_steps = 0  # reported in meta_info (None: speculation off)
        c = constraint_of(req.sampling_params)
        if c is not None and req.grammar is None:
            if self.grammars is None:
                self.grammars = GrammarCompilerPool(self.tokenizer, self.vocab_size,
                                                    tuple(req.stop_token_ids),
                                                    cache_size=self.args.grammar_cache_size)
            req.grammar_future = self.grammars.submit(*c)
            req.grammar_deadline = time.monotonic() + self.args.grammar_compile_timeout
        if self.tiered:  # its pages in the store start coming up to the host now, off this thread
            req.prefetch = self.tree_cache.start_prefetch(
                req.fill_ids[:match_len_cap(req, self.tree_cache)], self._may_split(req))
        self.waiting.append(req)

    def _drop_prefetch(self, req: Req) -> None:
        """The request leaves the waiting queue unadmitted: what it held while waiting goes."""
        if req.parked is not None:  # the head it computed stays in the tree, unlocked
            self.tree_cache.dec_lock_ref(req.parked)
            req.parked = None
        if self.pd is not None:  # the decode role's lock on its received prompt
            self.pd.release_wait_lock(req)
        if req.prefetch is not None:
            self.tree_cache.cancel_prefetch(req.prefetch)
            req.prefetch = None
        if req.preload is not None:  # its loaded path stays in the tree, unlocked, once copied
            self.tree_cache.finish_loading(req.preload[0])
            self.tree_cache.dec_lock_ref(req.preload[0])
            req.preload = None

    def has_runnable_work(self) -> bool:
        """False when idle or when every waiting request still waits: for its grammar (none
        past --grammar-compile-timeout), its pages from the store or its preload's copy."""
        if self.running or self.chunked or self.inflight or self._deferred or self._failed:
            return True
        if self.tiered and self.tree_cache.prefetch_news():
            return True  # a step applies them (a lookup's result starts its read)
        now = time.monotonic()  # (a preload still copying: polled, see waits_on_copies)
        return any((r.grammar_future is None or r.grammar_future.done()
                    or now > r.grammar_deadline) and self._prefetch_ready(r)
                   and (r.preload is None or not self.tree_cache.loading(r.preload[0]))
                   for r in self.waiting)

    def waits_on_copies(self) -> bool:
        """Whether a waiting request's preload (host -> device) is in flight: the loop that
        steps the scheduler polls for its landing every millisecond. Before, such a request
        made `has_runnable_work` true and the loop stepped without pause: with nothing else
        to run (a restart on a warm store, one request at a time) that thread held the GIL
        against the store's fetcher threads."""
        return any(r.preload is not None for r in self.waiting)

    def _prefetch_ready(self, req: Req) -> bool:
        """False while the request waits for pages from the store (--hicache-storage-prefetch-
        policy); the step goes on with the others."""
        return req.prefetch is None or self.tree_cache.prefetch_ready(req.prefetch)

    def _grammar_ready(self, req: Req) -> bool:
        fut = req.grammar_future
        if fut is None:
            return True
        if not fut.done():
            if time.monotonic() > req.grammar_deadline:  # the compile goes on; the request not
                req.finish = Finish(FinishReason.ABORT, message=(
                    f"grammar compilation took over {self.args.grammar_compile_timeout} s "
                    f"(see --grammar-compile-timeout)"))
            return False
        if fut.exception() is not None:  # validated before queueing, so this is a bug or OOM
            req.finish = Finish(FinishReason.ABORT, message=f"grammar compilation failed: "
                                                            f"{fut.exception()}")
            return False
        if req.grammar is None:
            try:
                req.grammar = self.grammars.matcher(fut.result())
            except Exception as e:
                self._fail_request(req, e, "creating its grammar matcher")
                return False
        return True

    # --- preloads beside the running batch (hierarchical cache, CUDA) ----------------------------
    def _preload_waiting(self) -> None:
        """Start the host -> device copies of waiting requests' host-resident prefixes now, while
        the running batch's step is on the GPU (called after the next step's launch, scheduler
        `_step_or_chain`): a round that admits them later finds their prefixes on the device,
        and the decode steps stay chained while they land (`_admission_pending`). Before, a wave
        of arriving turns was preloaded inside an admission round with nothing on the GPU:
        ~2.5 ms of the scheduler's time each (H200, 32 at a time), the GPU idle throughout; and
        then before the chained launch, where the same time made the GPU wait for the launch
        (11 ms a call on an H200 host when turns arrived, cProfile 2026-11-28)."""
        if not self.tree_cache.mover.loads_async:  # (the CPU: a load is a copy here anyway)
            return
        room = (self.args.max_running_requests - len(self.running)
                - sum(r.preload is not None for r in self.waiting))
        # in arrival order (the round that admits them orders them by the policy); not those
        # with a grammar compiling or pages coming from the store (admission handles them)
        candidates = [r for r in self.waiting if self._preloadable(r)][:max(room, 0)]
        if not candidates:
            return
        adder = PrefillAdder(self.tree_cache, self.allocator, self.running, self.new_token_ratio,
                             self.args.max_prefill_tokens, self.chunked_prefill_size)
        for req in candidates:
            adder.preload(req)

    def _stream_prefetched(self) -> None:
        """Requests whose pages are still coming from the store: each step, the pages landed
        so far (reported in runs: page_reader.LANDED_REPORT_TOKENS) start their copy to the
        device (PrefillAdder.stream), so that on a GPU the host
        -> device copy of a long prefix runs beside the rest of its read instead of after it
        (a restart on a warm store: the read and the copy were two waits in a row). Only with
        asynchronous loads (CUDA): on the CPU a load is a copy on this thread either way."""
        if not self.tree_cache.mover.loads_async:
            return
        adder = None
        for req in self.waiting:
            op = req.prefetch
            if op is None or op.cancelled or op.head_pending or op.landed <= op.released:
                continue
            if adder is None:
                adder = PrefillAdder(self.tree_cache, self.allocator, self.running,
                                     self.new_token_ratio, self.args.max_prefill_tokens,
                                     self.chunked_prefill_size)
            adder.stream(req)

    def _admission_pending(self) -> bool:
        """Whether a waiting request may be admitted now: none while the running batch is full;
        else any but those whose host prefix is still being copied to the device (a preload,
        prefill.py), or has yet to be (its copy starts beside the next step:
        `_preload_waiting`), which wait for the copy whatever the step does, and those still
        waiting for pages from the store; meanwhile the running batch goes on decoding with
        overlap."""
        room = self.args.max_running_requests - len(self.running)
        if room <= 0:  # (admission takes none while the batch is full)
            return False
        preloadable = 0
        for req in self.waiting:
            if not self._prefetch_ready(req):
                continue
            if req.preload is not None:
                if not self.tree_cache.loading(req.preload[0]):
                    return True
                continue
            if not self._preloadable(req):
                return True
            # a host-resident prefix is copied first, the request admitted after; matched only
            # as far as the batch has room (a long queue is not matched again every step)
            preloadable += 1
            if preloadable <= room:
                cap = match_len_cap(req, self.tree_cache)
                if not self.tree_cache.match_prefix(req.fill_ids[:cap]).lower_len:
                    return True
        return False

    def _preloadable(self, req: Req) -> bool:
        """A request whose host prefix `_preload_waiting` copies before a round admits it."""
        return (self.tiered and self.tree_cache.mover.loads_async and req.preload is None
                and req.prefetch is None and req.grammar_future is None)
