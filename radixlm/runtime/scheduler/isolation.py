"""Fault isolation: one request's failure fails that request, not the scheduler.

The per-request parts of a step (a grammar's mask or advance, a stop-string / stop_regex check,
its logprob rows, its sampling parameters, a jump-forward splice, its embedding pooling, its
images through the vision tower, entering the waiting queue) run inside a `try` around the
loop body that handles that one request. An exception there finishes the request with an error
(`finish_reason` `{"type": "abort", "message", "status_code": 500}`, which every API turns into
an error, see server/errors.server_abort); in the same step its own KV slots go back to the free
list, its row to the request pool, its lock on the tree is released, and the other requests go
on with the tokens they would have had. Its KV is freed rather than cached: an exception may have
left its tokens out of step with its KV (a jump-forward splice rewrites output_ids), and a
wrong prefix in the tree would be served to later requests silently.
The failure is logged with the rid and traceback and counted (`stats["request_failures"]`,
`radixlm:request_failures` on /metrics): isolation must not hide a bug.

The forward is different: its exception cannot be attributed to one request, so it stays fatal
(the process exits naming the cause), except a CUDA out-of-memory in the forward or the
sampler: the batch's requests fail with 503, the slots the step had taken go back, the
allocator's cache is emptied, and the scheduler goes on (`stats["oom_steps"]`,
`radixlm:oom_steps`). Not with tensor parallelism: the other ranks are inside the same
collective and cannot skip it.

A mixin of `Scheduler`; `_failed` holds the requests failed during the current step; `step()`
removes them from the batch and the queues once the step's own bookkeeping is done, and
reports them. A `try` costs nothing until it raises (zero-cost exceptions, Python 3.11+).
"""

from __future__ import annotations

import logging
import time

import torch

from radixlm.runtime.request import Finish, FinishReason, Req
from radixlm.runtime.sampling.sampling_batch_info import SamplingBatchInfo

logger = logging.getLogger(__name__)

INTERNAL_ERROR = 500
OUT_OF_MEMORY = 503  # a retry may succeed once the load is lower


