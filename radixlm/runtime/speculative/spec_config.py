"""The speculative-decoding flags (SGLang's names) resolved and checked once, at start-up.

SGLang's meaning of the numbers, kept here:
- `speculative_num_draft_tokens`: tokens one verify forward computes per request. With a chain
  (top-k 1) that is the request's last token plus `num_draft_tokens - 1` drafts.
- `speculative_num_steps`: the chain's depth, `num_draft_tokens - 1` with top-k 1. Given both and
  inconsistent, SGLang sets num_draft_tokens = num_steps + 1 and warns; so does this.
- `speculative_eagle_topk`: the draft tree's branching (STANDALONE, EAGLE3; 1: a chain). With
  top-k > 1 each of `num_steps` draft forwards expands the best top-k nodes of the level before
  into top-k children each, and the `num_draft_tokens - 1` best nodes by the draft's path
  probability are verified as a tree (draft_tree.py, tree_verify.py); SGLang's defaults there
  are the caller's to give, else 3 steps and 1 + steps * top-k tokens. NGRAM drafts chains.
- `speculative_draft_model_path`: STANDALONE's draft model (its vocabulary must be the
  target's: checked when the draft loads, standalone.py), or EAGLE3's head (a
  LlamaForCausalLMEagle3 checkpoint: eagle3_config.py). Their chains default to 3 drafts.
A flag that cannot take effect is refused with a ValueError naming it, never ignored.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

logger = logging.getLogger(__name__)

DEFAULT_NUM_DRAFT_TOKENS = 8  # 1 + 7 drafts: within one pass of the GGUF kernels' 16-row tile
# a draft model pays one forward per drafted token: a shorter chain (3 drafts) by default
DEFAULT_STANDALONE_DRAFT_TOKENS = 4
MAX_NUM_DRAFT_TOKENS = 64
MAX_TOPK = 16
DEFAULT_TREE_STEPS = 3
# scratch rows of req_to_token a draft tree may use (each tree node and each beam of the head's
# drafting has its own row: ReqToTokenPool.spare_rows), one row of the context's length each
TREE_SPARE_ROWS_MAX = 128
NOT_BUILT = {"EAGLE": "EAGLE (-1/-2) heads"}
MODEL_DRAFTS = ("STANDALONE", "EAGLE3")  # the algorithms with a --speculative-draft-model-path


@dataclass(frozen=True)
class SpecConfig:
    algorithm: str  # "NGRAM" | "STANDALONE" | "EAGLE3"
    max_draft: int  # draft tokens per request per verify (num_draft_tokens - 1)
    adaptive: bool
    min_match: int  # NGRAM: suffix n-gram lengths looked up, longest first
    max_match: int
    capacity: int  # NGRAM: n-grams kept from finished requests' text
    draft_model_path: Optional[str] = None  # STANDALONE's draft model / EAGLE3's head
    topk: int = 1  # a draft tree's branching (1: a chain)
    steps: int = 0  # a tree's depth (head forwards per step); a chain's: max_draft

    def tree_candidates(self, depth: int) -> int:
        """Nodes a tree of `depth` levels can choose from: top-k at level 1, top-k beams of
        top-k children each below."""
        return self.topk + (depth - 1) * self.topk * self.topk if depth > 0 else 0

    def tree_rows(self, depth: int) -> int:
        """Verify rows of a tree of `depth` levels (its nodes)."""
        return min(self.max_draft, self.tree_candidates(depth))

    def draft_inputs(self) -> int:
        """Draft KV slots one request's drafting holds past its own KV: a chain's inputs (at
        most max_draft), or a tree's beams (top-k at each level below the first)."""
        return max(self.max_draft, self.topk * max(0, self.steps - 1))

    def spare_rows(self, max_running_requests: int) -> int:
        """req_to_token scratch rows for draft trees (0 for chains)."""
        if self.topk == 1:
            return 0
        return min(TREE_SPARE_ROWS_MAX, max_running_requests * max(self.topk, self.max_draft))


