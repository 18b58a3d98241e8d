"""Faults injected into speculative decoding (runtime/speculative/isolation.py), fp32 on the CPU
on tiny random checkpoints (tests/tiny_models.py), for NGRAM, STANDALONE (the target as its
own draft) and EAGLE3, the last two with chains and with draft trees:
- one request's own drafting raises (its n-gram lookup, its grammar along a draft chain or on
  its verify rows): it fails alone with a 500 abort, the others keep the tokens of a clean run;
- a draft chain raises (the draft model's or head's forward; it names no request): the step
  runs without drafts, every request keeps its clean tokens, `spec_draft_failures` counts it;
- a CUDA out-of-memory in the verify's forward or acceptance: the step runs again without
  drafts (clean tokens, `oom_steps` and `spec_verify_ooms` count it); a second one in that
  retry fails the batch with 503 and the engine serves on;
- a drafter's bookkeeping (EAGLE-3's feature projection, NGRAM's shared table and indexing):
  what raised is lost, counted, and every request keeps its clean tokens.
Grammars: test_speculative_isolation_grammar.py. Each test ends with the KV integrity check
(a draft model's pool too). Without the isolation each of them fails (the scheduler thread
dies, or the shared table's failure fails its request)."""

from __future__ import annotations

import logging

import pytest
import torch

from radixlm.runtime.speculative import grammar_drafts, ngram_drafter, worker

V = 256
KW = dict(skip_tokenizer_init=True, max_total_tokens=4096, context_length=512, dtype="float32")
BAD = 1  # the index of the request an injection fails
OOM = torch.cuda.OutOfMemoryError


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    import radixlm
    from tiny_models import write_tiny_eagle3, write_tiny_llama

    root = tmp_path_factory.mktemp("spec-iso")
    target = write_tiny_llama(str(root / "target"), vocab=V, heads=4, kv_heads=2, tied=False,
                              layers=4)
    head = write_tiny_eagle3(str(root / "head"), vocab=V, draft_vocab=100)
    spec = dict(speculative_adaptive=False, **KW)
    made = {"off": radixlm.Engine(model_path=target, **KW),
            "ngram": radixlm.Engine(model_path=target, speculative_algorithm="NGRAM", **spec),
            "standalone": radixlm.Engine(model_path=target, speculative_algorithm="STANDALONE",
                                         speculative_draft_model_path=target, **spec),
            "eagle3": radixlm.Engine(model_path=target, speculative_algorithm="EAGLE3",
                                     speculative_draft_model_path=head, **spec)}
    tree = dict(speculative_eagle_topk=2, speculative_num_steps=2, speculative_num_draft_tokens=7)
    made["standalone-tree"] = radixlm.Engine(model_path=target, **spec, **tree,
                                             speculative_algorithm="STANDALONE",
                                             speculative_draft_model_path=target)
    made["eagle3-tree"] = radixlm.Engine(model_path=target, speculative_algorithm="EAGLE3",
                                         speculative_draft_model_path=head, **spec, **tree)
    yield made
    for eng in made.values():
        eng.shutdown()


def _prompts() -> list[list[int]]:
    """Repeated spans: the n-gram tables find drafts in them (random weights copy them too)."""
    g = torch.Generator().manual_seed(3)
    ids = lambda n: torch.randint(0, V, (n,), generator=g).tolist()  # noqa: E731
    return [ids(8) * 3, ids(5) * 4, ids(12) * 2, ids(20)]


GREEDY = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}


@pytest.fixture(scope="module")
def clean(engines):
    return [o["output_ids"] for o in engines["off"].generate(input_ids=_prompts(),
                                                             sampling_params=GREEDY)]


def _run(eng, tag: str):
    rids = [f"{tag}-{i}" for i in range(4)]
    return rids, eng.generate(input_ids=_prompts(), sampling_params=GREEDY, rid=rids)


def _serves_on(eng, clean) -> None:
    eng.wait_idle()
    eng.check_integrity()  # free + cached + in use == capacity; a draft model's pool too
    _, outs = _run(eng, "again")
    assert [o["output_ids"] for o in outs] == clean
    eng.wait_idle()
    eng.check_integrity()


def _stats(eng, *keys):
    s = eng.get_stats()
    return [s.get(k, 0) for k in keys]


def _failed_alone(eng, clean, outs, before: int, where: str, caplog, bad_rid: str) -> None:
    for i, o in enumerate(outs):
        reason = o["meta_info"]["finish_reason"]
        if i == BAD:
            assert reason["type"] == "abort" and reason["status_code"] == 500, reason
            assert where in reason["message"] and "injected" in reason["message"], reason
        else:
            assert o["output_ids"] == clean[i]
    assert _stats(eng, "request_failures") == [before + 1]
    assert any(bad_rid in r.getMessage() and r.exc_info for r in caplog.records)


