"""The two disaggregation roles (scheduler/pd_prefill.py, pd_decode.py) in one process: a prefill
Scheduler and a decode Scheduler on the tiny chat model, real links over loopback gloo, driven
step by step without HTTP. What the server tests cannot reach cheaply: a decode pool with no room
(the request waits, then goes on), aborts while the KV is on its way, and the accounting (free +
tree + running + reserved == capacity) at every step."""

from __future__ import annotations

import time

import pytest

from radixlm.net import free_port
from radixlm.runtime.config import ServerArgs
from radixlm.runtime.executor.model_runner import ModelRunner
from radixlm.runtime.request import Req
from radixlm.runtime.sampling_params import SamplingParams
from radixlm.runtime.scheduler.pd_decode import DecodeSide
from radixlm.runtime.scheduler.pd_prefill import PrefillSide
from radixlm.runtime.scheduler.scheduler import Scheduler

PROMPT = list(range(1000, 1090))  # 90 tokens: two chunks of 64 on the prefill side


def _scheduler(path: str, mode=None, **kw) -> Scheduler:
    args = ServerArgs(model_path=path, dtype="float32", device="cpu", context_length=512,
                      max_total_tokens=kw.pop("max_total_tokens", 1024), chunked_prefill_size=64,
                      disaggregation_mode=mode, disaggregation_timeout=kw.pop("timeout", 5.0),
                      disaggregation_bootstrap_port=kw.pop("port", 8998), **kw)
    sched = Scheduler(args, ModelRunner(args))
    role = {"prefill": PrefillSide, "decode": DecodeSide}.get(mode)
    sched.pd = role(sched, args) if role else None
    return sched


def _req(rid: str, ids=PROMPT, n=8) -> Req:
    return Req(rid, ids, SamplingParams(max_new_tokens=n, temperature=0))


def _drive(scheds, until, timeout=30.0) -> list[Req]:
    """Poll and step every scheduler until `until()`; returns the requests failed by polls."""
    failed, deadline = [], time.monotonic() + timeout
    while not until():
        assert time.monotonic() < deadline, "no progress"
        for s in scheds:
            failed += s.pd.poll() if s.pd is not None else []
            if s.has_runnable_work():
                s.step()
            s.check_integrity()
        time.sleep(0.001)
    return failed


@pytest.fixture(scope="module")
def pair(tiny_chat_path):
    port = free_port()
    pre = _scheduler(tiny_chat_path, "prefill", port=port)
    dec = _scheduler(tiny_chat_path, "decode", max_total_tokens=160)
    ref = _scheduler(tiny_chat_path)
    yield pre, dec, ref, port
    pre.pd.close()
    dec.pd.close()


def _colocated(ref: Scheduler, ids) -> list[int]:
    req = _req("ref", ids)
    ref.add_request(req)
    while not req.finished:
        ref.step()
    return req.output_ids


def test_hand_off_matches_colocated(pair):
    pre, dec, ref, port = pair
    p, d = _req("a"), _req("a")
    pre.pd.add_request(p, "127.0.0.1", port, 1)
    dec.pd.add_request(d, "127.0.0.1", port, 1)
    assert _drive([pre, dec], lambda: d.finished) == []
    assert d.output_ids == _colocated(ref, PROMPT)
    assert p.output_ids == [] and pre.stats["pd_pages_sent"] >= 2  # one page per chunk
    assert dec.stats["pd_tokens_received"] == len(PROMPT) - 1


def test_full_decode_pool_waits_then_goes_on(pair):
    """No free slot on the decode side: the request waits (no READY yet), the prefill side
    holds it; once slots free up it completes as usual."""
    pre, dec, ref, port = pair
    dec.flush_cache()
    grab = dec.allocator.alloc(dec.allocator.available_size() - 20)  # stands for busy requests
    ids = list(range(2000, 2060))
    p, d = _req("b", ids), _req("b", ids)
    pre.pd.add_request(p, "127.0.0.1", port, 2)
    dec.pd.add_request(d, "127.0.0.1", port, 2)
    for _ in range(20):
        pre.pd.poll()
        assert dec.pd.poll() == []
        assert dec.pd.unreserved and 2 in pre.pd.held  # waiting on both sides, nothing failed
        time.sleep(0.005)
    dec.allocator.free(grab)
    assert _drive([pre, dec], lambda: d.finished) == []
    assert d.output_ids == _colocated(ref, ids)


def test_aborts_while_the_kv_is_on_its_way(pair):
    pre, dec, ref, port = pair
    ids = list(range(3000, 3070))
    d = _req("c", ids)
    dec.pd.add_request(d, "127.0.0.1", port, 3)  # the prefill side never gets this request
    assert dec.pd.held_slots() == len(ids) - 1
    dec.check_integrity()  # the reserved slots are counted
    assert dec.pd.abort("c") is d and d.finish.status == 499
    assert dec.pd.held_slots() == 0
    p = _req("e", ids)
    pre.pd.add_request(p, "127.0.0.1", port, 4)  # no decode side asks for it
    assert pre.pd.abort("e") is p and not pre.pd.busy()
    # the READY of room 3 reached the prefill side: its request never comes, so a CANCEL does
    # (after the timeout); the other rooms of the link still work meanwhile
    q, e = _req("f", PROMPT[:40]), _req("f", PROMPT[:40])
    pre.pd.add_request(q, "127.0.0.1", port, 5)
    dec.pd.add_request(e, "127.0.0.1", port, 5)
    assert _drive([pre, dec], lambda: e.finished) == []
    assert e.output_ids == _colocated(ref, PROMPT[:40])
    dec.check_integrity()
    pre.check_integrity()


def test_kv_that_never_comes_times_out_on_the_decode_side(pair):
    """The prefill side is up but never gets the request: the decode side fails the room at
    --disaggregation-timeout (504) with its slots back; the link stays usable."""
    pre, dec, ref, port = pair
    saved, dec.pd.timeout = dec.pd.timeout, 0.3
    try:
        d = _req("g", list(range(4000, 4030)))
        assert dec.pd.add_request(d, "127.0.0.1", port, 6) == []
        failed = _drive([pre, dec], lambda: d.finished, timeout=10)
    finally:
        dec.pd.timeout = saved
    assert failed == [d] and d.finish.status == 504 and "did not arrive" in d.finish.message
    assert dec.pd.held_slots() == 0
    dec.check_integrity()
    p, e = _req("h", PROMPT[:30]), _req("h", PROMPT[:30])
    pre.pd.add_request(p, "127.0.0.1", port, 7)
    dec.pd.add_request(e, "127.0.0.1", port, 7)
    assert _drive([pre, dec], lambda: e.finished) == []
    assert e.output_ids == _colocated(ref, PROMPT[:30])
