"""The scheduler's view of one request: tokens, KV bookkeeping and finish state.

KV bookkeeping (page size 1, one slot per token):
- `req_pool_idx`: the row of `ReqToTokenPool.req_to_token` holding this request's slot indices.
- `fill_ids`: prompt + output tokens; the KV of `fill_ids[:kv_len]` is written, at the slots
  `req_to_token[req_pool_idx, :kv_len]`.
- `prefix_indices` / `last_node`: the part of those slots that the radix tree owns, and the tree
  node locked on this request's behalf. Slots past `len(prefix_indices)` belong to the request.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Optional

import torch

from radixlm.runtime.mem_cache.node_logprobs import TokenLogprobs
from radixlm.runtime.sampling_params import SamplingParams


class FinishReason(enum.Enum):
    LENGTH = "length"
    STOP = "stop"
    ABORT = "abort"


@dataclass
class Finish:
    reason: FinishReason
    matched: Any = None  # stop token id (int), stop string or stop_regex pattern (str)
    message: Optional[str] = None  # for aborts
    regex: bool = False  # `matched` is a stop_regex pattern: the output keeps the matched text
    # >= 500: the server failed the request (an internal error, an OOM), as errors.server_abort:
    # every API then answers an error, never a complete-looking output
    status: Optional[int] = None

    def to_dict(self) -> dict:
        d: dict[str, Any] = {"type": self.reason.value}
        if self.reason == FinishReason.STOP:
            d["matched"] = self.matched
        elif self.reason == FinishReason.LENGTH:
            d["length"] = self.matched
        elif self.message:
            d["message"] = self.message
        if self.status is not None:
            d["status_code"] = self.status
        return d


class Req:
    def __init__(
        self,
        rid: str,
        input_ids: list[int],
        sampling_params: SamplingParams,
        return_logprob: bool = False,
        logprob_start_len: int = -1,
        top_logprobs_num: int = 0,
        eos_token_ids: tuple[int, ...] = (),
        token_ids_logprob: Optional[list[int]] = None,
        embed_pooling: Optional[str] = None,
        mm: Any = None,
    ):
        self.rid = rid
        # multimodal.MultimodalInputs: the prompt's images (their positions hold pseudo ids)
        self.mm = mm
        self.origin_input_ids = list(input_ids)
        self.output_ids: list[int] = []
        self.sampling_params = sampling_params
        self.return_logprob = return_logprob
        # -1: no prompt logprobs; otherwise the first prompt position whose logprob is returned
        self.logprob_start_len = logprob_start_len
        self.top_logprobs_num = top_logprobs_num
        # logprobs of these token ids at every scored position (SGLang's token_ids_logprob)
        self.token_ids_logprob = list(token_ids_logprob) if token_ids_logprob else None
        # "last" | "mean": an embedding request (prompt only); its pooled final hidden state
        self.embed_pooling = embed_pooling
        self.embedding: Optional[list[float]] = None
        self.embed_sum: Any = None  # mean pooling across prefill chunks: running sum, count
        self.embed_count = 0
        stop_ids = set(sampling_params.stop_token_ids or [])
        if not sampling_params.ignore_eos:
            stop_ids |= set(eos_token_ids)
        self.stop_token_ids = frozenset(stop_ids)

        # KV bookkeeping (see module docstring)
        self.req_pool_idx: Optional[int] = None
        self.prefix_indices: torch.Tensor = torch.empty(0, dtype=torch.int64)
        self.last_node: Any = None
        self.kv_len = 0
        self.cached_tokens = 0  # prompt tokens served from the radix cache (reported to the user)
        # hierarchical cache: {"device": n, "host": n, "storage": n}, where those tokens came from
        self.cached_tokens_details: Optional[dict] = None
        # its pages being read from the store while it waits (mem_cache/tier_prefetch.py), and
        # the token range [lo, hi) that prefetch gave the tree at admission
        self.prefetch: Any = None
        self.prefetch_range: Optional[tuple[int, int]] = None
        # (CUDA) a load of its host prefix still in flight: (the loaded path's node, which it
        # holds locked, and the tokens each tier gave), until a round admits it (prefill.py)
        self.preload: Optional[tuple] = None
        # compute the head, read the tail (mem_cache/head_split.py): the tokens it computed of
        # the stored prefix before waiting again for the rest, the tiers' hits of that first
        # admission, and while it waits the head's node, which it holds locked (no row)
        self.head_tokens = 0
        self.head_details: Optional[dict] = None
        self.parked: Any = None
        self.extend_len = 0  # tokens in the current extend step (chunk)
        self.is_chunked = False  # mid-way through a chunked prefill
        self.match: Any = None  # (slots, node) from the last prefix match, used at admission
        self.input_logprobs_done = False  # prompt logprobs are computed once, not on re-admission
        # prompt logprobs the radix tree holds for positions [0, p), stashed by the prefix match
        # for admission to serve (scheduler/cached_logprobs.py)
        self.cached_input_lp: Optional[TokenLogprobs] = None
        # prompt positions below this were served from nodes this request keeps locked
        self.input_logprobs_served = 0

        # outputs
        self.finish: Optional[Finish] = None
        self.input_token_logprobs: list[float] = []  # for prompt positions >= logprob_start_len
        self.input_top_logprobs: list[list[tuple[float, int]]] = []
        self.output_token_logprobs: list[float] = []
        self.output_top_logprobs: list[list[tuple[float, int]]] = []
        self.input_token_ids_logprobs: list = []  # [[(logprob, id) per token_ids_logprob id]]
        self.output_token_ids_logprobs: list = []
        self.stop_str_checker: Any = None  # set by the scheduler when stop strings exist
        self.generator: Optional[torch.Generator] = None  # per-request RNG when a seed is given
        self.grammar: Any = None  # xgrammar GrammarMatcher once the grammar is compiled
        self.grammar_future: Any = None  # compilation in flight (the request waits for it)
        self.grammar_deadline = 0.0  # time.monotonic() by which it must be compiled
        self.retractions = 0
        self.jumps = 0  # jump-forward splices
        # lowest output index rewritten by a jump-forward since the last streamed update
        self.output_rollback: Optional[int] = None
        # speculative decoding: the drafting state (n-gram index, or a draft model's KV row;
        # dropped when finished), and
        # the verify steps this request drafted in with the tokens they appended
        self.spec_draft: Any = None
        self.spec_verify_steps: Optional[int] = None  # None: speculation is off
        self.spec_verify_tokens = 0
        self.created_at = 0.0  # perf_counter() when submitted
        self.finished_at: Optional[float] = None
        if self.return_logprob and self.logprob_start_len == 0 and len(self.origin_input_ids) == 1:
            # a one-token prompt has no position to score: its only entry is the first token's
            # None, as SGLang returns it (the extend's rows would add it before the second)
            self.input_token_logprobs.append(None)
            self.input_top_logprobs.append(None)
            if self.token_ids_logprob:
                self.input_token_ids_logprobs.append(None)
            self.input_logprobs_done = True

    # --- derived views -------------------------------------------------------------------------
    @property
    def fill_ids(self) -> list[int]:
        return self.origin_input_ids + self.output_ids

    def vocab_input_ids(self) -> list[int]:
        """The prompt with image pseudo ids as the image token id (for vocab-indexed uses)."""
        ids = self.origin_input_ids
        return ids if self.mm is None else self.mm.vocab_ids(ids)

    @property
    def seqlen(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.finish is not None

    @property
    def wants_input_logprobs(self) -> bool:
        """The prompt's rows from logprob_start_len on are computed and kept: for prompt
        logprobs, or for mean-pooled embeddings (which need every position's hidden state)."""
        return ((self.return_logprob or self.embed_pooling == "mean")
                and 0 <= self.logprob_start_len < len(self.origin_input_ids))

    def known_token_logprobs(self, n: int) -> Optional[TokenLogprobs]:
        """What the radix tree stores with `fill_ids[:n]` (mem_cache/node_logprobs.py): position
        p's log p(fill_ids[p] | fill_ids[:p]) under the raw model distribution (and its top-k)
        where this request computed or was served it, unknown elsewhere; None when it has none."""
        if not self.return_logprob or self.mm is not None or self.embed_pooling:
            return None  # image pseudo ids are not vocab tokens; embeddings compute no logprobs
        runs = []
        if self.logprob_start_len >= 0:
            # positions served from nodes this request keeps locked are there already: skip
            skip = max(self.input_logprobs_served - self.logprob_start_len, 0)
            runs.append((self.logprob_start_len + skip, self.input_token_logprobs[skip:],
                         self.input_top_logprobs[skip:]))
        # output logprobs come from the sampler's raw logits, which already carry the grammar
        # mask; a jump-forward splices tokens that no forward scored; speculative verify differs
        if self.grammar is None and self.jumps == 0 and self.spec_verify_steps is None:
            runs.append((len(self.origin_input_ids), self.output_token_logprobs,
                         self.output_top_logprobs))
        return TokenLogprobs.from_runs(n, runs, self.top_logprobs_num)

    @property
    def computing_head(self) -> bool:
        """Admitted, or about to be, to compute the head of a split stored prefix before its
        tail is read (scheduler/split_heads.py)."""
        return self.prefetch is not None and self.prefetch.head_pending

    def remaining_new_tokens(self) -> int:
        return self.sampling_params.max_new_tokens - len(self.output_ids)

    def reset_for_retract(self, count: bool = True) -> None:
        """Forget all KV state; the request is recomputed (mostly from cache) when re-admitted."""
        self.req_pool_idx = None
        self.prefix_indices = torch.empty(0, dtype=torch.int64)
        self.last_node = None
        self.kv_len = 0
        self.extend_len = 0
        self.is_chunked = False
        self.stop_str_checker = None  # rebuilt from output_ids on the next token
        self.prefetch_range = None  # (its prefetch was taken at the first admission)
        self.retractions += int(count)

    def __repr__(self) -> str:
        return f"Req(rid={self.rid!r}, in={len(self.origin_input_ids)}, out={len(self.output_ids)})"
