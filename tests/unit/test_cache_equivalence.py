"""Cache on/off, chunked/unchunked prefill, retraction and policies give identical greedy text.

These are properties of the runtime, not of the model, so they run on the tiny random chat model
(tests/tiny_models.py: SmolLM2's tokenizer and chat template, peaked logits without near-ties, a
forward ~30x cheaper than SmolLM2's): the same prompts, steps and checks at a fraction of the
cost. The bundled model's own equality with HF is test_hf_parity's."""

from __future__ import annotations

import pytest

SYSTEM = ("You are a meticulous assistant for a library. You answer questions about books, "
          "authors, genres and reading habits. Keep answers short, factual and friendly. ") * 3
QUESTIONS = ["Who wrote Dune?", "Suggest a mystery novel.", "What is a haiku?",
             "How many pages is a novella?", "Name a famous poet.", "What is science fiction?",
             "Recommend a book for a child.", "What is an epilogue?"]


def _prompts(tok):
    return [tok.apply_chat_template([{"role": "system", "content": SYSTEM},
                                     {"role": "user", "content": q}],
                                    tokenize=False, add_generation_prompt=True) for q in QUESTIONS]


def _run(eng, prompts, max_new=40):
    outs = eng.generate(prompts, {"temperature": 0, "max_new_tokens": max_new})
    return [o["output_ids"] for o in outs], outs


@pytest.fixture(scope="module")
def make_tiny(make_engine, tiny_chat_path):
    return lambda **kw: make_engine(model_path=tiny_chat_path, **kw)


@pytest.fixture(scope="module")
def engine(make_tiny):
    return make_tiny()


@pytest.fixture(scope="module")
def reference(engine):
    engine.flush_cache()
    ids, _ = _run(engine, _prompts(engine.tokenizer))
    return ids


def test_shared_prefix_reports_cached_tokens(engine, integrity):
    engine.flush_cache()
    prompts = _prompts(engine.tokenizer)
    first = engine.generate(prompts[0], {"temperature": 0, "max_new_tokens": 4})
    rest = engine.generate(prompts[1:], {"temperature": 0, "max_new_tokens": 4})
    assert first["meta_info"]["cached_tokens"] == 0
    for o in rest:
        assert o["meta_info"]["cached_tokens"] > 60, o["meta_info"]
    integrity(engine)


def test_shared_prefix_in_one_batch_is_computed_once(engine, integrity):
    """Requests sharing a long uncached prefix in one batch: all but one wait a round, then hit."""
    engine.flush_cache()
    outs = engine.generate(_prompts(engine.tokenizer), {"temperature": 0, "max_new_tokens": 2})
    hits = [o["meta_info"]["cached_tokens"] for o in outs]
    assert sum(h > 60 for h in hits) == len(hits) - 1, hits
    integrity(engine)


def test_repeat_is_fully_cached(engine, integrity):
    p = _prompts(engine.tokenizer)[0]
    a = engine.generate(p, {"temperature": 0, "max_new_tokens": 10})
    b = engine.generate(p, {"temperature": 0, "max_new_tokens": 10})
    assert a["output_ids"] == b["output_ids"]
    assert b["meta_info"]["cached_tokens"] == b["meta_info"]["prompt_tokens"] - 1
    integrity(engine)


def test_cache_off_matches_cache_on(make_tiny, engine, reference, integrity):
    off = make_tiny(disable_radix_cache=True)
    ids, outs = _run(off, _prompts(off.tokenizer))
    assert ids == reference
    assert all(o["meta_info"]["cached_tokens"] == 0 for o in outs)
    ids2, _ = _run(off, _prompts(off.tokenizer))  # second pass: still nothing cached, same text
    assert ids2 == reference
    integrity(off)


@pytest.mark.parametrize("chunk", [16, 61])
def test_chunked_prefill_matches(make_tiny, reference, chunk, integrity):
    eng = make_tiny(chunked_prefill_size=chunk)
    ids, _ = _run(eng, _prompts(eng.tokenizer))
    assert ids == reference
    integrity(eng)


def test_chunked_prefill_with_cache_off(make_tiny, reference, integrity):
    eng = make_tiny(chunked_prefill_size=32, disable_radix_cache=True)
    ids, _ = _run(eng, _prompts(eng.tokenizer))
    assert ids == reference
    integrity(eng)


@pytest.mark.parametrize("policy", ["fcfs", "dfs-weight"])
def test_policies_match(make_tiny, reference, policy, integrity):
    eng = make_tiny(schedule_policy=policy)
    ids, _ = _run(eng, _prompts(eng.tokenizer))
    assert ids == reference
    integrity(eng)


def test_forced_retraction_matches(make_tiny, engine, integrity):
    """16 concurrent long generations in a 600-token pool must retract and still agree."""
    tok = engine.tokenizer
    prompts = [f"Write a long story about a {animal} who learns to {skill}."
               for animal in ("cat", "dog", "fox", "owl")
               for skill in ("sing", "swim", "cook", "paint")]
    params = {"temperature": 0, "max_new_tokens": 60, "ignore_eos": True}
    engine.flush_cache()
    ref = [o["output_ids"] for o in engine.generate(prompts, params)]
    tiny = make_tiny(max_total_tokens=600)
    outs = tiny.generate(prompts, params)
    assert [o["output_ids"] for o in outs] == ref
    assert tiny.get_stats()["retractions"] > 0, "the pool was meant to be too small"
    integrity(tiny)
    assert tok is not None


def test_unmixed_steps_match(make_tiny, reference, integrity):
    """Prefill-only steps (no decoding mixed in) give the same greedy text as mixed steps."""
    eng = make_tiny(disable_mixed_batch=True)
    ids, _ = _run(eng, _prompts(eng.tokenizer))
    assert ids == reference
    integrity(eng)
