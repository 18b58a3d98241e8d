"""Per-step token handling of the scheduler: sampling (grammar masks applied), appending the
sampled tokens, finishing requests, jump-forward splices and prompt logprobs.

A mixin of `Scheduler` (scheduler.py), split out to keep each file to one concern; it uses the
scheduler's state (tree_cache, waiting, stats, args, tokenizer, device, sampler, masks).
"""

from __future__ import annotations

import time

import torch

from radixlm.runtime.constrained.grammar import apply_grammar_masks
from radixlm.runtime.constrained.jump_forward import try_jump_forward
from radixlm.runtime.request import Finish, FinishReason, Req
from radixlm.runtime.sampling.logprobs import token_logprobs
from radixlm.runtime.scheduler.output import (LogprobRows, check_finish,
                                              record_input_ids_logprobs)


class TokenProcessing:
    def _sample(self, logits, info, reqs):
        """The sampled tokens of `reqs` (a SampleOutput); None when a CUDA OOM failed them."""
        apply_grammar_masks(logits, reqs, self.masks,
                            on_error=lambda r, e: self._fail_request(r, e, "its grammar's mask"))
        want_lp = any(r.return_logprob for r in reqs)
        top_k = max((r.top_logprobs_num for r in reqs if r.return_logprob), default=0)
        return self._sample_or_oom(logits, info, reqs, want_lp, top_k)

    def _process_tokens(self, reqs: list[Req], out) -> list[int]:
        """Append sampled tokens; finish requests. Returns the indices of requests still running.
        A request whose own handling raises fails alone (isolation.py); one that failed earlier
        in this step (its grammar mask, its prompt logprobs) is skipped: its token is dropped."""
        tokens = out.next_token_ids.tolist()  # the step's one device->host sync
        lp_rows = LogprobRows(out) if out.logprobs is not None else None
        keep = []
        for i, (req, tok) in enumerate(zip(reqs, tokens)):
            if req.finished:
                continue
            try:
                if lp_rows is not None:
                    lp_rows.append(req, i)
                if req.sampling_params.max_new_tokens == 0:  # prompt-only (e.g. scoring)
                    if req.output_token_logprobs:
                        req.output_token_logprobs.clear()
                        req.output_top_logprobs.clear()
                    self._finish(req, Finish(FinishReason.LENGTH, matched=0))
                    continue
                if self._append_token(req, tok):
                    keep.append(i)
            except Exception as e:
                self._fail_request(req, e, "processing its sampled token")
        return keep

    def _append_token(self, req: Req, tok: int) -> bool:
        """Append one sampled token: advance the grammar, finish the request or splice a
        jump-forward. True while the request keeps decoding in the running batch."""
        req.output_ids.append(tok)
        self.stats["generated_tokens"] += 1
        finish = None
        if req.grammar is not None:
            if not req.grammar.accept_token(tok):
                finish = Finish(FinishReason.ABORT, message=f"grammar rejected token {tok}")
            elif req.grammar.is_terminated():
                finish = Finish(FinishReason.STOP, matched=tok if tok in req.stop_token_ids else None)
        finish = finish or check_finish(req, tok, self.context_len, self.tokenizer,
                                         self.args.stop_regex_timeout)
        if finish is not None:
            self._finish(req, finish)
            return False
        return not (req.grammar is not None and self._jump_forward(req))

    def _jump_forward(self, req: Req) -> bool:
        """Splice a grammar-forced string into the output. The request then leaves the running
        batch and is re-admitted: one extend step recomputes from the first changed token."""
        if self.args.disable_jump_forward:
            return False
        jump = try_jump_forward(req, self.tokenizer)
        if jump is None:
            return False
        self.stats["jump_forward_tokens"] += jump.num_new_tokens
        req.jumps += 1
        if self.spec is not None:  # a draft model's KV of the rewritten output is stale
            self.spec.on_retract(req)
        prev = req.output_rollback
        req.output_rollback = jump.first_changed if prev is None else min(prev, jump.first_changed)
        old_kv = self._pre_jump_kv_tokens(req, jump)
        max_new = req.sampling_params.max_new_tokens
        if len(req.output_ids) >= max_new:
            del req.output_ids[max_new:]
            del req.output_token_logprobs[max_new:]
            del req.output_top_logprobs[max_new:]
            req.finish = Finish(FinishReason.LENGTH, matched=max_new)
            req.finished_at = time.perf_counter()
            self.tree_cache.cache_finished_req(req, old_kv)
            req.req_pool_idx, req.last_node = None, None
            return True
        # the tree takes all computed KV (the replaced tokens' too: a harmless evictable branch);
        # re-admission matches the new tokens against it and computes only what changed
        self.tree_cache.cache_finished_req(req, old_kv)
        req.reset_for_retract(count=False)
        self.waiting.insert(0, req)
        return True

    @staticmethod
    def _pre_jump_kv_tokens(req: Req, jump) -> list[int]:
        """The tokens whose KV the request holds: its fill before the splice, minus the last."""
        before = req.origin_input_ids + req.output_ids[: jump.first_changed] + jump.old_tail
        return before[: req.kv_len]

    def _record_input_logprobs(self, logits, rows) -> None:
        for req, first_row, n, first_pos in rows.input_spans:
            if req.embed_pooling:  # its rows were kept for pooling, not for logprobs
                continue
            try:
                self._record_prompt_logprobs(req, logits, first_row, n, first_pos)
            except Exception as e:
                self._fail_request(req, e, "its prompt logprobs")
        for req, *_ in rows.input_spans:
            if req.kv_len >= len(req.origin_input_ids):
                req.input_logprobs_done = True

    def _record_prompt_logprobs(self, req: Req, logits, first_row: int, n: int,
                                first_pos: int) -> None:
        """One request's prompt logprobs from its rows of an extend's logits."""
        record_input_ids_logprobs(req, logits[first_row : first_row + n], first_pos)
        prompt = req.origin_input_ids if req.mm is None else req.vocab_input_ids()
        targets = torch.tensor(prompt[first_pos : first_pos + n], device=self.device)
        chosen, top_vals, top_ids = token_logprobs(logits[first_row : first_row + n], targets,
                                                   req.top_logprobs_num)
        if first_pos == 1 and req.logprob_start_len == 0 and not req.input_token_logprobs:
            req.input_token_logprobs.append(None)  # the first token has no context to score it
            req.input_top_logprobs.append(None)
        req.input_token_logprobs.extend(chosen.tolist())
        if req.top_logprobs_num:
            for vals, ids in zip(top_vals.tolist(), top_ids.tolist()):
                req.input_top_logprobs.append(list(zip(vals, ids)))
        else:
            req.input_top_logprobs.extend([[] for _ in range(n)])
