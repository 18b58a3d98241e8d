"""The decode half of the scheduler (a mixin of Scheduler): a decode step of the running batch,
split in launch (enqueue forward and sampling, start the one device -> host copy) and complete
(append tokens, finish requests), so that the overlap schedule can launch step N+1 before
completing step N (overlap.py); and the running batch's membership (rows leave or join it with
their sampling rows)."""

from __future__ import annotations

from typing import Optional

from radixlm.runtime.request import Req
from radixlm.runtime.sampling.sampling_batch_info import SamplingBatchInfo
from radixlm.runtime.scheduler import decode
from radixlm.runtime.scheduler.batch_builder import build_decode
from radixlm.runtime.scheduler.overlap import InFlightDecode, start_host_copy


class DecodeSteps:
    def _run_decode(self) -> list[Req]:
        retracted = decode.ensure_decode_memory(self)
        aborted = [r for r in retracted if r.finished]
        if not self.running:
            return aborted
        if self.spec is not None and self.spec.wants_verify(self):
            return self.spec.step(self) + aborted  # drafts verified, or a plain step
        step = self._launch_decode(list(self.running))
        if step is None:  # a CUDA OOM failed the batch (step() reports it)
            return aborted
        if self.overlap and self._overlappable():
            self.inflight = step  # completed by the next step(), after it launches its own
            return aborted
        return self._complete_decode(step) + aborted

    def _launch_decode(self, reqs: list[Req], input_ids=None) -> Optional[InFlightDecode]:
        """Enqueue one decode step for `reqs` (== self.running, in order); no host sync. None
        when a CUDA OOM failed the batch."""
        fb = build_decode(reqs, self.req_pool, self.allocator, self.tree_cache, self.device,
                          input_ids)
        # Shared-prefix groups run the decode step eagerly. Where a CUDA graph can take the batch
        # the graph wins: grouping skips KV reads (Llama-3.1-8B: 4 KB per key and layer, ~1.2 us
        # per 1000 keys on an H100) but an eager step costs ~0.6 ms of launches per layer; with
        # groups on, dp_router's tenants kept an H100 replica's scheduler 100% host-bound
        # (benchmarks/probes/dp_profile.py, 2026-11-25). Groups stay for the CPU and past the
        # graphs.
        if self.prefix_grouper is not None and not self.runner.replays_decode_graph(len(reqs)):
            fb.prefix_groups = self.prefix_grouper.plan(reqs)
            self.stats["shared_prefix_steps"] += fb.prefix_groups is not None
        logits = self._forward_or_oom(fb, reqs)
        if logits is None:
            return None
        self.stats["forward_steps"] += 1
        for req in reqs:
            req.kv_len += 1
        out = self._sample(logits, self.running_info, reqs)
        return None if out is None else start_host_copy(reqs, out)

    def _complete_decode(self, step: InFlightDecode) -> list[Req]:
        """Append a decode step's tokens, finish requests, drop them from the running batch.
        Rows of requests that finished while the step was in flight are ignored."""
        live = [i for i, r in enumerate(step.reqs) if not r.finished]
        out = step.wait()
        if out is not step.out and step.out.raw_logits is not None:
            # a CUDA host copy: token_ids_logprob reads the step's logits, still on the device
            # (such a batch never overlaps, see _overlappable, so they are not overwritten yet)
            out.raw_logits = step.out.raw_logits
        if len(live) != len(step.reqs):
            out = out.take_rows(live)
        reqs = [step.reqs[i] for i in live]
        self._retire(reqs, set(self._process_tokens(reqs, out)))
        return reqs

    def _retire(self, reqs: list[Req], keep: set[int]) -> None:
        """After a decode step of `reqs`: those not in `keep` (indices) leave the batch."""
        self._drop_from_running({id(r) for i, r in enumerate(reqs) if i not in keep})
        self.new_token_ratio = max(decode.MIN_NEW_TOKEN_RATIO,
                                   self.new_token_ratio - decode.NEW_TOKEN_RATIO_DECAY)

    def _drop_from_running(self, gone: set) -> None:
        """Remove the requests whose id() is in `gone` from the batch and its sampling rows."""
        if gone:
            keep = [i for i, r in enumerate(self.running) if id(r) not in gone]
            self.running = [self.running[i] for i in keep]
            self.running_info.filter(keep)

    def _decode_results(self, reqs: list[Req], logits) -> None:
        """Sample the running batch (`reqs` is self.running, logits its rows) and drop finished."""
        out = self._sample(logits, self.running_info, reqs)
        if out is None:  # a CUDA OOM failed them; step() takes them out of the batch
            return
        keep = self._process_tokens(reqs, out)
        if len(keep) != len(reqs):
            self.running = [reqs[i] for i in keep]
            self.running_info.filter(keep)
        self.new_token_ratio = max(decode.MIN_NEW_TOKEN_RATIO,
                                   self.new_token_ratio - decode.NEW_TOKEN_RATIO_DECAY)

    def _merge_running(self, reqs: list[Req], info: SamplingBatchInfo) -> None:
        self.running.extend(reqs)
        if self.running_info is None or len(self.running) == len(reqs):
            self.running_info = info
        else:
            self.running_info.merge(info)

    def _filter_running_info(self, keep: list[Req]) -> None:
        """Rebuild the running batch's sampling rows after an out-of-band removal (abort)."""
        self.running_info = (SamplingBatchInfo.from_reqs(keep, self.vocab_size, self.device)
                             if keep else None)
