"""Prompt logprobs served from the radix tree (mem_cache/node_logprobs.py,
scheduler/cached_logprobs.py) equal a recompute, and the cached part is not recomputed.

Every check compares a cache-on engine's `input_token_logprobs` with a cache-off engine's on the
same prompts (fp32, within 1e-5), through node splits, eviction, chunked prefill, a mixed batch,
values stored by decode steps, the hierarchical cache's host tier, and the fields the OpenAI
completions `echo` path sends. A mutation that stores each value one position off must fail them.
All on a tiny random fp32 Llama (token-id prompts, no tokenizer); each engine test ends with the
KV integrity check."""

from __future__ import annotations

import random

import pytest
import torch

from radixlm.runtime.request import Req

TOL = 1e-5
VOCAB = 20480
SCORE = {"max_new_tokens": 0}


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory) -> str:
    from tiny_models import write_tiny_llama

    return write_tiny_llama(str(tmp_path_factory.mktemp("tiny-llama-lp")), vocab=VOCAB, heads=4,
                            kv_heads=2, tied=True)


@pytest.fixture(scope="module")
def engines(tiny_path):
    """Factory: engines on the tiny model, each shut down at the end of the module."""
    import radixlm

    made = []

    def factory(**kwargs):
        kwargs.setdefault("max_total_tokens", 4000)
        made.append(radixlm.Engine(model_path=tiny_path, dtype="float32", context_length=512,
                                   skip_tokenizer_init=True, **kwargs))
        return made[-1]

    yield factory
    for eng in made:
        eng.shutdown()


@pytest.fixture(scope="module")
def reference(engines):
    """Cache-off engine: every prompt logprob is computed by a forward."""
    return engines(disable_radix_cache=True)


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(10, VOCAB) for _ in range(n)]


def _lps(out) -> list:
    return [v for v, _, _ in out["meta_info"]["input_token_logprobs"]]


def _score(eng, prompts, starts=0, tops=0):
    n = len(prompts)
    starts = starts if isinstance(starts, list) else [starts] * n
    tops = tops if isinstance(tops, list) else [tops] * n
    return eng.generate(input_ids=prompts, sampling_params=[dict(SCORE) for _ in prompts],
                        return_logprob=[True] * n, logprob_start_len=starts,
                        top_logprobs_num=tops)


def _max_diff(got, want) -> float:
    assert len(got) == len(want)
    assert (got[0] is None) == (want[0] is None)
    a = torch.tensor([x for x in got if x is not None], dtype=torch.float64)
    b = torch.tensor([x for x in want if x is not None], dtype=torch.float64)
    return float((a - b).abs().max()) if a.numel() else 0.0


def _assert_equal(outs, refs) -> None:
    for out, ref in zip(outs, refs):
        assert _max_diff(_lps(out), _lps(ref)) <= TOL


def _done(eng) -> None:
    eng.wait_idle()
    eng.check_integrity()


def test_scoring_over_cached_context_is_served_and_exact(engines, reference):
    """Context + continuation A computes everything; context + B and C are served the context's
    logprobs (only their continuation is computed), through a split in the middle of a node."""
    rng = random.Random(0)
    eng = engines()
    ctx = _ids(rng, 60)
    first = ctx + _ids(rng, 8)
    outs = _score(eng, [first])
    _assert_equal(outs, _score(reference, [first]))
    assert outs[0]["meta_info"]["cached_tokens"] == 0

    later = [ctx + _ids(rng, 8), ctx + _ids(rng, 5), ctx[:30] + _ids(rng, 7)]  # the last splits
    for p in later:
        out = _score(eng, [p])
        _assert_equal(out, _score(reference, [p]))
        shared = 60 if len(p) != 37 else 30
        # the match stops one short of the first unknown position (its logits score it)
        assert out[0]["meta_info"]["cached_tokens"] == shared - 1
    # starting later in the prompt is served too, and values past the start only
    out = _score(eng, [later[0]], starts=[25])
    ref = _score(reference, [later[0]], starts=[25])
    _assert_equal(out, ref)
    assert len(_lps(out[0])) == len(later[0]) - 25
    assert out[0]["meta_info"]["cached_tokens"] == len(later[0]) - 1  # all known: nothing computed
    _done(eng)


def test_forward_computes_only_the_missing_part(engines):
    rng = random.Random(1)
    eng = engines()
    ctx = _ids(rng, 100)
    _score(eng, [ctx + _ids(rng, 4)])
    before = eng.get_stats()
    conts = [_ids(rng, 6) for _ in range(4)]
    _score(eng, [ctx + c for c in conts])
    after = eng.get_stats()
    computed = ((after["prompt_tokens"] - before["prompt_tokens"])
                - (after["cached_tokens"] - before["cached_tokens"]))
    # each request computes its 6 continuation tokens plus the context's last token (whose
    # logits score the first continuation token); nothing of the 99 cached positions before it
    assert computed <= 4 * 7
    _done(eng)


def test_chunked_prefill_stores_every_chunk(engines, reference):
    rng = random.Random(2)
    eng = engines(chunked_prefill_size=16)
    ctx = _ids(rng, 70)
    prompts = [ctx + _ids(rng, 9), ctx + _ids(rng, 9), ctx[:41] + _ids(rng, 20)]
    for p in prompts:
        _assert_equal(_score(eng, [p]), _score(reference, [p]))
    out = _score(eng, [prompts[0]])
    assert out[0]["meta_info"]["cached_tokens"] == len(prompts[0]) - 1
    _done(eng)


