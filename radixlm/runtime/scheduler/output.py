"""After sampling: append tokens, record logprobs, decide which requests finished and why.

Finish reasons follow SGLang: `stop` (a stop token, unless `min_new_tokens` is not reached yet, a
stop string, or a `stop_regex` match), `length` (`max_new_tokens`, or the context is full),
`abort`.

stop_regex, as SGLang does it: after each token the output text is searched (`re.search`); the
first token after which a pattern matches ends the request, `finish_reason` is
`{"type": "stop", "matched": <the pattern>}`, and the text keeps what matched (no trimming).
SGLang searches only a tail window of tokens when the pattern's match length is bounded; here a
bounded pattern searches the same tail of the text, through `Pattern.search(text, pos)` so that
`^` and look-behinds still see the real start of the output. The patterns run on the `regex`
package (re's syntax and semantics, plus a timeout): a search that backtracks for longer than
--stop-regex-timeout aborts its request instead of stalling the scheduler for everyone.
"""

from __future__ import annotations

import re
from typing import Optional

import regex
import torch

from radixlm.runtime.detokenize import IncrementalDetokenizer, StopStringChecker
from radixlm.runtime.request import Finish, FinishReason, Req

try:  # the regex parser moved in Python 3.11
    import re._parser as sre_parse  # type: ignore[import-not-found]
except ImportError:  # pragma: no cover
    import sre_parse  # type: ignore[no-redef]

_UNBOUNDED = None


def max_match_len(pattern: str) -> Optional[int]:
    """Upper bound on the characters one match of `pattern` spans, or None when unbounded."""
    try:
        lo_hi = sre_parse.parse(pattern).getwidth()
    except (re.error, RecursionError, OverflowError):
        return _UNBOUNDED
    hi = lo_hi[1]
    return None if hi >= sre_parse.MAXREPEAT or hi > 1 << 20 else int(hi)


class StopStringState:
    """Incremental text of one request's output, for stop-string and stop_regex matching."""

    def __init__(self, tokenizer, req: Req, regex_timeout: Optional[float] = None):
        sp = req.sampling_params
        self.regex_timeout = regex_timeout
        self.detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=sp.skip_special_tokens,
                                            spaces_between_special_tokens=sp.spaces_between_special_tokens)
        self.checker = StopStringChecker(sp.stop_strs, no_stop_trim=sp.no_stop_trim)
        self.regexes = [(p, regex.compile(p), max_match_len(p)) for p in sp.stop_regex_strs]
        self.text = ""  # the output text so far (kept only when there are stop_regex patterns)

    def feed(self, token_id: int) -> Optional[Finish]:
        delta = self.detok.push([token_id])
        if self.checker.stops:
            _, matched = self.checker.feed(delta)
            if matched is not None:
                return Finish(FinishReason.STOP, matched=matched)
        if self.regexes and delta:
            self.text += delta
            for src, pat, width in self.regexes:
                pos = 0 if width is None else max(0, len(self.text) - width - len(delta))
                try:
                    found = pat.search(self.text, pos, timeout=self.regex_timeout)
                except TimeoutError:
                    return Finish(FinishReason.ABORT, message=f"sampling_params.stop_regex: "
                                  f"{src!r} searched for over {self.regex_timeout} s "
                                  f"(see --stop-regex-timeout)")
                if found is not None:
                    return Finish(FinishReason.STOP, matched=src, regex=True)
        return None


def check_finish(req: Req, token_id: int, context_len: int, tokenizer,
                 regex_timeout: Optional[float] = None) -> Optional[Finish]:
    sp = req.sampling_params
    n_out = len(req.output_ids)
    if token_id in req.stop_token_ids and n_out >= sp.min_new_tokens:
        return Finish(FinishReason.STOP, matched=token_id)
    if (sp.stop_strs or sp.stop_regex_strs) and tokenizer is not None:
        if req.stop_str_checker is None:
            req.stop_str_checker = StopStringState(tokenizer, req, regex_timeout)
            for t in req.output_ids[:-1]:  # re-admitted after retraction: catch up
                req.stop_str_checker.feed(t)
        finish = req.stop_str_checker.feed(token_id)
        if finish is not None:
            return finish
    if n_out >= sp.max_new_tokens:
        return Finish(FinishReason.LENGTH, matched=sp.max_new_tokens)
    if req.seqlen >= context_len:
        return Finish(FinishReason.LENGTH, matched=n_out)
    return None


