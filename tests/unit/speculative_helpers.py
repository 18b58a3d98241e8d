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


def plain_tokens_under_pressure(eng, off, vocab: int) -> dict:
    """Run pressure_prompts on a speculative engine and on a plain one (`off`): the greedy tokens
    must be equal, and the pool small enough that a request was retracted. Returns the
    speculative engine's stats for the caller's own checks."""
    prompts = pressure_prompts(vocab)
    params = {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True}
    on = eng.generate(input_ids=prompts, sampling_params=params)
    ref = off.generate(input_ids=prompts, sampling_params=params)
    assert [o["output_ids"] for o in on] == [o["output_ids"] for o in ref]
    stats = eng.get_stats()
    assert stats["retractions"] > 0, stats
    return stats
