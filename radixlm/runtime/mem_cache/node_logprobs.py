"""Prompt logprobs kept in the radix tree, so a scoring request over a cached context does not
recompute that context.

What a node stores: `node.logprobs`, a host float32 tensor of shape (len(node.key),) or None.
Entry i is log p(key[i] | every token before it on the root..node path) under the *raw* model
distribution (the forward's logits: no temperature, penalties, grammar masks or logit bias), the
same value SGLang returns as a prompt token's `input_token_logprobs`. NaN means unknown; None means
all unknown (the common case: nothing asked for logprobs, nothing is stored, nothing is paid). The
first token of the whole sequence has no context and so never has a value.

The values depend only on the tokens, not on where their KV lives, so they follow the node: a split
slices them (views of one storage), an evicted node takes them with it, and a tiered node that
leaves the device keeps them. They are host memory outside the KV pool (4 bytes a token, only for
tokens some request asked logprobs of).

How they are written: whenever a forward computes a token's logprob (a prefill chunk with prompt
logprobs, or the decode step that sampled an output token with `return_logprob`), the request keeps
it; when the request's tokens are inserted (cache_unfinished_req / cache_finished_req), the known
values fill the unknown (NaN) entries along the inserted path. A known entry is never overwritten,
so a value a request was served never changes under it.

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

from typing import Optional

import torch


def merge_logprobs(node, values: Optional[torch.Tensor]) -> None:
    """Fill node's unknown entries from `values` ((len(node.key),) float32, NaN where unknown)."""
    if values is None:
        return
    known = ~torch.isnan(values)
    if not bool(known.any()):
        return
    if node.logprobs is None:
        node.logprobs = values.clone()  # `values` is a slice of the caller's per-request vector
        return
    fill = known & torch.isnan(node.logprobs)
    if bool(fill.any()):
        node.logprobs[fill] = values[fill]  # in place: a split's other half shares this storage


def split_logprobs(upper, lower, n: int) -> None:
    """After cutting `lower` (the old node) after its first n tokens into upper + lower."""
    lp = lower.logprobs
    if lp is not None:
        upper.logprobs, lower.logprobs = lp[:n], lp[n:]


def path_logprobs(root, token_ids: list[int], common_len) -> torch.Tensor:
    """Values (float32, shape (m,), NaN where unknown) of the longest cached prefix of token_ids,
    m its length. Read-only: no split, no LRU touch (the caller matches for real afterwards)."""
    tokens = tuple(token_ids)
    node, pos, parts = root, 0, []
    while pos < len(tokens):
        child = node.children.get(tokens[pos])
        if child is None:
            break
        n = common_len(child.key, tokens, pos)
        if child.logprobs is None:
            parts.append(torch.full((n,), float("nan")))
        else:
            parts.append(child.logprobs[:n])
        if n < len(child.key):
            break
        node, pos = child, pos + n
    return torch.cat(parts) if parts else torch.empty(0)


def check_node_logprobs(node) -> None:
    lp = node.logprobs
    if lp is not None and (lp.dtype != torch.float32 or lp.shape != (len(node.key),)):
        raise AssertionError(
            f"{node}: logprobs {tuple(lp.shape)} {lp.dtype} for {len(node.key)} tokens")
