"""A scheduler driven by hand with requests arriving one after another (tests of the extend
paths: piecewise graphs on the CPU and the GPU): most extends then carry the running requests'
decode rows."""

from __future__ import annotations

import torch

from radixlm.runtime.request import Req
from radixlm.runtime.sampling_params import SamplingParams


def prompts(vocab: int, seed: int) -> list[list[int]]:
    """Prompts of 3-70 tokens, two continuing earlier ones (cached prefixes)."""
    g = torch.Generator().manual_seed(seed)
    out = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (3, 11, 70, 20, 9, 41)]
    out.append(out[2][:50] + [7, 8, 9])
    out.append(out[1] + [5] * 6)
    return out


def drive(eng, ids: list[list[int]], tag: str, every: int = 2) -> list[Req]:
    """Greedy requests (6-9 new tokens, with logprobs) for `ids` on an empty cache, the first
    at once, each next one after every `every` steps; returns them finished."""
    sched = eng.scheduler
    eng.flush_cache()

    def run():
        reqs = []
        for i, p in enumerate(ids):
            req = Req(f"{tag}-{i}", p, SamplingParams(temperature=0, max_new_tokens=6 + i % 4,
                                                      ignore_eos=True))
            req.return_logprob = True
            reqs.append(req)
        pending, steps = list(reqs), 0
        sched.add_request(pending.pop(0))
        while pending or sched.has_runnable_work():
            if sched.has_runnable_work():
                sched.step()
                steps += 1
            if pending and steps % every == 0:
                sched.add_request(pending.pop(0))
        return reqs

    return eng._call_in_loop(run)
