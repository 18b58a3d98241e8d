"""Grammar failures while drafting (runtime/speculative/isolation.py), fp32 on the CPU, on a
random tiny Llama with SmolLM2's tokenizer: STANDALONE with the target as its own draft, whose
chain walks each constrained request's matcher, and whose verify masks each request's rows. A
matcher that raises for one request (along the chain, or on its verify rows) fails that
request alone with a 500 abort; the others keep the tokens of a clean run; the KV integrity
check holds (the draft's pool too). Without the isolation the scheduler thread dies."""

from __future__ import annotations

import logging

import pytest
from test_speculative_isolation import BAD, _failed_alone, _stats

from radixlm.runtime.speculative import grammar_drafts


@pytest.fixture(scope="module")
def chat_engines(tiny_chat_path):
    """Text and grammars (a tokenizer): STANDALONE with the target as its own draft, whose
    chain walks each constrained request's matcher, and the verify's per-row masks."""
    import radixlm

    kw = dict(dtype="float32", max_total_tokens=4096, context_length=1024)
    made = {"off": radixlm.Engine(model_path=tiny_chat_path, **kw),
            "on": radixlm.Engine(model_path=tiny_chat_path, speculative_algorithm="STANDALONE",
                                 speculative_draft_model_path=tiny_chat_path,
                                 speculative_adaptive=False, **kw)}
    yield made
    for eng in made.values():
        eng.shutdown()


@pytest.mark.parametrize("point", ["chain", "verify"])
def test_a_grammar_failure_while_drafting_fails_its_request_alone(chat_engines, monkeypatch,
                                                                  caplog, point):
    caplog.set_level(logging.ERROR)
    prompts = ["Name three fruits:", "Count: one two three", "Write a word:"]
    params = {"temperature": 0, "max_new_tokens": 24, "regex": r"[a-z ]{4,30}\."}
    clean = [o["output_ids"] for o in chat_engines["off"].generate(prompts, params)]
    eng = chat_engines["on"]
    bad_rid = f"grammar-{point}-{BAD}"
    if point == "chain":  # its matcher walking the draft chain's tokens
        real = grammar_drafts.ChainGrammar.walk_row

        def failing(self, a, tok):
            if self.creqs[a].rid == bad_rid and len(self.creqs[a].output_ids) >= 2:
                raise RuntimeError("injected failure")
            return real(self, a, tok)
        monkeypatch.setattr(grammar_drafts.ChainGrammar, "walk_row", failing)
        where = "drafting (its grammar in the draft chain)"
    else:  # its matcher filling the masks of its verify rows
        real = grammar_drafts.fill_rows

        def failing(req, *a):
            if req.rid == bad_rid and len(req.output_ids) >= 2:
                raise RuntimeError("injected failure")
            return real(req, *a)
        monkeypatch.setattr(grammar_drafts, "fill_rows", failing)
        where = "the verify (its grammar's masks of its verify rows)"
    before, accepted = _stats(eng, "request_failures", "spec_accepted_tokens")
    outs = eng.generate(prompts, params, rid=[f"grammar-{point}-{i}" for i in range(3)])
    monkeypatch.undo()
    _failed_alone(eng, clean, outs, before, where, caplog, bad_rid)
    assert _stats(eng, "spec_accepted_tokens")[0] > accepted  # drafts were verified
    eng.wait_idle()
    eng.check_integrity()
    assert [o["output_ids"] for o in eng.generate(prompts, params)] == clean
    eng.wait_idle()
    eng.check_integrity()
