"""One request's failure inside the scheduler fails that request only (runtime/scheduler/
isolation.py): an exception injected into one request's handling, for one rid of a batch, gives
that request an error finish_reason (status_code 500), the others the tokens of a clean run, and
the engine goes on serving with its KV accounting intact. A CUDA out-of-memory in a forward fails
that batch (503) and the engine goes on. Each test kills the scheduler thread without isolation."""

from __future__ import annotations

import logging
import pickle

import pytest
import torch

from radixlm.runtime.scheduler import token_processing, waiting
from radixlm.runtime.sampling.sampling_batch_info import SamplingBatchInfo
from radixlm.server.errors import server_fault
from radixlm.server.metrics import ServerMetrics

GREEDY = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
PROMPTS = [[1, 100 + 7 * i, 200 + 11 * i, 300 + 13 * i, 400 + i] for i in range(4)]
BAD = 2  # the index of the request the injection fails


@pytest.fixture(scope="module")
def eng(tiny_chat_path):
    import radixlm

    e = radixlm.Engine(model_path=tiny_chat_path, dtype="float32", max_total_tokens=4096,
                       context_length=512)
    yield e
    e.shutdown()


def _run(eng, tag: str, regex_params=None, **kw):
    rids = [f"{tag}-{i}" for i in range(len(PROMPTS))]
    params = [dict(GREEDY, **(regex_params or {})) for _ in PROMPTS]
    return rids, eng.generate(input_ids=PROMPTS, sampling_params=params, rid=rids, **kw)


@pytest.fixture(scope="module")
def clean(eng):
    """Each prompt's greedy output in a batch where nothing fails."""
    _, outs = _run(eng, "clean")
    return [o["output_ids"] for o in outs]


def _check_isolated(eng, clean, outs, caplog, failures_before: int, bad_rid: str):
    for i, o in enumerate(outs):
        reason = o["meta_info"]["finish_reason"]
        if i == BAD:
            assert reason["type"] == "abort" and reason["status_code"] == 500, reason
            assert "injected" in reason["message"]
            assert server_fault(reason) == (500, reason["message"])  # an error in every API
        else:
            assert reason["type"] == "length", reason
            assert o["output_ids"] == clean[i]
    assert eng.get_stats()["request_failures"] == failures_before + 1
    logged = [r for r in caplog.records if bad_rid in r.getMessage()]
    assert logged and logged[0].exc_info is not None  # the rid and its traceback
    eng.wait_idle()
    eng.check_integrity()  # the failed request's KV and locks went back
    again = eng.generate(input_ids=PROMPTS[BAD], sampling_params=dict(GREEDY))
    assert again["output_ids"] == clean[BAD]  # the engine serves on
    eng.wait_idle()
    eng.check_integrity()


def _raise_for(rid: str, real):
    """`real` wrapped to raise for the request `rid` (its first argument) once it has output."""
    def wrapped(req, *a, **kw):
        if req.rid == rid and len(req.output_ids) >= 3:
            raise RuntimeError("injected failure")
        return real(req, *a, **kw)
    return wrapped


def test_stop_check_failure_mid_decode(eng, clean, monkeypatch, caplog):
    caplog.set_level(logging.ERROR)
    before = eng.get_stats().get("request_failures", 0)
    monkeypatch.setattr(token_processing, "check_finish",
                        _raise_for("stop-2", token_processing.check_finish))
    _, outs = _run(eng, "stop")
    monkeypatch.undo()
    _check_isolated(eng, clean, outs, caplog, before, "stop-2")


def test_prompt_logprobs_failure(eng, clean, monkeypatch, caplog):
    caplog.set_level(logging.ERROR)
    before = eng.get_stats().get("request_failures", 0)
    real = token_processing.record_input_ids_logprobs

    def failing(req, *a, **kw):
        if req.rid == "lp-2":
            raise RuntimeError("injected failure")
        return real(req, *a, **kw)

    monkeypatch.setattr(token_processing, "record_input_ids_logprobs", failing)
    _, outs = _run(eng, "lp", return_logprob=True, logprob_start_len=0)
    monkeypatch.undo()
    _check_isolated(eng, clean, outs, caplog, before, "lp-2")


