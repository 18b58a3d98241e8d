"""The two limits of grammar compilation (radixlm/runtime/constrained/grammar.py):

- --grammar-compile-timeout: a request still waiting for its grammar after this many seconds is
  aborted with a message naming the flag; the compile goes on in its thread, the engine keeps
  serving, no KV slot leaks. With the limit out of reach the same request just waits, so the abort
  comes from the limit (and no test here can hang: every wait has a deadline).
- --grammar-cache-size: the pool keeps at most N compiled grammars, least recently used out, and
  xgrammar's own (unbounded) cache stays off.
"""

from __future__ import annotations

import dataclasses
import re
import threading
import time

import pytest

from radixlm.runtime.constrained import grammar as grammar_mod
from radixlm.runtime.constrained.grammar import GrammarCompilerPool

TIMEOUT_S = 0.3


# --- the cache cap: the pool alone, on a 128-token tokenizer ------------------------------------

@pytest.fixture
def make_pool(monkeypatch):
    """A GrammarCompilerPool built by its own constructor on a tiny ASCII TokenizerInfo (instead of
    an HF tokenizer's), with `pool.compiled` listing every compile that ran."""
    xgr = grammar_mod._xgr()
    info = xgr.TokenizerInfo([chr(i) for i in range(128)])
    monkeypatch.setattr(xgr.TokenizerInfo, "from_huggingface",
                        staticmethod(lambda tok, vocab_size=None, stop_token_ids=None: info))
    pools = []

    def make(cache_size):
        pool = GrammarCompilerPool(object(), 128, cache_size=cache_size)
        pool.compiled = []
        real = pool._compile

        def counting(kind, spec):
            pool.compiled.append(spec)
            return real(kind, spec)

        pool._compile = counting
        pools.append(pool)
        return pool

    yield make
    for pool in pools:
        pool.shutdown()


def _get(pool, spec):
    return pool.submit("regex", spec).result(timeout=10)


def test_cache_keeps_at_most_n_least_recently_used_out(make_pool):
    n, k = 3, 4
    pool = make_pool(n)
    specs = [f"x{i}[0-9]+" for i in range(n + k)]
    for i, s in enumerate(specs):
        _get(pool, s)
        assert len(pool._futures) == min(i + 1, n)  # never more than N kept
    assert pool.compiled == specs
    # the N most recent are the ones kept: asking again compiles nothing
    for s in specs[-n:]:
        _get(pool, s)
    assert pool.compiled == specs
    # and the evicted ones are compiled again
    _get(pool, specs[0])
    assert pool.compiled == specs + [specs[0]]
    assert len(pool._futures) == n
    # xgrammar's own cache would keep every grammar ever compiled, beyond the cap
    assert pool.compiler.get_cache_size_bytes() == 0


def test_recently_used_survives_and_least_recently_used_is_recompiled(make_pool):
    pool = make_pool(3)
    a, b, c, d = "a[0-9]+", "b[0-9]+", "c[0-9]+", "d[0-9]+"
    for s in (a, b, c):
        _get(pool, s)
    _get(pool, a)  # a used again: b is now the least recently used
    assert pool.compiled == [a, b, c]
    _get(pool, d)  # over the cap: b goes (insertion order alone would drop a)
    _get(pool, a)
    _get(pool, c)
    assert pool.compiled == [a, b, c, d]  # a and c not recompiled
    _get(pool, b)
    assert pool.compiled == [a, b, c, d, b]  # b was the one dropped
    # a cache hit returns the same compiled grammar, not an equal copy
    assert pool.submit("regex", d).result() is pool.submit("regex", d).result()


# --- the timeout: an engine on a tiny random model ----------------------------------------------

@pytest.fixture(scope="module")
def limits_engine(tiny_chat_path):
    import radixlm

    eng = radixlm.Engine(model_path=tiny_chat_path, dtype="float32", max_total_tokens=4096,
                         context_length=512, grammar_compile_timeout=TIMEOUT_S,
                         grammar_cache_size=2)
    yield eng
    eng.shutdown()


@pytest.fixture
def slow_regex(monkeypatch):
    """A fresh regex whose compile blocks (in the pool's thread) until `release` is set; the test
    sets it at its end at the latest, so no compile outlives it."""
    spec = f"(yes|no) {time.monotonic_ns() % 997}"
    release = threading.Event()
    started = threading.Event()
    real = GrammarCompilerPool._compile

    def slow(self, kind, s):
        if s == spec:
            started.set()
            release.wait(30)
        return real(self, kind, s)

    monkeypatch.setattr(GrammarCompilerPool, "_compile", slow)
    yield spec, release, started
    release.set()


def _generate_in_thread(eng, params):
    out = {}

    def run():
        out["result"] = eng.generate("Answer:", params)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def test_a_grammar_past_the_timeout_aborts_its_request(limits_engine, slow_regex, integrity):
    eng = limits_engine
    spec, release, started = slow_regex
    t0 = time.monotonic()
    t, out = _generate_in_thread(eng, {"regex": spec, "max_new_tokens": 8, "temperature": 0})
    t.join(timeout=10)  # without the limit it would wait for the compile: bounded here
    waited = time.monotonic() - t0
    assert not t.is_alive(), "the request still waits for its grammar past the timeout"
    assert started.is_set()
    fin = out["result"]["meta_info"]["finish_reason"]
    assert fin["type"] == "abort"
    assert "--grammar-compile-timeout" in fin["message"] and str(TIMEOUT_S) in fin["message"]
    assert TIMEOUT_S <= waited < 5
    assert out["result"]["meta_info"]["completion_tokens"] == 0
    # the engine keeps serving while the compile is still running
    assert not release.is_set()
    free = eng.generate("Hello", {"max_new_tokens": 5, "temperature": 0})
    assert free["meta_info"]["finish_reason"]["type"] == "length"
    assert free["meta_info"]["completion_tokens"] == 5
    # once the compile ends, a request for the same grammar uses it
    release.set()
    again = eng.generate("Answer:", {"regex": spec, "max_new_tokens": 16, "temperature": 0})
    assert again["meta_info"]["finish_reason"]["type"] != "abort", again["meta_info"]
    assert re.fullmatch(spec, again["text"]), again["text"]
    assert eng.scheduler.grammars.cache_size == 2  # --grammar-cache-size reaches the pool
    integrity(eng)


def test_without_the_limit_the_same_request_waits_for_its_grammar(limits_engine, slow_regex,
                                                                   monkeypatch, integrity):
    """The control: the abort above comes from --grammar-compile-timeout, not from the slow
    compile itself. With the limit out of reach the request waits, then completes."""
    eng = limits_engine
    spec, release, started = slow_regex
    # ServerArgs is frozen: the scheduler gets a copy with the limit out of reach (restored after)
    monkeypatch.setattr(eng.scheduler, "args",
                        dataclasses.replace(eng.scheduler.args, grammar_compile_timeout=1e9))
    t, out = _generate_in_thread(eng, {"regex": spec, "max_new_tokens": 16, "temperature": 0})
    assert started.wait(10)
    t.join(timeout=4 * TIMEOUT_S)
    assert t.is_alive(), out  # still waiting, well past TIMEOUT_S
    release.set()
    t.join(timeout=30)
    assert not t.is_alive()
    res = out["result"]
    assert res["meta_info"]["finish_reason"]["type"] != "abort", res["meta_info"]
    assert re.fullmatch(spec, res["text"]), res["text"]
    integrity(eng)
