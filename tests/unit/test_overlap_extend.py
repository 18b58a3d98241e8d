"""Extends launched inside the overlap schedule (scheduler/overlap_extend.py): requests arriving
while others decode are admitted and prefilled, with the running requests' decode rows chained
onto the in-flight step's samples, before that step completes. The tokens, finish reasons and
logprobs are those of the plain schedule, and no KV leaks.

On the CPU nothing is asynchronous, but the chaining (the running rows' device ids, rows of
requests that finished in the step in flight, the joiners' first token read one step later) is
the same code as on the GPU, so it is checked here with the overlap schedule turned on."""

from __future__ import annotations

import contextlib

import pytest

from radixlm.runtime.request import Req
from radixlm.runtime.sampling_params import SamplingParams


def _requests(tokenizer):
    texts = ["The capital of France is", "List three colors:", "1, 2, 3, 4,",
             "Write a haiku about rain.", "def fib(n):", "Q: What is 12 + 7?\nA:",
             "Once upon a time", "The best way to learn is"]
    params = [dict(temperature=0, max_new_tokens=n) for n in (12, 1, 20, 7, 16, 9, 25, 3)]
    params[2]["frequency_penalty"] = 0.8
    params[3].update(temperature=0.9, seed=7)  # its stream must not depend on the schedule
    params[4]["stop"] = ["\n\n"]
    reqs = []
    for i, (text, p) in enumerate(zip(texts, params)):
        req = Req(f"ox{i}", tokenizer.encode(text), SamplingParams(**p))
        if i in (5, 6):  # output logprobs ride along; prompt logprobs take the plain order
            req.return_logprob, req.top_logprobs_num = True, 2
            if i == 6:
                req.logprob_start_len = 0
        reqs.append(req)
    return reqs


@contextlib.contextmanager
def _overlap(sched, on: bool = True):
    """The overlap schedule turned on (or off) by hand for the block, off after it."""
    sched.overlap = on
    try:
        yield
    finally:
        sched.overlap = False


def _drive(eng, overlap: bool):
    """Two requests first, then one more after every third step: most arrive while others
    decode (with overlap, while a decode step or an extend is in flight)."""
    sched = eng.scheduler
    eng.flush_cache()

    def run():
        with _overlap(sched, overlap):
            reqs = _requests(eng.tokenizer)
            pending = list(reqs)
            for _ in range(2):
                sched.add_request(pending.pop(0))
            in_flight_extends, steps = 0, 0
            while pending or sched.has_runnable_work():
                before = sched.stats["overlapped_extend_steps"]
                if sched.has_runnable_work():
                    sched.step()
                    steps += 1
                in_flight_extends += sched.stats["overlapped_extend_steps"] > before
                if pending and steps % 3 == 0:
                    sched.add_request(pending.pop(0))
            return reqs, in_flight_extends

    return eng._call_in_loop(run)


@pytest.fixture(scope="module")
def eng(make_engine):
    return make_engine()


def test_overlapped_extends_match_the_plain_schedule(eng, integrity):
    plain, none_launched = _drive(eng, overlap=False)
    assert none_launched == 0
    overlapped, launched = _drive(eng, overlap=True)
    assert launched >= 3  # the arrivals were admitted beside a step in flight
    for a, b in zip(plain, overlapped):
        assert a.output_ids == b.output_ids, a.rid
        assert a.finish.reason == b.finish.reason
        assert len(b.output_ids) <= b.sampling_params.max_new_tokens
        la, lb = a.output_token_logprobs, b.output_token_logprobs
        assert len(la) == len(lb) and lb == pytest.approx(la, abs=1e-4)  # batch shapes differ: fp32 sums round apart
        pa, pb = a.input_token_logprobs[1:], b.input_token_logprobs[1:]  # [0] is None
        assert len(pa) == len(pb) and pb == pytest.approx(pa, abs=1e-4)
    integrity(eng)