def resolve(args) -> Optional[SpecConfig]:
    """SpecConfig from ServerArgs, or None when speculation is off. Raises ValueError naming the
    flag for anything that cannot run as asked."""
    algo = args.speculative_algorithm
    if algo is None:
        for name in ("speculative_num_steps", "speculative_num_draft_tokens",
                     "speculative_eagle_topk", "speculative_draft_model_path"):
            if getattr(args, name) is not None:
                raise ValueError(f"{name}: set without speculative_algorithm")
        return None
    algo = str(algo).upper()
    if algo in NOT_BUILT:
        raise ValueError(f"speculative_algorithm={algo}: {NOT_BUILT[algo]} not built yet in "
                         "radixlm; NGRAM is (drafts from the request's own text and from "
                         "finished requests' text), STANDALONE (a draft model) and EAGLE3 (an "
                         "EAGLE-3 head)")
    if algo not in ("NGRAM",) + MODEL_DRAFTS:
        raise ValueError(f"speculative_algorithm: unknown algorithm {algo!r} (NGRAM, STANDALONE, "
                         "EAGLE3)")
    draft_path = args.speculative_draft_model_path
    if algo == "NGRAM" and draft_path is not None:
        raise ValueError("speculative_draft_model_path: NGRAM drafts without a model")
    if algo in MODEL_DRAFTS:
        if draft_path is None:
            raise ValueError(f"speculative_draft_model_path: {algo} needs a draft model (" + (
                "a smaller model with the target's tokenizer and vocabulary)" if algo ==
                "STANDALONE" else "an EAGLE-3 head trained for the target)"))
    topk = args.speculative_eagle_topk
    if topk is not None and (isinstance(topk, bool) or not isinstance(topk, int)
                             or not 1 <= topk <= MAX_TOPK):
        raise ValueError(f"speculative_eagle_topk: must be an integer in [1, {MAX_TOPK}] "
                         f"(got {topk!r})")
    topk = topk or 1
    if topk > 1 and algo not in MODEL_DRAFTS:
        raise ValueError(f"speculative_eagle_topk={topk}: draft trees are built for a draft "
                         f"model or an EAGLE-3 head (STANDALONE, EAGLE3); {algo} drafts chains "
                         "(top-k 1)")
    steps, tokens = args.speculative_num_steps, args.speculative_num_draft_tokens
    for name, v in (("speculative_num_steps", steps), ("speculative_num_draft_tokens", tokens)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ValueError(f"{name}: must be a positive integer (got {v!r})")
    if topk > 1:
        steps = steps or DEFAULT_TREE_STEPS
        cands = topk + (steps - 1) * topk * topk
        if tokens is None:
            tokens = min(MAX_NUM_DRAFT_TOKENS, 1 + steps * topk)
        elif tokens - 1 > cands:
            raise ValueError(f"speculative_num_draft_tokens={tokens}: a tree of "
                             f"{steps} steps and top-k {topk} has only {cands} nodes to verify")
    elif tokens is None:
        default = (DEFAULT_STANDALONE_DRAFT_TOKENS if algo in MODEL_DRAFTS
                   else DEFAULT_NUM_DRAFT_TOKENS)
        tokens = default if steps is None else steps + 1
    elif steps is not None and tokens != steps + 1:
        logger.warning("speculative_num_draft_tokens=%d with a chain (top-k 1) of %d steps: "
                       "using %d, as SGLang does", tokens, steps, steps + 1)
        tokens = steps + 1
    if not 2 <= tokens <= MAX_NUM_DRAFT_TOKENS:
        raise ValueError(f"speculative_num_draft_tokens: must be in [2, {MAX_NUM_DRAFT_TOKENS}] "
                         f"(the last token + at least one draft; got {tokens})")
    lo, hi = (args.speculative_ngram_min_match_window_size,
              args.speculative_ngram_max_match_window_size)
    if not 1 <= lo <= hi <= 32:
        raise ValueError("speculative_ngram_min/max_match_window_size: need 1 <= min <= max <= 32 "
                         f"(got {lo}, {hi})")
    if args.speculative_ngram_capacity < 0:
        raise ValueError("speculative_ngram_capacity: must be >= 0")
    return SpecConfig(algo, tokens - 1, bool(args.speculative_adaptive), lo, hi,
                      int(args.speculative_ngram_capacity),
                      draft_path if algo in MODEL_DRAFTS else None, topk,
                      steps if topk > 1 else tokens - 1)
