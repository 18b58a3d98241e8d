"""Request validation/tokenization in, SGLang-shaped result dicts out.

Shared by the offline Engine and the server's TokenizerManager, so both reject the same bad
input with the same message (a ValueError naming the field) before anything is queued.
"""

from __future__ import annotations

import time
import uuid
import weakref
from typing import Any, Optional

from radixlm.runtime.constrained.grammar import constraint_of, validate_constraint
from radixlm.runtime.detokenize import IncrementalDetokenizer
from radixlm.runtime.request import FinishReason, Req
from radixlm.runtime.request_limits import DEFAULT_LIMITS, RequestLimits
from radixlm.runtime.sampling_params import SamplingParams


def _per_item(value, n: int, name: str) -> list:
    if isinstance(value, list):
        if len(value) != n:
            raise ValueError(f"{name}: got {len(value)} entries for a batch of {n}")
        return value
    return [value] * n


class RequestBuilder:
    def __init__(self, tokenizer, vocab_size: int, context_len: int, kv_capacity: int,
                 eos_token_ids: tuple[int, ...], image_processor=None,
                 limits: RequestLimits = DEFAULT_LIMITS):
        self.tokenizer = tokenizer
        self.limits = limits  # bounds on one call (flags; runtime/request_limits.py)
        # multimodal.ImageProcessor of a vision-language model (None: text-only)
        self.image_processor = image_processor
        self.vocab_size = vocab_size
        self.context_len = context_len
        self.kv_capacity = kv_capacity
        self.eos_token_ids = tuple(eos_token_ids)

    def tokenize(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("text: this engine has no tokenizer (skip_tokenizer_init); pass input_ids")
        return self.tokenizer.encode(text)

    def check_input_ids(self, ids: list[int], field: str = "input_ids") -> None:
        if not ids:
            raise ValueError(f"{field}: the prompt is empty")
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size:
                raise ValueError(f"{field}: token id {t!r} is outside the vocabulary "
                                 f"[0, {self.vocab_size})")
        if len(ids) >= self.context_len:
            raise ValueError(f"{field}: the prompt has {len(ids)} tokens, which does not fit the "
                             f"context length {self.context_len}")
        if len(ids) + 1 > self.kv_capacity:
            raise ValueError(f"{field}: the prompt has {len(ids)} tokens, more than the KV cache "
                             f"holds ({self.kv_capacity}; see --max-total-tokens)")

    def build(self, prompt, input_ids, sampling_params, return_logprob, logprob_start_len,
              top_logprobs_num, rid, extra: dict[str, Any],
              embed_pooling: Optional[str] = None) -> tuple[list[Req], bool]:
        extra = dict(extra)
        token_ids_logprob = extra.pop("token_ids_logprob", None)
        image_data = extra.pop("image_data", None)
        if extra:
            raise TypeError(f"generate() got unexpected keyword argument(s) {sorted(extra)}")
        if (prompt is None) == (input_ids is None):
            raise ValueError("exactly one of text (prompt) and input_ids must be given")
        if prompt is not None:
            if not isinstance(prompt, (str, list, tuple)):  # fuzzing: text 112, a 500
                raise ValueError(f"text: expected a string or a list of strings, got "
                                 f"{type(prompt).__name__}")
            single = isinstance(prompt, str)
            texts = [prompt] if single else list(prompt)
            for t in texts:
                if not isinstance(t, str):
                    raise ValueError(f"text: expected a string, got {type(t).__name__}")
                if not t:
                    raise ValueError("text: the prompt is empty")
            all_ids = [self.tokenize(t) for t in texts]
            field = "text"
        else:  # the shape is checked here, each id by check_input_ids (found by fuzzing:
            # input_ids true, or [[1], 2], raised TypeError, a 500)
            if not isinstance(input_ids, (list, tuple)):
                raise ValueError(f"input_ids: expected a list of token ids (or a list of such "
                                 f"lists for a batch), got {type(input_ids).__name__}")
            single = bool(input_ids) and not isinstance(input_ids[0], (list, tuple))
            if not single and not all(isinstance(x, (list, tuple)) for x in input_ids):
                raise ValueError("input_ids: a batch is a list of lists of token ids")
            all_ids = [list(input_ids)] if single else [list(x) for x in input_ids]
            field = "input_ids"
        if not all_ids:
            raise ValueError(f"{field}: the batch is empty")
        n = len(all_ids)
        params = _per_item(sampling_params, n, "sampling_params")
        lps = _per_item(return_logprob, n, "return_logprob")
        starts = _per_item(logprob_start_len, n, "logprob_start_len")
        tops = _per_item(top_logprobs_num, n, "top_logprobs_num")
        rids = _per_item(rid, n, "rid") if rid is not None else [None] * n
        nested = isinstance(token_ids_logprob, list) and token_ids_logprob and \
            isinstance(token_ids_logprob[0], list)
        tids = token_ids_logprob if nested else [token_ids_logprob] * n
        if len(tids) != n:
            raise ValueError(f"token_ids_logprob: got {len(tids)} entries for a batch of {n}")
        if rid is not None and single is False and not isinstance(rid, list):
            raise ValueError("rid: a batch needs a list of rids")
        mms = self.expand_images(all_ids, image_data, single)

        reqs, requested = [], 0
        for ids, p, lp, start, top, r, tid, mm in zip(all_ids, params, lps, starts, tops, rids,
                                                      tids, mms):
            if mm is None:
                self.check_input_ids(ids, field)
            else:
                self.check_input_ids(mm.vocab_ids(ids), field)
            sp = p if isinstance(p, SamplingParams) else SamplingParams.from_dict(p)
            if sp.max_new_tokens is None:  # SGLang: no limit but the context
                sp.max_new_tokens = max(self.context_len - len(ids), 0)
            sp.verify(self.vocab_size, self.limits)
            self.limits.check_logprobs(top, tid)
            self.check_token_ids_logprob(tid)
            if constraint_of(sp) is not None:
                if self.tokenizer is None:
                    raise ValueError("sampling_params: constrained decoding needs a tokenizer")
                validate_constraint(sp)
            if sp.stop_strs and self.tokenizer is None:
                raise ValueError("sampling_params.stop: stop strings need a tokenizer")
            if sp.stop_regex_strs and self.tokenizer is None:
                raise ValueError("sampling_params.stop_regex: stop_regex needs a tokenizer")
            if len(ids) + sp.max_new_tokens > self.context_len:
                raise ValueError(f"sampling_params.max_new_tokens: the prompt ({len(ids)} tokens) "
                                 f"plus max_new_tokens ({sp.max_new_tokens}) exceeds the context "
                                 f"length ({self.context_len})")
            requested += (len(ids) + sp.max_new_tokens) * sp.n
            self.limits.check_request_tokens(requested)
            start = -1 if start is None else start
            if lp and not -1 <= start < len(ids):
                raise ValueError(f"logprob_start_len: must be in [-1, {len(ids)}) (got {start})")
            top = top or 0
            if isinstance(top, bool) or not isinstance(top, int) or top < 0:
                raise ValueError(f"top_logprobs_num: must be a non-negative integer (got {top!r})")
            base = r or uuid.uuid4().hex
            if embed_pooling == "mean":  # every prompt position's hidden state is needed
                start = 0
            for k in range(sp.n):
                reqs.append(Req(base if sp.n == 1 else f"{base}-{k}", ids, sp, bool(lp),
                                start if lp or embed_pooling == "mean" else -1,
                                top if lp else 0, self.eos_token_ids,
                                token_ids_logprob=tid if lp else None,
                                embed_pooling=embed_pooling, mm=mm))
        return reqs, single and len(reqs) == 1

    def expand_images(self, all_ids: list[list[int]], image_data, single: bool) -> list:
        """SGLang's image_data (one image, a list of images for one prompt, or for a batch a list
        with one entry per prompt): expands each prompt's image tokens in place (all_ids) and
        returns each prompt's MultimodalInputs (None without images)."""
        if image_data is None or image_data == [] or image_data == [None] * len(all_ids):
            return [None] * len(all_ids)
        if self.image_processor is None:
            raise ValueError("image_data: this model takes no images (it is text-only)")
        if single:
            per_prompt = [image_data if isinstance(image_data, list) else [image_data]]
        else:
            if not isinstance(image_data, list) or len(image_data) != len(all_ids):
                raise ValueError(f"image_data: a batch of {len(all_ids)} prompts needs a list "
                                 "with one entry (an image, a list of them or null) per prompt")
            per_prompt = [[] if d is None else d if isinstance(d, list) else [d]
                          for d in image_data]
        self.limits.check_image_count(sum(len(images) for images in per_prompt))
        out = []
        for i, images in enumerate(per_prompt):
            if not images:
                out.append(None)
                continue
            all_ids[i], mm = self.image_processor.process(all_ids[i], images,
                                                          self.limits.max_image_pixels)
            out.append(mm)
        return out

    def check_token_ids_logprob(self, tid) -> None:
        if tid is None:
            return
        if not isinstance(tid, list) or len(tid) > self.vocab_size:
            raise ValueError("token_ids_logprob: must be a list of token ids")
        for t in tid:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size:
                raise ValueError(f"token_ids_logprob: ids must be integers in "
                                 f"[0, {self.vocab_size}) (got {t!r})")


# tokenizer -> {id: tokenizer.decode([id])}: logprob responses name the text of every token they
# list (echo with top-k: ~1e5 entries a request, one Rust call each), and for a given tokenizer
# the text of an id never changes.
_TOKEN_TEXTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def token_text_fn(tokenizer):
    """t -> tokenizer.decode([t]), memoized per tokenizer."""
    try:
        memo = _TOKEN_TEXTS.setdefault(tokenizer, {})
    except TypeError:  # a tokenizer that cannot be weakly referenced: not memoized
        memo = {}

    def text(t):
        s = memo.get(t)
        if s is None:
            s = memo[t] = tokenizer.decode([t])
        return s
    return text


def _lp_triples(vals, ids, tokenizer, with_text: bool):
    if not (with_text and tokenizer is not None):
        return [(v, t, None) for v, t in zip(vals, ids)]
    text = token_text_fn(tokenizer)
    return [(v, t, text(t)) for v, t in zip(vals, ids)]  # v is None for the first prompt token


def _top_triples(tops, tokenizer, with_text: bool):
    if not (with_text and tokenizer):  # the common case, one comprehension (echo: ~1e5 entries)
        return [None if e is None else [(v, t, None) for v, t in e] for e in tops]
    text = token_text_fn(tokenizer)
    return [None if e is None else [(v, t, text(t)) for v, t in e] for e in tops]


def output_text(req: Req, tokenizer, upto: Optional[int] = None) -> str:
    if tokenizer is None:
        return ""
    ids = req.output_ids[:upto]
    fin = req.finish
    done = upto is None or upto >= len(req.output_ids)
    if done and fin is not None and fin.reason == FinishReason.STOP and isinstance(fin.matched, int):
        ids = ids[:-1]  # the stop token is not part of the text
    sp = req.sampling_params
    text = tokenizer.decode(ids, skip_special_tokens=sp.skip_special_tokens)
    if done and fin is not None and isinstance(fin.matched, str) and not fin.regex:
        cut = text.find(fin.matched)
        if cut >= 0:
            text = text[: cut + len(fin.matched)] if sp.no_stop_trim else text[:cut]
    return text


def spec_meta(verify_steps: Optional[int], verify_tokens: int) -> dict:
    """meta_info of speculative decoding (empty when it is off): `spec_verify_steps`, the verify
    forwards in which the request had a draft, and `spec_accept_length`, the mean tokens each of
    them appended (its accepted drafts + the one token every verify yields; SGLang's accept
    length: 1.0 means no draft was accepted)."""
    if verify_steps is None:
        return {}
    return {"spec_verify_steps": verify_steps,
            "spec_accept_length": verify_tokens / verify_steps if verify_steps else 0.0}


class StreamText:
    """A stream's cumulative text, decoded incrementally (runtime/detokenize.py, as the server's
    detokenizer does): a chunk's text was the whole output decoded again, O(n) a chunk and
    O(n^2) a stream (a 4000-token stream: ~2 s of decoding, SmolLM2's tokenizer on this CPU).
    Never half a UTF-8 character; a jump-forward's rewrite of ids already decoded starts over.
    The final chunk's text is build_result's own (stop strings and the stop token applied)."""

    def __init__(self, req: Req, tokenizer):
        self.req, self.tokenizer = req, tokenizer
        self._restart()

    def _restart(self) -> None:
        sp = self.req.sampling_params
        self.detok = IncrementalDetokenizer(self.tokenizer, sp.skip_special_tokens,
                                            sp.spaces_between_special_tokens)
        self.text = ""

    def upto(self, n: int) -> str:
        ids = self.req.output_ids
        done = len(self.detok.ids)
        if done > n or ids[:done] != self.detok.ids:  # rewritten (jump-forward): start over
            self._restart()
            done = 0
        if n > done:
            self.text += self.detok.push(ids[done:n])
        return self.text


def build_result(req: Req, tokenizer, upto: Optional[int] = None, partial: bool = False,
                 return_text_in_logprobs: bool = False,
                 stream_text: Optional[StreamText] = None) -> dict:
    """`stream_text`: a stream's incremental text, for a partial chunk's."""
    upto = len(req.output_ids) if upto is None else upto
    meta: dict[str, Any] = {
        "id": req.rid,
        "finish_reason": None if partial or req.finish is None else req.finish.to_dict(),
        "prompt_tokens": len(req.origin_input_ids),
        "weight_version": "default",
        "total_retractions": req.retractions,
        "reasoning_tokens": 0,
        "completion_tokens": upto,
        "cached_tokens": req.cached_tokens,
        **spec_meta(req.spec_verify_steps, req.spec_verify_tokens),
    }
    if req.cached_tokens_details is not None:
        meta["cached_tokens_details"] = dict(req.cached_tokens_details)
    if req.return_logprob:
        with_text = return_text_in_logprobs
        inp = req.vocab_input_ids()[req.logprob_start_len:] if req.logprob_start_len >= 0 else []
        meta["input_token_logprobs"] = _lp_triples(req.input_token_logprobs, inp, tokenizer,
                                                   with_text)
        meta["output_token_logprobs"] = _lp_triples(req.output_token_logprobs[:upto],
                                                    req.output_ids[:upto], tokenizer, with_text)
        meta["output_token_logprobs_length"] = len(meta["output_token_logprobs"])
        if req.top_logprobs_num:
            meta["input_top_logprobs"] = _top_triples(req.input_top_logprobs, tokenizer, with_text)
            meta["output_top_logprobs"] = _top_triples(req.output_top_logprobs[:upto], tokenizer,
                                                       with_text)
        if req.token_ids_logprob is not None:
            meta["input_token_ids_logprobs"] = _top_triples(req.input_token_ids_logprobs,
                                                            tokenizer, with_text)
            meta["output_token_ids_logprobs"] = _top_triples(req.output_token_ids_logprobs[:upto],
                                                             tokenizer, with_text)
    if not partial and req.finish is not None:
        meta["e2e_latency"] = (req.finished_at or time.perf_counter()) - req.created_at
    if partial and stream_text is not None and tokenizer is not None:
        text = stream_text.upto(upto)
    else:
        text = output_text(req, tokenizer, None if not partial else upto)
    return {"text": text,
            "output_ids": list(req.output_ids[:upto]), "meta_info": meta}
