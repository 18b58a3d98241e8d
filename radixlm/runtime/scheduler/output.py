"""After sampling: append tokens, record logprobs, decide which requests finished and why.

Finish reasons follow SGLang: `stop` (a stop token, unless `min_new_tokens` is not reached yet, or a
stop string), `length` (`max_new_tokens`, or the context is full), `abort`.
"""

from __future__ import annotations

from typing import Optional

from radixlm.runtime.detokenize import IncrementalDetokenizer, StopStringChecker
from radixlm.runtime.request import Finish, FinishReason, Req


class StopStringState:
    """Incremental text of one request's output, for stop-string matching in the scheduler."""

    def __init__(self, tokenizer, req: Req):
        sp = req.sampling_params
        self.detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=sp.skip_special_tokens,
                                            spaces_between_special_tokens=sp.spaces_between_special_tokens)
        self.checker = StopStringChecker(sp.stop_strs, no_stop_trim=sp.no_stop_trim)

    def feed(self, token_id: int) -> Optional[str]:
        _, matched = self.checker.feed(self.detok.push([token_id]))
        return matched


def check_finish(req: Req, token_id: int, context_len: int, tokenizer) -> Optional[Finish]:
    sp = req.sampling_params
    n_out = len(req.output_ids)
    if token_id in req.stop_token_ids and n_out >= sp.min_new_tokens:
        return Finish(FinishReason.STOP, matched=token_id)
    if sp.stop_strs and tokenizer is not None:
        if req.stop_str_checker is None:
            req.stop_str_checker = StopStringState(tokenizer, req)
            for t in req.output_ids[:-1]:  # re-admitted after retraction: catch up
                req.stop_str_checker.feed(t)
        matched = req.stop_str_checker.feed(token_id)
        if matched is not None:
            return Finish(FinishReason.STOP, matched=matched)
    if n_out >= sp.max_new_tokens:
        return Finish(FinishReason.LENGTH, matched=sp.max_new_tokens)
    if req.seqlen >= context_len:
        return Finish(FinishReason.LENGTH, matched=n_out)
    return None


def record_output_logprobs(reqs: list[Req], out) -> None:
    """Append each request's chosen-token logprob and top-k list from a SampleOutput."""
    if out.logprobs is None:
        return
    chosen = out.logprobs.tolist()
    top_vals = out.top_logprobs_vals.tolist() if out.top_logprobs_vals is not None else None
    top_ids = out.top_logprobs_ids.tolist() if out.top_logprobs_ids is not None else None
    for i, req in enumerate(reqs):
        if not req.return_logprob:
            continue
        req.output_token_logprobs.append(chosen[i])
        if req.top_logprobs_num and top_vals is not None:
            k = req.top_logprobs_num
            req.output_top_logprobs.append(list(zip(top_vals[i][:k], top_ids[i][:k])))