@pytest.mark.parametrize("point", ["propose", "truncate"])
def test_a_failure_in_one_requests_ngram_lookup_fails_it_alone(engines, clean, monkeypatch,
                                                               caplog, point):
    caplog.set_level(logging.ERROR)
    eng = engines["ngram"]
    sched = eng.scheduler
    bad_rid = f"lookup-{point}-{BAD}"

    def bad(req) -> bool:
        return req is not None and req.rid == bad_rid and len(req.output_ids) >= 3

    if point == "propose":  # the shared step's lookup in the request's own index
        real = ngram_drafter.propose

        def failing(own, *a):
            req = next((r for r in sched.running if r.spec_draft and r.spec_draft.own is own),
                       None)
            if bad(req):
                raise RuntimeError("injected failure")
            return real(own, *a)
        monkeypatch.setattr(ngram_drafter, "propose", failing)
    else:  # the grammar-aware cut of its draft
        real = grammar_drafts.truncate

        def failing(req, draft):
            if bad(req):
                raise RuntimeError("injected failure")
            return real(req, draft)
        monkeypatch.setattr(grammar_drafts, "truncate", failing)
    before, = _stats(eng, "request_failures")
    _, outs = _run(eng, f"lookup-{point}")
    monkeypatch.undo()
    _failed_alone(eng, clean, outs, before, "drafting (its n-gram lookup)", caplog, bad_rid)
    _serves_on(eng, clean)


@pytest.mark.parametrize("algo", ["standalone", "eagle3", "standalone-tree", "eagle3-tree"])
@pytest.mark.parametrize("error", [RuntimeError, OOM])
def test_a_failed_draft_chain_runs_the_step_without_drafts(engines, clean, monkeypatch, caplog,
                                                           algo, error):
    """The chain's forwards are batched: no request is to blame. Calls 2 and 5 of the draft's
    forward raise (a catch-up or a depth of the chain, after its slots were taken)."""
    caplog.set_level(logging.ERROR)
    eng = engines[algo]
    spec = eng.scheduler.spec
    owner, attr = ((spec.runner, "forward") if algo.startswith("standalone")
                   else (spec, "_forward"))
    real = getattr(owner, attr)
    calls = []

    def failing(*a, **kw):
        calls.append(1)
        if len(calls) in (2, 5):
            raise error("injected failure")
        return real(*a, **kw)

    keys = ("spec_draft_failures", "request_failures", "spec_draft_tokens", "oom_steps")
    before = _stats(eng, *keys)
    monkeypatch.setattr(owner, attr, failing)
    _, outs = _run(eng, f"chain-{algo}-{error.__name__}")
    monkeypatch.undo()
    assert [o["output_ids"] for o in outs] == clean
    after = _stats(eng, *keys)
    assert after[:2] == [before[0] + 2, before[1]]
    assert after[2] > before[2]  # the other steps drafted and verified
    assert after[3] == before[3] + (2 if error is OOM else 0)
    assert sum("drafting failed" in r.getMessage() for r in caplog.records) == 2
    _serves_on(eng, clean)


def _inject_verify_oom(monkeypatch, eng, where: str, twice: bool):
    """An OOM in the second verify that has drafts (its forward or its acceptance); `twice`:
    in the forward after it too (the step's retry)."""
    drafted = []

    def recording(real_build):
        def build(*a, **kw):
            fb, plan = real_build(*a, **kw)
            if any(plan.drafts):
                drafted.append(fb)
            return fb, plan
        return build
    for name in ("build_verify", "build_tree_verify"):  # (chains, trees)
        monkeypatch.setattr(worker, name, recording(getattr(worker, name)))
    runner = eng.scheduler.runner
    real_forward = runner.forward
    state = {"fired": False, "retry": False}

    def forward(fb, *a, **kw):
        if state["retry"]:
            state["retry"] = False
            raise OOM("CUDA out of memory (injected, the retry)")
        if where == "forward" and len(drafted) == 2 and fb is drafted[1] and not state["fired"]:
            state["fired"], state["retry"] = True, twice
            raise OOM("CUDA out of memory (injected)")
        return real_forward(fb, *a, **kw)

    def failing(real_verify):
        def verify(logits, plan, *a, **kw):
            if len(drafted) == 2 and any(plan.drafts) and not state["fired"]:
                state["fired"], state["retry"] = True, twice
                raise OOM("CUDA out of memory (injected)")
            return real_verify(logits, plan, *a, **kw)
        return verify
    monkeypatch.setattr(runner, "forward", forward)
    if where == "acceptance":
        for name in ("verify", "verify_tree"):
            monkeypatch.setattr(worker, name, failing(getattr(worker, name)))
    return state


@pytest.mark.parametrize("algo", ["ngram", "standalone", "eagle3", "standalone-tree",
                                  "eagle3-tree"])