def test_prompt_logprobs_take_the_plain_order(eng, integrity):
    """A waiting request that wants prompt logprobs reads them on the host in its extend's step:
    no extend is launched beside a step in flight while it waits."""
    sched = eng.scheduler
    eng.flush_cache()

    def run():
        with _overlap(sched):
            ids = eng.tokenizer.encode("Once upon a time")
            first = Req("pl0", ids, SamplingParams(temperature=0, max_new_tokens=8,
                                                   ignore_eos=True))
            sched.add_request(first)
            sched.step()
            sched.step()
            assert sched.inflight is not None  # the decode chain is running
            late = Req("pl1", eng.tokenizer.encode("A B C D"),
                       SamplingParams(temperature=0, max_new_tokens=2))
            late.return_logprob, late.logprob_start_len = True, 0
            sched.add_request(late)
            before = sched.stats["overlapped_extend_steps"]
            while sched.has_runnable_work():
                sched.step()
            return sched.stats["overlapped_extend_steps"] - before, late

    launched, late = eng._call_in_loop(run)
    assert launched == 0
    assert len(late.input_token_logprobs) == len(late.origin_input_ids)
    integrity(eng)


def test_random_arrivals_and_aborts_with_extends_in_flight(eng, integrity):
    """Requests arriving at random steps (many while an extend or a decode is in flight), some
    aborted at random steps, some ending on a stop string or at max_new_tokens: every request
    that was not aborted gets the plain schedule's tokens, and no KV leaks."""
    _random_arrivals_and_aborts(eng, integrity)


def test_random_arrivals_and_aborts_with_chunks_in_flight(make_engine, integrity):
    """The same with prompts chunked 16 tokens a step (chunks launched beside the step in
    flight, some of them aborted mid-prompt)."""
    _random_arrivals_and_aborts(make_engine(chunked_prefill_size=16), integrity)


def _random_arrivals_and_aborts(eng, integrity):
    import random

    sched = eng.scheduler

    def run(overlap: bool, seed: int):
        eng.flush_cache()
        rng = random.Random(seed)

        def drive():
            with _overlap(sched, overlap):
                reqs = []
                for i in range(14):
                    ids = [rng.randrange(100, 40000) for _ in range(rng.randint(4, 60))]
                    p = dict(temperature=0, max_new_tokens=rng.randint(1, 14),
                             ignore_eos=rng.random() < 0.5)
                    if rng.random() < 0.2:
                        p["stop"] = ["\n"]
                    reqs.append(Req(f"rnd{seed}-{i}", ids, SamplingParams(**p)))
                aborts = {f"rnd{seed}-{i}": rng.randint(1, 12) for i in rng.sample(range(14), 3)}
                launched = sched.stats["overlapped_extend_steps"]
                pending, step, aborted = list(reqs), 0, set()
                while pending or sched.has_runnable_work():
                    while pending and rng.random() < 0.35:
                        sched.add_request(pending.pop(0))
                    if sched.has_runnable_work():
                        sched.step()
                    step += 1
                    for rid, at in aborts.items():
                        if at == step and sched.abort_request(rid) is not None:
                            aborted.add(rid)
                    if not sched.has_runnable_work() and pending:
                        sched.add_request(pending.pop(0))
                in_flight[overlap] += sched.stats["overlapped_extend_steps"] - launched
                return {r.rid: list(r.output_ids) for r in reqs}, aborted

        return eng._call_in_loop(drive)

    compared, in_flight = 0, {False: 0, True: 0}
    for seed in range(3):
        plain, aborted_plain = run(False, seed)
        overlapped, aborted = run(True, seed)
        for rid, ids in overlapped.items():
            if rid not in aborted and rid not in aborted_plain:
                assert ids == plain[rid], rid
                compared += 1
        integrity(eng)
    assert compared >= 30 and in_flight[False] == 0 and in_flight[True] >= 10, in_flight


