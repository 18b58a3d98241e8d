"""Drafts of grammar-constrained requests: checked against the request's matcher, masked per row.

The simplest exact scheme: walk the matcher through the draft and roll it back.
- `truncate`: cut a draft at its first token the grammar does not allow (or after the token that
  terminates it): the target's masked distribution gives such a token probability 0, so it and
  everything after could never be accepted.
- `masker`: row j of a request holds the grammar's mask after its drafts d_1..d_j, filled by
  walking the matcher again and rolled back, so the matcher is unchanged afterwards; the tokens
  the verify keeps are then accepted one by one as in plain decoding (TokenProcessing).
Per draft token that is two matcher steps on the host, the same kind of work plain decoding does
per token; only requests with a grammar pay it.
"""

from __future__ import annotations

from typing import Callable

import torch

from radixlm.runtime.constrained.grammar import MaskBuffer, apply_bitmask_rows


def truncate(req, draft: list[int]) -> list[int]:
    m = req.grammar
    if m is None or not draft:
        return draft
    ok = 0
    for t in draft:
        if m.is_terminated() or not m.accept_token(t):
            break
        ok += 1
    if ok:
        m.rollback(ok)
    return draft[:ok]


def masker(reqs: list, drafts: list[list[int]], offsets: list[int], rows: int,
           masks: MaskBuffer) -> Callable[[torch.Tensor], None]:
    """A function that masks the (rows, V) verify logits of the constrained requests in place."""
    if not any(r.grammar is not None for r in reqs):
        return lambda logits: None
    bitmask = masks.get(rows)
    bitmask.fill_(-1)  # every token allowed on rows without a grammar (or after termination)
    constrained: list[int] = []
    for req, d, off in zip(reqs, drafts, offsets):
        m = req.grammar
        if m is None:
            continue
        walked = 0
        for j in range(len(d) + 1):
            if m.is_terminated():  # a draft ended the grammar: rows after it are never kept
                break
            m.fill_next_token_bitmask(bitmask, off + j)
            constrained.append(off + j)
            if j < len(d):
                accepted = m.accept_token(d[j])
                assert accepted, "truncate() kept only drafts the grammar allows"
                walked += 1
        if walked:
            m.rollback(walked)

    return lambda logits: apply_bitmask_rows(logits, bitmask, constrained, masks.vocab_size)
