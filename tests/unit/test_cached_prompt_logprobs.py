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
    """Chosen-token logprobs within TOL; top-k lists (when asked) with the same ids, within TOL."""
    for out, ref in zip(outs, refs):
        assert _max_diff(_lps(out), _lps(ref)) <= TOL
        got, want = (o["meta_info"].get("input_top_logprobs") for o in (out, ref))
        assert (got is None) == (want is None)
        for g, w in zip(got or [], want or []):
            assert (g is None) == (w is None)
            if g is not None:
                assert [t for _, t, _ in g] == [t for _, t, _ in w]
                assert _max_diff([v for v, _, _ in g], [v for v, _, _ in w]) <= TOL


def _done(eng) -> None:
    eng.wait_idle()
    eng.check_integrity()


def _lp(vals, top=None):
    from radixlm.runtime.mem_cache.node_logprobs import TOP_K_STORED, TokenLogprobs

    lp = TokenLogprobs(torch.tensor(vals, dtype=torch.float32))
    if top is not None:  # top[i] = k: position i knows k alternatives, values -i - j
        lp = TokenLogprobs.unknown(len(vals), with_top=True)
        lp.chosen = torch.tensor(vals, dtype=torch.float32)
        for i, k in enumerate(top):
            lp.top_vals[i, :k] = torch.tensor([-float(i) - j for j in range(k)])
            lp.top_ids[i, :k] = torch.arange(k) + 100 * i
            lp.top_n[i] = k
        assert lp.top_vals.shape[1] == TOP_K_STORED
    return lp


def test_tree_splits_fills_and_evicts_values():
    """Tree level: a split keeps each position's value, an insert fills only unknown entries (a
    known one never changes), a longer top-k list replaces a shorter one, eviction drops them."""
    from radix_cache_helpers import make

    cache, alloc, _ = make(capacity=32)
    nan = float("nan")
    slots = alloc.alloc(5)
    cache.insert([1, 2, 3, 4, 5], slots, _lp([nan, -1.0, nan, -3.0, nan]))
    cache.match_prefix([1, 2, 9])  # splits after [1, 2]
    assert torch.equal(cache.cached_logprobs([1, 2, 3, 4, 5]).chosen.isnan(),
                       torch.tensor([True, False, True, False, True]))
    more = alloc.alloc(6)
    cache.insert([1, 2, 3, 4, 5, 6], more,
                 _lp([nan, -9.0, -2.0, -9.0, -4.0, -5.0], [0, 0, 2, 0, 0, 3]))
    alloc.free(more[:5])
    got = cache.cached_logprobs([1, 2, 3, 4, 5, 6, 7])
    assert got.chosen[1:].tolist() == [-1.0, -2.0, -3.0, -4.0, -5.0]  # -9s did not overwrite
    assert got.top_n.tolist() == [0, 0, 2, 0, 0, 3]
    again = alloc.alloc(6)
    cache.insert([1, 2, 3, 4, 5, 6], again, _lp([nan] * 6, [0, 0, 4, 0, 0, 1]))
    alloc.free(again)
    got = cache.cached_logprobs([1, 2, 3, 4, 5, 6])
    assert got.top_n.tolist() == [0, 0, 4, 0, 0, 3]  # 4 > 2 replaced; 1 < 3 kept
    assert got.top_ids[2, :4].tolist() == [200, 201, 202, 203]
    cache.check_integrity()
    cache.evict(32)
    assert len(cache.cached_logprobs([1, 2, 3])) == 0
    cache.check_integrity()


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
    """One batch: served, partly served, top-k (its context not stored with top-k: recomputed),
    a context-free prompt, a later start; then the same without logprobs."""
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
    assert [o["meta_info"]["cached_tokens"] for o in outs] == [49, 19, 0, 0, 49]
    plain = eng.generate(input_ids=prompts[:2], sampling_params={"max_new_tokens": 2})
    assert all("input_token_logprobs" not in o["meta_info"] for o in plain)
    _done(eng)


def test_top_k_is_stored_and_served_when_long_enough(engines, reference):
    """Top-k lists are kept with the chosen values: a later request asking k or fewer is served,
    one asking more recomputes (and then stores its longer lists)."""
    rng = random.Random(9)
    eng = engines()
    ctx = _ids(rng, 45)
    for k, cached in ((3, 0), (3, 44), (2, 44), (5, 0), (5, 44), (4, 44), (0, 44)):
        p = ctx + _ids(rng, 4)
        out = _score(eng, [p], tops=[k])
        _assert_equal(out, _score(reference, [p], tops=[k]))
        assert out[0]["meta_info"]["cached_tokens"] == cached, k
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
        lp = real(self, n)
        if lp is not None:  # the classic off-by-one: the logits at q score token q + 1, stored at q
            lp.chosen = torch.cat([lp.chosen[1:], torch.full((1,), float("nan"))])
        return lp

    monkeypatch.setattr(Req, "known_token_logprobs", shifted)
    rng = random.Random(8)
    eng = engines()
    ctx = _ids(rng, 40)
    _score(eng, [ctx + _ids(rng, 3)])
    p = ctx + _ids(rng, 3)
    assert _max_diff(_lps(_score(eng, [p])[0]), _lps(_score(reference, [p])[0])) > 1e-2
    _done(eng)