@pytest.mark.parametrize("where", ["forward", "acceptance"])
def test_a_verify_out_of_memory_runs_the_step_without_drafts(engines, clean, monkeypatch, caplog,
                                                             algo, where):
    caplog.set_level(logging.ERROR)
    eng = engines[algo]
    keys = ("oom_steps", "spec_verify_ooms", "request_failures")
    before = _stats(eng, *keys)
    state = _inject_verify_oom(monkeypatch, eng, where, twice=False)
    _, outs = _run(eng, f"verify-oom-{algo}-{where}")
    monkeypatch.undo()
    assert state["fired"]
    assert [o["output_ids"] for o in outs] == clean
    assert _stats(eng, *keys) == [before[0] + 1, before[1] + 1, before[2]]
    assert any("again without drafts" in r.getMessage() for r in caplog.records)
    _serves_on(eng, clean)


@pytest.mark.parametrize("algo", ["ngram", "eagle3"])
def test_an_out_of_memory_in_the_retry_too_fails_the_batch(engines, clean, monkeypatch, algo):
    """NGRAM's retry is the plain decode step, EAGLE3's a verify of the last tokens: a second
    OOM there fails the batch (503), as on the plain path, and the engine serves on."""
    eng = engines[algo]
    before = _stats(eng, "oom_steps", "spec_verify_ooms")
    state = _inject_verify_oom(monkeypatch, eng, "forward", twice=True)
    _, outs = _run(eng, f"retry-oom-{algo}")
    monkeypatch.undo()
    assert state["fired"] and not state["retry"]
    for o in outs:
        reason = o["meta_info"]["finish_reason"]
        assert reason["type"] == "abort" and reason["status_code"] == 503, reason
        assert "out of memory" in reason["message"]
    assert _stats(eng, "oom_steps", "spec_verify_ooms") == [before[0] + 2, before[1] + 1]
    _serves_on(eng, clean)


def test_a_failed_feature_projection_loses_only_the_heads_rows(engines, clean, monkeypatch,
                                                               caplog):
    """EAGLE-3's projection of the target's features: after the prefill (call 1) and after a
    verify (call 4) it raises; those requests draft afresh, with the clean tokens."""
    caplog.set_level(logging.ERROR)
    eng = engines["eagle3"]
    head = eng.scheduler.spec.head
    real, calls = head.project, []

    def failing(x):
        calls.append(1)
        if len(calls) in (1, 4):
            raise RuntimeError("injected failure")
        return real(x)

    before = _stats(eng, "spec_draft_failures", "request_failures")
    monkeypatch.setattr(head, "project", failing)
    _, outs = _run(eng, "project")
    monkeypatch.undo()
    assert [o["output_ids"] for o in outs] == clean
    assert _stats(eng, "spec_draft_failures", "request_failures") == [before[0] + 2, before[1]]
    assert sum("the head's features" in r.getMessage() for r in caplog.records) == 2
    _serves_on(eng, clean)


def test_ngram_bookkeeping_failures_lose_only_their_ngrams(engines, clean, monkeypatch, caplog):
    """A finished output that fails to join the shared table (the CPU adds it at the finish),
    and a prompt index that fails while a step is in flight (GPU: `idle_work`, called here
    between steps on stand-in requests): lost, logged, counted; requests finish as clean."""
    from types import SimpleNamespace

    caplog.set_level(logging.ERROR)
    eng = engines["ngram"]
    spec = eng.scheduler.spec
    real, calls = spec.shared.add, []

    def failing(*a):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("injected failure")
        return real(*a)

    before = _stats(eng, "spec_draft_failures", "request_failures")
    monkeypatch.setattr(spec.shared, "add", failing)
    _, outs = _run(eng, "shared")
    monkeypatch.undo()
    assert len(calls) == 4  # every finished output was offered to the table
    assert [o["output_ids"] for o in outs] == clean
    assert _stats(eng, "spec_draft_failures", "request_failures") == [before[0] + 1, before[1]]
    eng.wait_idle()
    eng.check_integrity()

    def broken():
        raise RuntimeError("injected failure")
    good = SimpleNamespace(rid="good", spec_draft=None, vocab_input_ids=lambda: [1, 2, 3, 1, 2])
    bad = SimpleNamespace(rid="bad", spec_draft=None, vocab_input_ids=broken)
    monkeypatch.setattr(ngram_drafter, "IDLE_BUDGET_S", 60.0)  # (a logged traceback is slow)
    eng._call_in_loop(lambda: spec.idle_work(SimpleNamespace(running=[bad, good])))
    monkeypatch.undo()
    assert bad.spec_draft is None and good.spec_draft.own.ready  # the good one is indexed
    assert _stats(eng, "spec_draft_failures")[0] == before[0] + 2
    assert any("prompt index of request bad" in r.getMessage() for r in caplog.records)
    _serves_on(eng, clean)