def test_mixed_batch(engines, reference):
    """One batch: served, partly served, top-k (recomputed as before), no logprobs, later start."""
    rng = random.Random(3)
    eng = engines()
    ctx = _ids(rng, 50)
    _score(eng, [ctx + _ids(rng, 3)])
    prompts = [ctx + _ids(rng, 5), ctx[:20] + _ids(rng, 30), ctx + _ids(rng, 4), _ids(rng, 33),
               ctx + _ids(rng, 6)]
    starts, tops = [0, 0, 0, 5, 44], [0, 0, 3, 0, 0]
    outs = _score(eng, prompts, starts, tops)
    refs = _score(reference, prompts, starts, tops)
    _assert_equal(outs, refs)
    top_got = outs[2]["meta_info"]["input_top_logprobs"]
    top_want = refs[2]["meta_info"]["input_top_logprobs"]
    ids = [[[t for _, t, _ in e] for e in tops[1:]] for tops in (top_got, top_want)]
    assert ids[0] == ids[1]
    plain = eng.generate(input_ids=prompts[:2], sampling_params={"max_new_tokens": 2})
    assert all("input_token_logprobs" not in o["meta_info"] for o in plain)
    _done(eng)


def test_decode_steps_store_output_logprobs(engines, reference):
    """A generation with return_logprob leaves its output tokens' logprobs in the tree; scoring
    prompt + output then serves them (decode rows vs a prefill recompute)."""
    rng = random.Random(4)
    eng = engines()
    prompt = _ids(rng, 30)
    gen = eng.generate(input_ids=prompt, return_logprob=True,
                       sampling_params={"max_new_tokens": 8, "ignore_eos": True})
    full = prompt + gen["output_ids"] + _ids(rng, 3)
    # from position 30, the first output token (its logprob came from the prefill's sample row)
    out = _score(eng, [full], starts=[30])
    _assert_equal(out, _score(reference, [full], starts=[30]))
    # the tree holds prompt + 7 outputs (the 8th was never run); the values of positions 30..36
    # are known, so the forward starts at query 36, which scores the 8th output token
    assert out[0]["meta_info"]["cached_tokens"] == 36
    # the generation asked no prompt logprobs: from position 0 nothing is known, all recomputed
    out = _score(eng, [full])
    _assert_equal(out, _score(reference, [full]))
    assert out[0]["meta_info"]["cached_tokens"] == 0
    _done(eng)


def test_eviction_drops_values_with_the_node(engines, reference):
    rng = random.Random(5)
    eng = engines(max_total_tokens=300)
    ctx = _ids(rng, 80)
    _score(eng, [ctx + _ids(rng, 4)])
    for _ in range(6):  # push the context out of the tree
        eng.generate(input_ids=_ids(rng, 120), sampling_params=SCORE)
    p = ctx + _ids(rng, 4)
    out = _score(eng, [p])
    _assert_equal(out, _score(reference, [p]))
    assert out[0]["meta_info"]["cached_tokens"] < 79
    out = _score(eng, [ctx + _ids(rng, 4)])  # stored again by the recompute
    assert out[0]["meta_info"]["cached_tokens"] == 79
    _done(eng)


def test_hierarchical_cache_keeps_values_off_the_device(engines, reference):
    rng = random.Random(6)
    eng = engines(max_total_tokens=200, enable_hicache=True, hicache_ratio=3.0)
    ctx = _ids(rng, 70)
    _score(eng, [ctx + _ids(rng, 4)])
    for _ in range(3):  # the context leaves the device for the host pool
        eng.generate(input_ids=_ids(rng, 150), sampling_params=SCORE)
    p = ctx + _ids(rng, 5)
    out = _score(eng, [p])
    _assert_equal(out, _score(reference, [p]))
    assert out[0]["meta_info"]["cached_tokens"] == 69
    assert out[0]["meta_info"]["cached_tokens_details"]["host"] > 0  # loaded back from the host
    _done(eng)


def test_openai_echo_fields(engines, reference):
    """openai_completions.py sends echo + logprobs=0 as return_logprob, logprob_start_len=0,
    top_logprobs_num=0 with the request's max_tokens: the same engine fields, served alike."""
    rng = random.Random(7)
    eng = engines()
    ctx = _ids(rng, 40)
    _score(eng, [ctx + _ids(rng, 2)])
    p = ctx + _ids(rng, 6)
    kw = dict(input_ids=p, return_logprob=True, logprob_start_len=0, top_logprobs_num=0,
              sampling_params={"max_new_tokens": 3, "ignore_eos": True, "temperature": 0})
    out, ref = eng.generate(**kw), reference.generate(**kw)
    assert _max_diff(_lps(out), _lps(ref)) <= TOL
    assert out["output_ids"] == ref["output_ids"]
    assert out["meta_info"]["cached_tokens"] == 39
    _done(eng)


def test_a_shifted_store_is_caught(engines, reference, monkeypatch):
    """Mutation: store each value one position early; the served values must then differ."""
    real = Req.known_token_logprobs

    def shifted(self, n):
        vec = real(self, n)
        # the classic off-by-one: the logits at q score token q + 1, stored at q
        return None if vec is None else torch.cat([vec[1:], torch.full((1,), float("nan"))])

    monkeypatch.setattr(Req, "known_token_logprobs", shifted)
    rng = random.Random(8)
    eng = engines()
    ctx = _ids(rng, 40)
    _score(eng, [ctx + _ids(rng, 3)])
    p = ctx + _ids(rng, 3)
    assert _max_diff(_lps(_score(eng, [p])[0]), _lps(_score(reference, [p])[0])) > 1e-2
    _done(eng)
