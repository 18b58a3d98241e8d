"""An extend in which every request adds one token and samples it runs as a DECODE batch
(batch_builder.as_decode: on a GPU it replays a decode CUDA graph instead of an eager extend):
a prompt cached but for its last token, alone or next to running requests (a mixed step), as a
disaggregated decode server admits every prompt. The tokens are those of the extend path, and
steps that read more than the sampled rows (prompt logprobs) stay extends."""

from __future__ import annotations

import pytest

from radixlm.runtime.config import ServerArgs
from radixlm.runtime.executor.forward_batch import ForwardMode
from radixlm.runtime.executor.model_runner import ModelRunner
from radixlm.runtime.request import Req
from radixlm.runtime.sampling_params import SamplingParams
from radixlm.runtime.scheduler.scheduler import Scheduler

PROMPT = list(range(2000, 2040))
OTHER = list(range(3000, 3030))


@pytest.fixture(scope="module")
def sched(tiny_chat_path):
    args = ServerArgs(model_path=tiny_chat_path, dtype="float32", device="cpu",
                      context_length=256, max_total_tokens=1024)
    s = Scheduler(args, ModelRunner(args))
    s.steps = []  # (mode, batch size, tokens) of every forward
    forward = s.runner.forward

    def spy(fb):
        s.steps.append((fb.mode, fb.batch_size, fb.num_tokens))
        return forward(fb)

    s.runner.forward = spy
    return s


def _req(rid, ids, n, **kw) -> Req:
    return Req(rid, ids, SamplingParams(max_new_tokens=n, temperature=0), **kw)


def _run(sched, reqs, start_after: int = 0) -> list[list[int]]:
    """Add reqs[0]; the others once it has `start_after` tokens; step until all finish."""
    sched.add_request(reqs[0])
    pending = list(reqs[1:])
    while not all(r.finished for r in reqs):
        if pending and len(reqs[0].output_ids) >= start_after:
            for r in pending:
                sched.add_request(r)
            pending = []
        sched.step()
        sched.check_integrity()
    return [r.output_ids for r in reqs]


def test_cached_prompt_decodes_alone_and_mixed(sched):
    (first,) = _run(sched, [_req("a", PROMPT, 6)])
    (alone_other,) = _run(sched, [_req("o", OTHER, 12)])
    sched.steps.clear()
    (again,) = _run(sched, [_req("a2", PROMPT, 6)])  # all but the last prompt token cached
    assert again == first
    assert sched.steps[0] == (ForwardMode.DECODE, 1, 1), sched.steps[:2]
    assert all(m == ForwardMode.DECODE for m, _, _ in sched.steps)
    # a running request decodes in the same step as the cached prompt's admission (mixed)
    sched.steps.clear()
    other, third = _run(sched, [_req("o2", OTHER, 12), _req("a3", PROMPT, 6)], start_after=3)
    assert third == first
    assert other == alone_other
    assert (ForwardMode.DECODE, 2, 2) in sched.steps, sched.steps
    assert not any(m == ForwardMode.EXTEND and t == b for m, b, t in sched.steps), sched.steps


def test_prompt_logprobs_keep_the_extend(sched):
    sched.steps.clear()
    (toks,) = _run(sched, [_req("lp", PROMPT, 3, return_logprob=True, logprob_start_len=0)])
    assert sched.steps[0][0] == ForwardMode.EXTEND, sched.steps