class FaultIsolation:
    def _fail_request(self, req: Req, exc: BaseException, where: str,
                      status: int = INTERNAL_ERROR) -> None:
        """Finish `req` with an error after `exc` was raised in its own work (`where` says
        which). Its KV is handed back now; `step()` takes it out of the batch and reports it."""
        if status != OUT_OF_MEMORY:  # an OOM is logged and counted once per batch
            logger.error("request %s failed in %s; the other requests go on", req.rid, where,
                         exc_info=(type(exc), exc, exc.__traceback__))
            self.stats["request_failures"] += 1
        self._failed.append(req)
        if req.finished:  # it had finished when the error came (e.g. in a finish hook)
            return
        message = f"internal error in {where}: {type(exc).__name__}: {exc}"
        if status == OUT_OF_MEMORY:
            message = f"{where}: {exc}"
        self._drop_prefetch(req)
        req.finish = Finish(FinishReason.ABORT, message=message, status=status)
        req.finished_at = time.perf_counter()
        if self.spec is not None:
            self.spec.on_finish(req)
        if self.pd is not None:
            self.pd.on_finish(req)
        self._free_kv(req)

    def _free_kv(self, req: Req) -> None:
        """Free the request's own slots (past the tree-owned prefix), unlock its prefix, free
        its row: what `cache_finished_req` does, minus inserting its tokens into the tree."""
        tree = self.tree_cache
        if req.req_pool_idx is None:  # admitted, not yet in a batch: only its prefix lock
            if req.last_node is not None and not tree.disable:
                tree.dec_lock_ref(req.last_node)
            req.last_node = None
            return
        owned = tree.tree_owned_len(req)
        if req.kv_len > owned:
            self.allocator.free(self.req_pool.req_to_token[req.req_pool_idx, owned:req.kv_len]
                                .clone())
        if not tree.disable:
            tree.dec_lock_ref(req.last_node)
        self.req_pool.free(req.req_pool_idx)
        req.req_pool_idx, req.last_node = None, None

    def fail_outside_step(self, req: Req, exc: BaseException, where: str) -> None:
        """Fail `req` between steps (the server could not build its update): it leaves the
        batch now; the caller reports it."""
        self._settle()
        self._fail_request(req, exc, where)
        self._deferred += [r for r in self._sweep_failed([]) if r is not req]

    def _sweep_failed(self, done: list[Req]) -> list[Req]:
        """After a step: the requests it failed leave the running batch, the waiting queue and
        the chunk slot, and join the step's report. Runs only when something failed."""
        failed, self._failed = self._failed, []
        gone = {id(r) for r in failed}
        if any(id(r) in gone for r in self.running):
            self._drop_from_running(gone)
        self.waiting = [r for r in self.waiting if id(r) not in gone]
        if self.chunked is not None and id(self.chunked) in gone:
            self.chunked = None
        reported = {id(r) for r in done}
        return done + [r for r in failed if id(r) not in reported]

    def _sampling_info(self, reqs: list[Req], rows: list[int]):
        """The batch's sampling rows (penalties, logit_bias, min-tokens masks); a request whose
        own parameters fail to build is failed and left out. Returns (info, reqs, logits rows)."""
        try:
            return SamplingBatchInfo.from_reqs(reqs, self.vocab_size, self.device), reqs, rows
        except Exception:
            pass
        # one build failed: find which requests cannot build on their own (only on this path)
        ok = []
        for i, req in enumerate(reqs):
            try:
                SamplingBatchInfo.from_reqs([req], self.vocab_size, self.device)
                ok.append(i)
            except Exception as e:
                self._fail_request(req, e, "building its sampling parameters")
        reqs, rows = [reqs[i] for i in ok], [rows[i] for i in ok]
        if not reqs:
            return None, reqs, rows
        return SamplingBatchInfo.from_reqs(reqs, self.vocab_size, self.device), reqs, rows

    def _encode_images(self, reqs: list[Req]) -> list[Req]:
        """Before an extend's forward, each request's images through the vision tower (models
        with `encode_images`; the forward reuses the features). A request whose image fails
        fails alone; returns the others."""
        encode = getattr(getattr(self.runner, "model", None), "encode_images", None)
        if encode is None:
            return reqs
        ok = []
        for req in reqs:
            try:
                if req.mm is not None:
                    encode(req.mm, req.kv_len, req.extend_len)
                ok.append(req)
            except Exception as e:
                self._fail_request(req, e, "encoding its images")
        return ok

    def _forward_or_oom(self, fb, reqs: list[Req]):
        """The batch's forward; None after a CUDA out-of-memory, which fails `reqs` (their KV
        up to this step's tokens goes to the tree) and frees the slots the step had taken."""
        if self.args.tp_size > 1:  # the other ranks are in the same collective: stays fatal
            return self.runner.forward(fb)
        try:
            return self.runner.forward(fb)
        except torch.cuda.OutOfMemoryError as e:
            self.allocator.free(fb.out_cache_loc)  # written only by the failed forward
            self._fail_batch_oom(reqs, e, "the forward")
            return None

    def _sample_or_oom(self, logits, info, reqs: list[Req], want_lp: bool, top_k: int):
        """The sampler over `reqs`' rows; None after a CUDA out-of-memory, which fails them
        (their KV includes this step's tokens: the forward ran)."""
        if self.args.tp_size > 1:
            return self.sampler(logits, info, reqs, want_lp, top_k)
        try:
            return self.sampler(logits, info, reqs, want_lp, top_k)
        except torch.cuda.OutOfMemoryError as e:
            self._fail_batch_oom(reqs, e, "sampling")
            return None

    def _fail_batch_oom(self, reqs: list[Req], exc: BaseException, where: str) -> None:
        logger.error("CUDA out of memory in %s of %d requests (%s); they fail with 503 and the "
                     "scheduler goes on", where, len(reqs), ", ".join(r.rid for r in reqs[:8]),
                     exc_info=(type(exc), exc, exc.__traceback__))
        self.stats["oom_steps"] += 1
        for req in reqs:
            self._fail_request(req, exc, f"CUDA out of memory in {where}", status=OUT_OF_MEMORY)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
