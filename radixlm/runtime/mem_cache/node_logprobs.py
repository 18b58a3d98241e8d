"""Prompt logprobs kept in the radix tree, so a scoring request over a cached context does not
recompute that context.

What a node stores: `node.logprobs`, a `TokenLogprobs` of len(node.key) host tensors, or None.
`chosen[i]` (float32) is log p(key[i] | every token before it on the root..node path) under the
*raw* model distribution (the forward's logits: no temperature, penalties, grammar masks or logit
bias), the value SGLang returns as a prompt token's `input_token_logprobs`; NaN means unknown.
When a computing request asked top-k alternatives, the same position's distribution's top
entries too: `top_vals` / `top_ids` (n, TOP_K_STORED), of which the first `top_n[i]` are known
(top_n = k of the request that computed them, at most TOP_K_STORED; 0 unknown). None means all
unknown (the common case: nothing asked for logprobs, nothing is stored, nothing is paid). The
first token of the whole sequence has no context and so never has a value.

The values depend only on the tokens, not on where their KV lives, so they follow the node: a split
slices them (views of one storage), an evicted node takes them with it, and a tiered node that
leaves the device keeps them. They are host memory outside the KV pool (4 bytes a token, plus
12 * TOP_K_STORED where some request asked top-k; only for tokens some request asked logprobs of).

How they are written: whenever a forward computes a token's logprob (a prefill chunk with prompt
logprobs, or the decode step that sampled an output token with `return_logprob`), the request keeps
it; when the request's tokens are inserted (cache_unfinished_req / cache_finished_req), the known
values fill the unknown (NaN) entries along the inserted path, and a longer top-k list replaces a
shorter one. A known chosen value is never overwritten, and a top-k list only by a longer one (whose
leading entries are the same values), so what a request was served never changes under it.

Exactness: a served value is the value the forward that computed it returned, so it equals a
recompute wherever the recompute's own numerics do (same batch split, same chunking). Measured on
SmolLM2-135M, 2026-11-27 (benchmarks/probes/cached_logprobs_noise.py), max |served - recompute|:
prefill-stored values 0.0 in fp32 and bf16 (unchunked and chunk 16 alike); decode-stored values
9.5e-6 fp32, 0.12 bf16 (a decode row vs a prefill row), inside the batch-composition noise a
recompute alone has: chunked (16) vs unchunked prefill differ by 1.7e-4 fp32, 0.36 bf16.

How they are read: `path_logprobs` walks the longest cached prefix of a token list without
splitting or touching the LRU clock, and returns its values (NaN where unknown); the scheduler
(scheduler/cached_logprobs.py) then matches only up to the first unknown position it needs, so only
the missing part is computed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

TOP_K_STORED = 20  # the most alternatives a position keeps; a request asking more recomputes


@dataclass
class TokenLogprobs:
    """Per-token values of a run of n tokens (host tensors; see the module docstring)."""

    chosen: torch.Tensor  # (n,) float32, NaN unknown
    top_vals: Optional[torch.Tensor] = None  # (n, TOP_K_STORED) float32, descending
    top_ids: Optional[torch.Tensor] = None  # (n, TOP_K_STORED) int64
    top_n: Optional[torch.Tensor] = None  # (n,) int64, known leading top entries (0: none)

    @staticmethod
    def unknown(n: int, with_top: bool = False) -> "TokenLogprobs":
        lp = TokenLogprobs(torch.full((n,), float("nan")))
        if with_top:
            lp.top_vals = torch.zeros(n, TOP_K_STORED)
            lp.top_ids = torch.zeros(n, TOP_K_STORED, dtype=torch.int64)
            lp.top_n = torch.zeros(n, dtype=torch.int64)
        return lp

    def __len__(self) -> int:
        return self.chosen.numel()

    def __getitem__(self, sl: slice) -> "TokenLogprobs":
        """Views (a split's halves share storage, so in-place fills reach the one position)."""
        if self.top_n is None:
            return TokenLogprobs(self.chosen[sl])
        return TokenLogprobs(self.chosen[sl], self.top_vals[sl], self.top_ids[sl], self.top_n[sl])

    def clone(self) -> "TokenLogprobs":
        return TokenLogprobs(*(None if t is None else t.clone() for t in
                               (self.chosen, self.top_vals, self.top_ids, self.top_n)))

    def is_empty(self) -> bool:
        return (bool(torch.isnan(self.chosen).all())
                and (self.top_n is None or not bool(self.top_n.any())))

    @staticmethod
    def from_runs(n: int, runs: list, top_k: int) -> Optional["TokenLogprobs"]:
        """From a request's lists: each run is (first position, chosen values (None: unknown),
        top-k lists of (logprob, id) per position); positions >= n are dropped. None if empty."""
        runs = [(start, vals[: max(n - start, 0)], tops) for start, vals, tops in runs]
        runs = [r for r in runs if r[1]]
        if not runs:
            return None
        k = min(top_k, TOP_K_STORED)
        out = TokenLogprobs.unknown(n, with_top=k > 0)
        for start, vals, tops in runs:
            end = start + len(vals)
            out.chosen[start:end] = torch.tensor([float("nan") if v is None else v for v in vals])
            # None for the unscored first token; a list of top_k (logprob, id) pairs otherwise
            rows = [p for p, e in zip(range(start, end), tops) if e and len(e) >= k] if k else []
            if rows:
                entries = [tops[p - start][:k] for p in rows]
                idx = torch.tensor(rows)
                out.top_vals[idx, :k] = torch.tensor([[v for v, _ in e] for e in entries])
                out.top_ids[idx, :k] = torch.tensor([[t for _, t in e] for e in entries])
                out.top_n[idx] = k
        return out

    @staticmethod
    def cat(parts: list["TokenLogprobs"]) -> "TokenLogprobs":
        if not parts:
            return TokenLogprobs.unknown(0)
        if all(p.top_n is None for p in parts):
            return TokenLogprobs(torch.cat([p.chosen for p in parts]))
        full = [p if p.top_n is not None else _with_unknown_top(p) for p in parts]
        return TokenLogprobs(torch.cat([p.chosen for p in full]),
                             torch.cat([p.top_vals for p in full]),
                             torch.cat([p.top_ids for p in full]),
                             torch.cat([p.top_n for p in full]))


def _with_unknown_top(lp: TokenLogprobs) -> TokenLogprobs:
    out = TokenLogprobs.unknown(len(lp), with_top=True)
    out.chosen = lp.chosen
    return out


def merge_logprobs(node, values: Optional[TokenLogprobs]) -> None:
    """Fill node's unknown entries from `values` (len(node.key) tokens, NaN / 0 where unknown)."""
    if values is None or values.is_empty():
        return
    cur = node.logprobs
    if cur is None:
        node.logprobs = values.clone()  # `values` is a slice of the caller's per-request vector
        return
    fill = torch.isnan(cur.chosen) & ~torch.isnan(values.chosen)
    if bool(fill.any()):
        cur.chosen[fill] = values.chosen[fill]  # in place: a split's other half shares storage
    if values.top_n is None:
        return
    if cur.top_n is None:  # this node's own object: its split sibling keeps its own
        cur.top_vals, cur.top_ids, cur.top_n = (values.top_vals.clone(), values.top_ids.clone(),
                                                values.top_n.clone())
        return
    longer = values.top_n > cur.top_n
    if bool(longer.any()):
        cur.top_vals[longer] = values.top_vals[longer]
        cur.top_ids[longer] = values.top_ids[longer]
        cur.top_n[longer] = values.top_n[longer]


def split_logprobs(upper, lower, n: int) -> None:
    """After cutting `lower` (the old node) after its first n tokens into upper + lower."""
    lp = lower.logprobs
    if lp is not None:
        upper.logprobs, lower.logprobs = lp[:n], lp[n:]


def path_logprobs(root, token_ids: list[int], common_len) -> TokenLogprobs:
    """Values of the longest cached prefix of token_ids (m tokens; NaN / 0 where unknown).
    Read-only: no split, no LRU touch (the caller matches for real afterwards)."""
    tokens = tuple(token_ids)
    node, pos, parts = root, 0, []
    while pos < len(tokens):
        child = node.children.get(tokens[pos])
        if child is None:
            break
        n = common_len(child.key, tokens, pos)
        parts.append(TokenLogprobs.unknown(n) if child.logprobs is None else child.logprobs[:n])
        if n < len(child.key):
            break
        node, pos = child, pos + n
    return TokenLogprobs.cat(parts)  # torch.cat copies: later fills do not reach the caller


def check_node_logprobs(node) -> None:
    lp, n = node.logprobs, len(node.key)
    if lp is None:
        return
    shapes = [(lp.chosen, (n,), torch.float32)]
    if lp.top_n is not None:
        shapes += [(lp.top_vals, (n, TOP_K_STORED), torch.float32),
                   (lp.top_ids, (n, TOP_K_STORED), torch.int64), (lp.top_n, (n,), torch.int64)]
    for t, shape, dtype in shapes:
        if t is None or t.shape != shape or t.dtype != dtype:
            raise AssertionError(f"{node}: logprobs of a bad shape or dtype for {n} tokens")
