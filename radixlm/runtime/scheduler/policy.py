"""Ordering of the waiting queue.

- `lpm` (longest prefix match, default): requests whose prompt is most cached go first, so the
  cached prefix is reused before eviction can take it (with the hierarchical cache a token in
  the host pool or the store counts for a fraction of one on the device: `match_score`).
  Matching costs a tree walk per request, so past `LPM_FALLBACK_QUEUE_LEN` waiting requests the
  policy falls back to FCFS.
- `dfs-weight`: walk the radix tree depth-first, visiting the subtree holding the most waiting
  requests first, so requests sharing a prefix run together.
- `fcfs`: arrival order.
Every policy stores the match on the request (`req.prefix_indices`-to-be in `req.match`), which
admission reuses.
"""

from __future__ import annotations

from collections import defaultdict

from radixlm.runtime.request import Req
from radixlm.runtime.scheduler.cached_logprobs import logprob_match_cap

LPM_FALLBACK_QUEUE_LEN = 128
POLICIES = ("lpm", "dfs-weight", "fcfs")


def match_len_cap(req: Req, tree_cache) -> int:
    """How many leading tokens may come from the cache: at least one token must be computed (its
    logits give the next token), and prompt logprobs need the logits before the first prompt
    position whose logprob the tree does not hold (scheduler/cached_logprobs.py)."""
    cap = req.seqlen - 1
    if req.wants_input_logprobs and not req.input_logprobs_done:
        cap = min(cap, logprob_match_cap(req, tree_cache))
    return cap


def match_score(match, prefetch=None) -> float:
    """Device-cached tokens, plus the tiered cache's weighted host and storage hits (with what
    the request's storage prefetch has landed or found)."""
    score = len(match[0]) + getattr(match, "lower_score", 0.0)
    if prefetch is not None:
        score += match.prefetch_score(prefetch)
    return score


def compute_matches(waiting: list[Req], tree_cache) -> None:
    for req in waiting:
        req.match = tree_cache.match_prefix(req.fill_ids[: match_len_cap(req, tree_cache)])


def order_waiting(waiting: list[Req], policy: str, tree_cache) -> list[Req]:
    if policy not in POLICIES:
        raise ValueError(f"schedule_policy must be one of {POLICIES} (got {policy!r})")
    if policy == "fcfs" or (policy == "lpm" and len(waiting) > LPM_FALLBACK_QUEUE_LEN):
        for req in waiting:
            req.match = None  # matched lazily at admission
        return list(waiting)
    compute_matches(waiting, tree_cache)
    if policy == "lpm":
        return sorted(waiting, key=lambda r: -match_score(r.match, r.prefetch))  # stable: FCFS
    return _dfs_weight_order(waiting, tree_cache)


def _dfs_weight_order(waiting: list[Req], tree_cache) -> list[Req]:
    by_node: dict[int, list[Req]] = defaultdict(list)
    weight: dict[int, int] = defaultdict(int)
    for req in waiting:
        node = req.match[1]
        by_node[id(node)].append(req)
        while node is not None:  # every ancestor's subtree holds this request
            weight[id(node)] += 1
            node = node.parent
    order: list[Req] = []
    stack = [tree_cache.root]
    while stack:
        node = stack.pop()
        order.extend(by_node.get(id(node), ()))
        children = [c for c in node.children.values() if weight.get(id(c))]
        children.sort(key=lambda c: weight[id(c)])  # heaviest popped first
        stack.extend(children)
    return order