def test_sampling_parameters_failure(eng, clean, monkeypatch, caplog):
    caplog.set_level(logging.ERROR)
    before = eng.get_stats().get("request_failures", 0)
    real = SamplingBatchInfo.from_reqs.__func__

    def failing(cls, reqs, *a, **kw):  # a batch holding the bad request cannot build
        if any(r.rid == "sp-2" for r in reqs):
            raise ValueError("injected failure")
        return real(cls, reqs, *a, **kw)

    monkeypatch.setattr(SamplingBatchInfo, "from_reqs", classmethod(failing))
    _, outs = _run(eng, "sp")
    monkeypatch.undo()
    _check_isolated(eng, clean, outs, caplog, before, "sp-2")


def test_enqueue_failure(eng, clean, monkeypatch, caplog):
    caplog.set_level(logging.ERROR)
    before = eng.get_stats().get("request_failures", 0)
    real = waiting.constraint_of
    calls = []

    def failing(sp):  # constraint_of sees only the params: fail the batch's third call
        calls.append(1)
        if len(calls) == BAD + 1:
            raise RuntimeError("injected failure")
        return real(sp)

    monkeypatch.setattr(waiting, "constraint_of", failing)
    _, outs = _run(eng, "enq")
    monkeypatch.undo()
    _check_isolated(eng, clean, outs, caplog, before, "enq-2")


class _FailingMatcher:
    """A grammar matcher whose mask fill raises from its third call on."""

    def __init__(self, real):
        self._real, self._calls = real, 0

    def fill_next_token_bitmask(self, bitmask, row):
        self._calls += 1
        if self._calls >= 3:
            raise RuntimeError("injected failure")
        return self._real.fill_next_token_bitmask(bitmask, row)

    def __getattr__(self, name):
        return getattr(self._real, name)


def test_grammar_mask_failure(eng, monkeypatch, caplog):
    caplog.set_level(logging.ERROR)
    regex = {"regex": "[a-z ]{4,40}"}
    _, clean_outs = _run(eng, "gclean", regex_params=regex)
    clean = [o["output_ids"] for o in clean_outs]
    before = eng.get_stats().get("request_failures", 0)
    pool = eng.scheduler.grammars  # created by the clean run; matchers come from it in order
    made = []
    real = pool.matcher

    def matcher(compiled):  # admission order is submission order: the third is the bad one
        made.append(1)
        m = real(compiled)
        return _FailingMatcher(m) if len(made) == BAD + 1 else m

    monkeypatch.setattr(pool, "matcher", matcher)
    _, outs = _run(eng, "gram", regex_params=regex)
    monkeypatch.undo()
    for i, o in enumerate(outs):
        reason = o["meta_info"]["finish_reason"]
        if i == BAD:
            assert reason["type"] == "abort" and reason["status_code"] == 500, reason
        else:
            assert reason["type"] != "abort" and o["output_ids"] == clean[i], reason
    assert eng.get_stats()["request_failures"] == before + 1
    assert any("gram-2" in r.getMessage() for r in caplog.records)
    eng.wait_idle()
    eng.check_integrity()


# the prefill's forward; a decode step's forward after one decode step; the first decode sampling
@pytest.mark.parametrize("where, oom_at", [("forward", 1), ("forward", 3), ("sampler", 2)])
def test_cuda_oom_fails_the_batch_and_serving_goes_on(eng, clean, monkeypatch, caplog, where,
                                                      oom_at):
    caplog.set_level(logging.ERROR)
    eng.flush_cache()  # the prompts are computed again: one prefill of the four
    owner = eng.scheduler.runner if where == "forward" else eng.scheduler
    attr = "forward" if where == "forward" else "sampler"
    real = getattr(owner, attr)
    calls = []

    def failing(*a, **kw):
        calls.append(1)
        if len(calls) == oom_at:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (injected)")
        return real(*a, **kw)

    oom_before = eng.get_stats().get("oom_steps", 0)
    monkeypatch.setattr(owner, attr, failing)
    _, outs = _run(eng, f"oom-{where}{oom_at}")
    monkeypatch.undo()
    for o in outs:
        reason = o["meta_info"]["finish_reason"]
        assert reason["type"] == "abort" and reason["status_code"] == 503, reason
        assert "out of memory" in reason["message"]
        assert server_fault(reason) == (503, reason["message"])  # an error in every API
    assert eng.get_stats()["oom_steps"] == oom_before + 1
    assert any("out of memory" in r.getMessage() for r in caplog.records)
    eng.wait_idle()
    eng.check_integrity()
    _, outs = _run(eng, f"after-oom-{where}{oom_at}")
    assert [o["output_ids"] for o in outs] == clean
    eng.wait_idle()
    eng.check_integrity()


