"""The overlap schedule (decode step N+1 launched before step N is completed) gives the same
tokens, logprobs and finish reasons as the plain schedule, and leaks no KV.

On the CPU nothing runs asynchronously, but the chaining logic (rows of requests that finished
while a step was in flight, requests leaving before their last token, stop tokens, penalties,
aborts between steps) is the same code as on the GPU, so it is checked here by turning it on."""

from __future__ import annotations

import pytest

PROMPTS = ["The capital of France is", "List three colors:", "1, 2, 3, 4,",
           "Write a haiku about rain.", "def fib(n):", "Q: What is 12 + 7?\nA:"]


def _params():
    # varied lengths so requests finish at different steps; one with penalties, one sampled
    # with a seed (its stream must not depend on the schedule), one with a stop string
    ps = [{"temperature": 0, "max_new_tokens": n} for n in (1, 5, 17, 30, 9, 24)]
    ps[2]["frequency_penalty"] = 0.8
    ps[3].update(temperature=0.9, seed=7)
    ps[4]["stop"] = ["\n\n"]
    return ps


@pytest.fixture(scope="module")
def eng(make_engine):
    return make_engine()


def _run(eng, overlap: bool):
    eng.scheduler.overlap = overlap
    eng.flush_cache()
    try:
        return eng.generate(PROMPTS, _params(), return_logprob=True, top_logprobs_num=2)
    finally:
        eng.scheduler.overlap = False


def test_overlap_matches_plain_schedule(eng, integrity):
    plain = _run(eng, False)
    steps_before = eng.get_stats()["forward_steps"]
    overlapped = _run(eng, True)
    assert eng.get_stats()["forward_steps"] > steps_before
    for a, b in zip(plain, overlapped):
        assert a["output_ids"] == b["output_ids"]
        assert a["meta_info"]["finish_reason"] == b["meta_info"]["finish_reason"]
        la = [x[0] for x in a["meta_info"]["output_token_logprobs"]]
        lb = [x[0] for x in b["meta_info"]["output_token_logprobs"]]
        # batch shapes differ (requests leave a step earlier), so fp32 sums round differently
        assert la == pytest.approx(lb, abs=1e-4)
    integrity(eng)


def test_overlap_chains_steps_and_settles_on_abort(eng, integrity):
    """Chaining really happens (a step is in flight between calls), and an abort while one is in
    flight completes it first and releases everything."""
    sched = eng.scheduler
    eng.flush_cache()

    def drive():
        from radixlm.runtime.request import Req
        from radixlm.runtime.sampling_params import SamplingParams

        sched.overlap = True
        try:
            ids = eng.tokenizer.encode("Once upon a time")
            reqs = [Req(f"ov{i}", ids, SamplingParams(temperature=0, max_new_tokens=20,
                                                      ignore_eos=True)) for i in range(3)]
            for r in reqs:
                sched.add_request(r)
            in_flight_seen = 0
            for _ in range(6):
                sched.step()
                in_flight_seen += sched.inflight is not None
            aborted = sched.abort_request("ov1")
            assert aborted is not None and aborted.finished
            assert sched.inflight is None
            while sched.has_runnable_work():
                sched.step()
            return in_flight_seen, [len(r.output_ids) for r in reqs]
        finally:
            sched.overlap = False

    seen, lens = eng._call_in_loop(drive)
    assert seen >= 3
    assert lens[0] == lens[2] == 20 and lens[1] < 20
    integrity(eng)


def test_a_step_lists_each_request_once(eng, integrity):
    """Requests arriving while others decode (mixed steps) with overlap: a running request
    completes the step in flight and decodes again in the mixed extend, and step() used to
    list it twice; the server then sent a finished request's output ids twice."""
    import random

    from radixlm.runtime.request import Req
    from radixlm.runtime.sampling_params import SamplingParams

    sched = eng.scheduler
    eng.flush_cache()

    def drive():
        sched.overlap = True
        try:
            rng = random.Random(1)
            reqs = [Req(f"once{i}", [rng.randrange(100, 40000) for _ in range(rng.randint(8, 40))],
                        SamplingParams(temperature=0, max_new_tokens=rng.randint(3, 12),
                                       ignore_eos=True)) for i in range(12)]
            pending, repeats = list(reqs), []
            while pending or sched.has_runnable_work():
                if pending and rng.random() < 0.4:
                    sched.add_request(pending.pop(0))
                if sched.has_runnable_work():
                    out = sched.step()
                    repeats += [r.rid for r in out if sum(x is r for x in out) > 1]
            return repeats, [(len(r.output_ids), r.sampling_params.max_new_tokens)
                                     for r in reqs]
        finally:
            sched.overlap = False

    repeats, lens = eng._call_in_loop(drive)
    assert repeats == []
    assert all(n == want for n, want in lens), lens
    integrity(eng)