def _queue_behind(eng, reqs):
    """Submit `reqs` at once with overlap on and step until idle. Returns the waiting count at
    each plain step (one that completed the step in flight first), at each admission round,
    and each request's output length."""
    sched = eng.scheduler

    def run():
        with _overlap(sched):
            for r in reqs:
                sched.add_request(r)
            plain, rounds = [], []
            real_step, real_admit = sched._step, sched._admit
            sched._step = lambda: (plain.append(len(sched.waiting)), real_step())[1]
            sched._admit = lambda **k: (rounds.append(len(sched.waiting)), real_admit(**k))[1]
            try:
                while sched.has_runnable_work():
                    sched.step()
            finally:
                sched._step, sched._admit = real_step, real_admit
            return plain, rounds, [len(r.output_ids) for r in reqs]

    return eng._call_in_loop(run)


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True)


def test_a_full_batch_keeps_chaining_while_requests_wait(make_engine, integrity):
    """With the running batch at max_running_requests, a waiting request cannot be admitted
    whatever the step does: the decode steps stay chained (before, every step completed the one
    in flight first, as if an admission were due)."""
    eng = make_engine(max_running_requests=2)
    ids = eng.tokenizer.encode("Once upon a time")
    plain, _, lens = _queue_behind(eng, [Req(f"full{i}", ids + [i + 7], _greedy(12))
                                         for i in range(3)])
    assert lens == [12, 12, 12]
    assert plain.count(1) <= 2, plain  # (each step while one waited, before)
    integrity(eng)


def test_a_saturated_pool_keeps_chaining_while_requests_wait(make_engine, integrity):
    """A waiting request the KV pool has no room for: the round before the launch admits none,
    and the running batch's decode is chained anyway (before, each such step completed the one
    in flight first and ran the admission again: no overlap while a queue waited on memory)."""
    eng = make_engine(max_total_tokens=256)
    plain, rounds, lens = _queue_behind(eng, [Req(f"sat{i}", [100 + i] * 100, _greedy(12))
                                              for i in range(3)])
    assert lens == [12, 12, 12]
    assert plain.count(1) <= 2, plain
    # and the round that admitted nothing is not run again each step while nothing changes
    assert rounds.count(1) <= 3, rounds
    integrity(eng)


def test_a_chunked_prompt_continues_beside_the_step_in_flight(make_engine, integrity):
    """Long prompts chunked (24 tokens a step) while others decode: each next chunk is launched
    before the step in flight completes (before, every chunk after the first waited for it), and
    every request gets the plain schedule's tokens and logprobs."""
    eng = make_engine(chunked_prefill_size=24)
    sched = eng.scheduler
    texts = ["The capital of France is", "Write a long story about a dragon who " * 6,
             "List three colors:", "def fib(n):\n    " * 9, "1, 2, 3, 4,"]

    def run(overlap: bool):
        eng.flush_cache()
        beside_chunks = []
        real = sched._launch_extend_beside

        def beside(prev):
            chunk = sched.chunked
            step = real(prev)
            beside_chunks.append(chunk is not None and step is not None)
            return step

        def drive():
            with _overlap(sched, overlap):
                reqs = []
                for i, text in enumerate(texts):
                    req = Req(f"ch{overlap}{i}", eng.tokenizer.encode(text), _greedy(10 + i))
                    req.return_logprob = True
                    reqs.append(req)
                pending, steps = list(reqs), 0
                sched._launch_extend_beside = beside
                try:
                    while pending or sched.has_runnable_work():
                        if pending and steps % 2 == 0:
                            sched.add_request(pending.pop(0))
                        if sched.has_runnable_work():
                            sched.step()
                        steps += 1
                finally:
                    sched._launch_extend_beside = real
                return reqs

        return eng._call_in_loop(drive), sum(beside_chunks)

    plain, none = run(False)
    overlapped, continued = run(True)
    assert none == 0 and continued >= 4, continued  # both long prompts' later chunks
    for a, b in zip(plain, overlapped):
        assert a.output_ids == b.output_ids, a.rid
        assert b.output_token_logprobs == pytest.approx(a.output_token_logprobs, abs=1e-4)
    integrity(eng)