class _Socket:
    def __init__(self):
        self.sent = []

    def send(self, data):
        self.sent.append(pickle.loads(data))


def test_update_building_failure_in_the_server(eng, clean, monkeypatch, caplog):
    """The scheduler process builds one update per request (server/scheduler_process.py); when
    one request's raises, that request fails (out of the batch, KV back, an error update) and
    the other's stream goes on. Driven on the Engine's scheduler thread, as the process would."""
    from radixlm.server.scheduler_process import SchedulerServer

    caplog.set_level(logging.ERROR)
    before = eng.get_stats().get("request_failures", 0)
    srv = object.__new__(SchedulerServer)  # only its update path: no model, no sockets
    srv.scheduler, srv.sent, srv.input_lp_sent, srv.to_detok = eng.scheduler, {}, set(), _Socket()
    long_sp = dict(GREEDY, max_new_tokens=450)  # still running when it is failed
    victim = eng.generate(input_ids=PROMPTS[0], sampling_params=long_sp, rid="upd-victim",
                          stream=True)
    other = eng.generate(input_ids=PROMPTS[1], sampling_params=GREEDY, rid="upd-other",
                         stream=True)
    next(victim)
    first_other = next(other)
    real = SchedulerServer._update_of

    def update_of(self, req):
        if req.rid == "upd-victim":
            raise RuntimeError("injected failure")
        return real(self, req)

    monkeypatch.setattr(SchedulerServer, "_update_of", update_of)

    def fail_victim():  # on the scheduler thread, between steps
        req = next(r for r in eng.scheduler.running if r.rid == "upd-victim")
        srv.send_updates([req])
        eng._sinks.pop(req.rid).notify(len(req.output_ids), True)  # the server's TM would
        return req

    req = eng._call_in_loop(fail_victim)
    monkeypatch.undo()
    (up,) = srv.to_detok.sent[0].updates
    assert up.rid == "upd-victim" and up.new_ids == [] and up.finish["status_code"] == 500
    assert req.finish.status == 500 and req.req_pool_idx is None
    assert list(victim)[-1]["meta_info"]["finish_reason"]["status_code"] == 500
    rest = list(other)
    assert (rest[-1] if rest else first_other)["output_ids"] == clean[1]
    assert eng.get_stats()["request_failures"] == before + 1
    assert any("upd-victim" in r.getMessage() for r in caplog.records)
    eng.wait_idle()
    eng.check_integrity()


def test_failures_on_metrics():
    text = ServerMetrics("m").render({"request_failures": 3, "oom_steps": 1,
                                      "spec_draft_failures": 2}).decode()
    assert "radixlm:request_failures 3.0" in text and "radixlm:oom_steps 1.0" in text
    assert "radixlm:spec_draft_failures 2.0" in text


def test_embedding_pooling_failure(eng, monkeypatch, caplog):
    caplog.set_level(logging.ERROR)
    clean = [o["embedding"] for o in eng.encode(input_ids=PROMPTS, pooling="mean")]
    before = eng.get_stats().get("request_failures", 0)
    real, calls = torch.nn.functional.normalize, []

    def normalize(x, *a, **kw):  # the pooler's last step, once per request in batch order
        calls.append(1)
        if len(calls) == BAD + 1:
            raise RuntimeError("injected failure")
        return real(x, *a, **kw)

    monkeypatch.setattr(torch.nn.functional, "normalize", normalize)
    outs = eng.encode(input_ids=PROMPTS, pooling="mean")
    monkeypatch.undo()
    for i, o in enumerate(outs):
        if i == BAD:
            assert o["embedding"] is None
            assert o["meta_info"]["finish_reason"]["status_code"] == 500
        else:
            assert o["embedding"] == clean[i]
    assert eng.get_stats()["request_failures"] == before + 1
    eng.wait_idle()
    eng.check_integrity()
