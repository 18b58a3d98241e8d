"""Preloads through the scheduler (fp32, the tiny random Llama of test_hicache_engine.py): on CUDA a
load of a request's host prefix runs on the copy stream beside the forwards queued after it, and
the request waits for the copy's event before a round admits it (scheduler/prefill.py). Here the
CPU's synchronous copy stands in for the DMA and a fake event reports it done only after a few
polls, so the waiting, the hand-over of the loaded path's lock at admission, other requests
matching a path still being loaded, and an abort while waiting all run: greedy tokens equal the
plain engine's, the tiers' hit counts are the load's, and the KV accounting is exact."""

from __future__ import annotations

import threading
import time

import pytest

from radixlm.runtime.mem_cache.kv_mover import KVMover
from test_hicache_engine import PROMPTS, SP, make_engine, reference, tiny_path  # noqa: F401


class FakeEvent:
    """A CUDA event's query() for a copy that completes after `polls` queries (or when
    `release` is set, with polls=None)."""

    def __init__(self, polls, release=None):
        self.polls, self.release = polls, release

    def synchronize(self) -> None:  # (an abort waits for the copy: it is done)
        self.polls, self.release = 0, None
        self.query = lambda: True

    def query(self) -> bool:
        if self.polls is None:
            return self.release.is_set()
        self.polls -= 1
        return self.polls < 0


@pytest.fixture
def slow_loads(monkeypatch):
    """Detached loads copy at once (the CPU's path) and then look in flight for 3 polls, or
    until `gate` is set when `gate.hold` is on."""
    gate = threading.Event()
    gate.hold = False
    real = KVMover.to_device

    def to_device(self, host_idx, dev_idx):  # (the scheduler's loads are all preloads)
        real(self, host_idx, dev_idx)
        return FakeEvent(None, gate) if gate.hold else FakeEvent(3)

    monkeypatch.setattr(KVMover, "to_device", to_device)
    monkeypatch.setattr(KVMover, "loads_async", True)  # as on CUDA
    return gate


def _host_only(make_engine):  # noqa: F811
    """Device pool of 110 tokens (two 50-token conversations), host pool 3x: no store."""
    return make_engine(max_total_tokens=110, enable_hicache=True, hicache_ratio=3)


def _stats(eng) -> dict:
    return eng._call_in_loop(lambda: dict(eng.scheduler.tree_cache.counters))


def test_preloaded_requests_match_the_plain_engine(make_engine, integrity, reference,  # noqa: F811
                                                   slow_loads):
    eng = _host_only(make_engine)
    for i in range(4):  # the device pool holds two: the first two end up on the host only
        assert eng.generate(input_ids=PROMPTS[i], sampling_params=SP)["output_ids"] == reference[i]
    integrity(eng)
    out = eng.generate(input_ids=PROMPTS[0], sampling_params=SP)
    assert out["output_ids"] == reference[0]
    assert out["meta_info"]["cached_tokens_details"]["host"] == 47, out["meta_info"]
    assert _stats(eng)["preloads"] == 1
    integrity(eng)
    # all four at once: loads in flight while others are admitted, each waiting for its own
    outs = eng.generate(input_ids=PROMPTS, sampling_params=SP)
    assert [o["output_ids"] for o in outs] == reference
    details = [o["meta_info"]["cached_tokens_details"] for o in outs]
    assert all(sum(d.values()) == o["meta_info"]["cached_tokens"] for d, o in zip(details, outs))
    assert _stats(eng)["preloads"] > 1
    integrity(eng)


def test_a_request_on_a_path_being_loaded_waits(make_engine, integrity, reference,  # noqa: F811
                                                slow_loads):
    eng = _host_only(make_engine)
    for i in range(4):
        eng.generate(input_ids=PROMPTS[i], sampling_params=SP)
    slow_loads.hold = True
    # two requests on PROMPTS[0]'s host path: the first loads it, the second matches the nodes
    # the load made and must not run before the copy is done
    outs = {}
    threads = [threading.Thread(target=lambda k=k: outs.update({k: eng.generate(
        input_ids=PROMPTS[0] + [7 + k], sampling_params=SP)})) for k in range(2)]
    for t in threads:
        t.start()
    time.sleep(0.3)
    assert not outs, "a request ran before its prefix's copy was done"
    slow_loads.set()
    for t in threads:
        t.join(timeout=10)
    assert len(outs) == 2
    integrity(eng)


def test_abort_while_preloading_releases_the_path(make_engine, integrity, slow_loads):  # noqa: F811
    eng = _host_only(make_engine)
    for i in range(4):
        eng.generate(input_ids=PROMPTS[i], sampling_params=SP)
    slow_loads.hold = True
    done = {}
    thread = threading.Thread(target=lambda: done.update(eng.generate(
        input_ids=PROMPTS[1], sampling_params=SP, rid="loading")))
    thread.start()

    def preloading():
        w = eng.scheduler.waiting
        return bool(w) and w[0].preload is not None

    deadline = time.monotonic() + 5
    while not eng._call_in_loop(preloading):
        assert time.monotonic() < deadline, "the request never preloaded"
        time.sleep(0.01)
    eng.abort_request("loading")
    thread.join(timeout=5)
    assert done["meta_info"]["finish_reason"]["type"] == "abort"
    slow_loads.set()
    integrity(eng)  # no lock left on the loaded path


