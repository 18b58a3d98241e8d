"""Pieces the speculative tests share."""

from __future__ import annotations

import torch


def pressure_prompts(vocab: int) -> list[list[int]]:
    """Five random prompts that crowd a small KV pool: three share a 60-token prefix (the tree
    holds it once, a draft's KV once per request), one is long (90 tokens), one short; the same
    ids every call."""
    g = torch.Generator().manual_seed(3)

    def ids(n):
        return torch.randint(0, vocab, (n,), generator=g).tolist()

    shared = ids(60)
    return [shared + ids(n) for n in (4, 9, 13)] + [ids(90), ids(20)]
