"""Prompt logprobs served from the radix tree instead of recomputed (the values each node stores,
and how they get there: mem_cache/node_logprobs.py).

Without this, a request asking prompt logprobs from `logprob_start_len = s` matched the cache only
up to s - 1 (the logits at position q score token q + 1), so a scoring request over a long cached
context recomputed the whole context. Now, for an eligible request:

1. `logprob_match_cap` reads the stored values along the longest cached prefix of the prompt and
   finds p, the first position >= max(s, 1) whose value is unknown (NaN, or past the cached
   prefix; with `top_logprobs_num = k`, also a position holding fewer than k alternatives). The
   match is capped at p - 1 tokens: the forward's first query is p - 1, whose logits score
   token p. The values of positions [0, p) are stashed on the request (`cached_input_lp`).
2. Once admitted with L = kv_len cached tokens (L <= p - 1; less when the tree or the tier load
   gave less), `serve_cached_input_logprobs` appends positions [max(s, 1), L + 1) from the stash;
   the forward computes positions L + 1 on, exactly the rows batch_builder already asks for.

Eligible: a fresh request (nothing recorded yet, no output) asking prompt logprobs with at most
TOP_K_STORED alternatives. `token_ids_logprob` is not stored (ids differ per request), image
prompts hold pseudo ids, embeddings score nothing: those match up to s - 1 as before.
"""

from __future__ import annotations

import torch

from radixlm.runtime.mem_cache.node_logprobs import TOP_K_STORED
from radixlm.runtime.request import Req


def serves_cached_logprobs(req: Req, tree_cache) -> bool:
    return (req.return_logprob and req.wants_input_logprobs and not req.input_logprobs_done
            and not req.input_token_logprobs and not req.output_ids
            and req.top_logprobs_num <= TOP_K_STORED and not req.token_ids_logprob
            and req.mm is None and not req.embed_pooling and not tree_cache.disable)


def logprob_match_cap(req: Req, tree_cache) -> int:
    """How many leading prompt tokens may come from the cache for a request that still needs
    prompt logprobs; stashes the cached values it will be served (step 1 of the docstring)."""
    req.cached_input_lp = None
    if not serves_cached_logprobs(req, tree_cache):
        return max(req.logprob_start_len - 1, 0)
    first = max(req.logprob_start_len, 1)
    lp = tree_cache.cached_logprobs(req.origin_input_ids)  # m tokens' values, NaN unknown
    missing = torch.isnan(lp.chosen[first:])  # (m - first,) bool
    if req.top_logprobs_num:
        short = (lp.top_n[first:] < req.top_logprobs_num) if lp.top_n is not None else True
        missing = missing | short
    unknown = missing.nonzero()
    first_unknown = first + int(unknown[0, 0]) if unknown.numel() else max(len(lp), first)
    if first_unknown > first:
        req.cached_input_lp = lp[:first_unknown]
    return first_unknown - 1


def serve_cached_input_logprobs(req: Req) -> None:
    """Step 2: after admission with kv_len cached tokens, append the prompt logprobs the forward
    will not compute (positions [max(s, 1), kv_len + 1)) from the stash."""
    lp, req.cached_input_lp = req.cached_input_lp, None
    first, end = max(req.logprob_start_len, 1), req.kv_len + 1
    if lp is None or end <= first:
        return
    assert end <= len(lp), (end, len(lp))  # kv_len <= the cap, which is len(lp) - 1
    if req.logprob_start_len == 0:
        req.input_token_logprobs.append(None)  # the first token has no context to score it
        req.input_top_logprobs.append(None)
    req.input_token_logprobs.extend(lp.chosen[first:end].tolist())
    k = req.top_logprobs_num
    if k:  # the format _record_input_logprobs appends: [(logprob, id)] * k per position
        vals, ids = lp.top_vals[first:end, :k].tolist(), lp.top_ids[first:end, :k].tolist()
        req.input_top_logprobs.extend(list(zip(v, i)) for v, i in zip(vals, ids))
    else:
        req.input_top_logprobs.extend([] for _ in range(end - first))
    # positions < kv_len sit in the nodes the request keeps locked, so its insert need not store
    # them again; position kv_len's node is not locked (eviction may take it): stored again
    req.input_logprobs_served = req.kv_len
    if end >= len(req.origin_input_ids):
        req.input_logprobs_done = True  # every prompt position was served: no rows to compute