def test_the_batch_decodes_with_overlap_while_a_load_is_in_flight(make_engine,  # noqa: F811
                                                                   integrity, reference,
                                                                   slow_loads, monkeypatch):
    """A request that arrives while a batch runs has its host prefix's copy started beside the
    running step, after the next one's launch (`_preload_waiting`, not an admission round, nor
    before the launch, where the host's time is the GPU's), and while it waits for the
    copy, which it must, the running batch's overlap schedule goes on (chaining); the loaded
    request is admitted once the copy lands, with its host hits reported (CPU: the overlap
    logic turned on by hand, as tests/unit/test_overlap_schedule.py does)."""
    from radixlm.runtime.scheduler.prefill import PrefillAdder

    started = []
    real_preload = PrefillAdder.preload

    def preload(self, req):
        beside = eng.scheduler.inflight is not None  # the step it runs beside was launched
        ok = real_preload(self, req)
        started.append((ok, beside))
        return ok

    monkeypatch.setattr(PrefillAdder, "preload", preload)
    eng = _host_only(make_engine)
    for i in range(4):
        eng.generate(input_ids=PROMPTS[i], sampling_params=SP)
    sched = eng.scheduler
    real, chained = sched._chainable, []

    def chainable():
        chain = real()
        if any(r.preload is not None for r in sched.waiting):
            chained.append(bool(chain))
        return chain

    slow_loads.hold = True
    outs = {}
    eng._call_in_loop(lambda: setattr(sched, "_chainable", chainable))
    eng._call_in_loop(lambda: setattr(sched, "overlap", True))
    try:
        long_run = threading.Thread(target=lambda: outs.update(long=eng.generate(
            input_ids=[5, 6, 7], sampling_params=dict(SP, max_new_tokens=50))))
        loaded = threading.Thread(target=lambda: outs.update(loaded=eng.generate(
            input_ids=PROMPTS[0], sampling_params=SP)))
        long_run.start()
        deadline = time.monotonic() + 10
        while not eng._call_in_loop(lambda: sched.inflight is not None):  # decoding, chained
            assert time.monotonic() < deadline
        loaded.start()
        while not any(chained):
            assert "long" not in outs, "the batch never chained while the load was in flight"
            assert time.monotonic() < deadline
            time.sleep(0.005)
        assert "loaded" not in outs
        slow_loads.set()
        long_run.join(timeout=10)
        loaded.join(timeout=10)
    finally:
        eng._call_in_loop(lambda: setattr(sched, "overlap", False))
        eng._call_in_loop(lambda: setattr(sched, "_chainable", real))
    assert outs["loaded"]["output_ids"] == reference[0]
    assert outs["loaded"]["meta_info"]["cached_tokens_details"]["host"] == 47
    assert started.count((True, True)) == 1, started  # the copy started beside a launched step
    assert len(outs["long"]["output_ids"]) == 50
    integrity(eng)


def test_the_loop_polls_a_preload_without_stepping(make_engine, integrity, reference,  # noqa: F811
                                                   slow_loads):
    """While the only work is a request waiting for its preload's copy, the scheduler's loop
    polls the copy's event (every millisecond) instead of stepping without pause: the loop
    held the GIL against the store's fetcher threads through a restart's reads."""
    eng = _host_only(make_engine)
    for i in range(4):
        eng.generate(input_ids=PROMPTS[i], sampling_params=SP)
    sched = eng.scheduler
    steps, real_step = [0], sched.step

    def counted():
        steps[0] += 1
        return real_step()

    eng._call_in_loop(lambda: setattr(sched, "step", counted))
    slow_loads.hold = True
    out = {}
    thread = threading.Thread(target=lambda: out.update(eng.generate(input_ids=PROMPTS[0],
                                                                     sampling_params=SP)))
    try:
        thread.start()
        deadline = time.monotonic() + 5
        while not eng._call_in_loop(lambda: sched.waits_on_copies()):
            assert time.monotonic() < deadline, "the request never preloaded"
            time.sleep(0.005)
        before = steps[0]
        time.sleep(0.3)
        assert steps[0] - before <= 3, steps[0] - before  # (it spun: thousands)
        slow_loads.set()
        thread.join(timeout=10)
    finally:
        eng._call_in_loop(lambda: setattr(sched, "step", real_step))
    assert out["output_ids"] == reference[0]
    integrity(eng)


def test_a_round_before_a_launch_leaves_host_copies_for_later():
    """An admission round run before a launch (`start_loads` False: the overlapped extend's)
    skips a request whose prefix must come from the host, without starting its copy or keeping
    a lock: `_preload_waiting` starts the copy after the launch. A plain round loads it."""
    from hicache_helpers import make_tiered, put
    from radixlm.runtime.request import Req
    from radixlm.runtime.sampling_params import SamplingParams
    from radixlm.runtime.scheduler.prefill import AddResult, PrefillAdder

    cache, pool, alloc = make_tiered(capacity=16, host_capacity=24)
    seq = [5, 6, 7, 8, 9, 10]
    assert put(cache, pool, alloc, seq)
    cache.evict(16)  # on the host only now
    assert cache.match_prefix(seq).lower_len == 6

    def request():
        return Req("r", seq + [11], SamplingParams(max_new_tokens=2))

    before = dict(cache.counters)
    req = request()
    adder = PrefillAdder(cache, alloc, [], 0.5, 1000, 0, start_loads=False)
    assert adder.add(req) == AddResult.DEFERRED and not adder.admitted
    assert req.preload is None and cache.counters == before  # no copy started
    cache.check_integrity()  # and no lock left behind
    req = request()
    adder = PrefillAdder(cache, alloc, [], 0.5, 1000, 0)
    assert adder.add(req) == AddResult.ADDED  # (the CPU's load is a copy: done at once)
    assert req.kv_len == 6