class LogprobRows:
    """A SampleOutput's logprobs on the host (copied once), appended to requests row by row:
    each request's chosen-token logprob and top-k list, and the logprobs of its
    `token_ids_logprob` ids (gathered from the raw logits the sampler kept)."""

    def __init__(self, out):
        self.chosen = out.logprobs.tolist()
        self.top_vals = out.top_logprobs_vals.tolist() if out.top_logprobs_vals is not None else None
        self.top_ids = out.top_logprobs_ids.tolist() if out.top_logprobs_ids is not None else None
        self.raw = getattr(out, "raw_logits", None)

    def append(self, req: Req, i: int) -> None:
        """Row i's chosen-token logprob (and top-k, token_ids_logprob) onto req's output lists."""
        if not req.return_logprob:
            return
        req.output_token_logprobs.append(self.chosen[i])
        if req.top_logprobs_num and self.top_vals is not None:
            k = req.top_logprobs_num
            req.output_top_logprobs.append(list(zip(self.top_vals[i][:k], self.top_ids[i][:k])))
        if req.token_ids_logprob and self.raw is not None:
            req.output_token_ids_logprobs.append(
                ids_logprobs(self.raw[i : i + 1], req.token_ids_logprob)[0])


def ids_logprobs(logits: torch.Tensor, ids: list[int]) -> list[list[tuple[float, int]]]:
    """logits (N, V) -> per row [(logprob of ids[j], ids[j])]: one gather, no per-token Python."""
    x = logits.float()
    idx = torch.tensor(ids, dtype=torch.int64, device=x.device)
    vals = (x.index_select(1, idx) - torch.logsumexp(x, dim=-1, keepdim=True)).tolist()
    return [list(zip(row, ids)) for row in vals]


def record_input_ids_logprobs(req: Req, logits: torch.Tensor, first_pos: int) -> None:
    """Prompt positions' `token_ids_logprob` (logits rows already sliced to this request)."""
    if not req.token_ids_logprob:
        return
    if first_pos == 1 and req.logprob_start_len == 0 and not req.input_token_ids_logprobs:
        req.input_token_ids_logprobs.append(None)  # the first prompt token is not scored
    req.input_token_ids_logprobs.extend(ids_logprobs(logits, req.token_ids_logprob))


def record_embeddings(rows, hidden: Optional[torch.Tensor], on_error) -> None:
    """Embedding requests: pool the final hidden states (`hidden` (N, H), the rows of the
    forward's logits) over the prompt ("mean": every position, accumulated across prefill
    chunks; "last": the last position) and L2-normalize, as SGLang's pooler does. A request
    whose pooling raises is handed to `on_error(req, exc)` (it fails alone) and skipped."""
    if hidden is None:
        return
    for req, first_row, n, _ in rows.input_spans:
        if req.embed_pooling == "mean" and not req.finished:
            try:
                s = hidden[first_row : first_row + n].float().sum(dim=0)
                req.embed_sum = s if req.embed_sum is None else req.embed_sum + s
                req.embed_count += n
            except Exception as e:
                on_error(req, e)
    for req, row in zip(rows.sample_reqs, rows.sample_rows):
        if not req.embed_pooling or req.finished:
            continue
        try:
            req.embedding = _pooled(req, hidden[row].float())
        except Exception as e:
            on_error(req, e)


def _pooled(req: Req, h: torch.Tensor) -> list[float]:
    """The request's pooled, normalized embedding from its last row `h` (H,)."""
    if req.embed_pooling == "mean":
        total = h if req.embed_sum is None else req.embed_sum + h
        h = total / (req.embed_count + 1)
        req.embed_sum = None
    return torch.nn.functional.normalize(h, dim=-1).tolist()
