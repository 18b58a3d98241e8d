"""Compute the head, read the tail (mem_cache/head_split.py, scheduler/split_heads.py), through
the scheduler on the CPU (fp32, the tiny random Llama of test_hicache_engine.py), with the split
turned on (CUDA only by default) and the rates set so that it happens: a split request's greedy
tokens are the reference's, its head is reported as computed and its tail as storage hits, two
requests splitting the same prefix share the head, a head longer than a chunk is computed in
chunks, a tail page that fails its checks or a read slower than the deadline is recomputed,
an abort while the tail is read leaves no lock, row or host slot behind, and a restart starts
with the rates the store kept."""

from __future__ import annotations

import threading
import time

import pytest

from radixlm.runtime.mem_cache import head_split
from radixlm.runtime.mem_cache.head_split import head_split_pages
from test_hicache_engine import (PAGE, PROMPTS, SP, _tiered, make_engine, reference,  # noqa: F401
                                 tiny_path)
from test_hicache_prefetch import _cache_call, _slow_reads, wait_until, warm_store  # noqa: F401
from test_hicache_preload import slow_loads  # noqa: F401

STORED_PAGES = 5  # of a 48-token prompt: 47 matchable tokens, 8-token pages


def test_head_split_pages_balances_compute_and_read():
    # h = T * C / (C + R), in whole pages, at least one page read
    assert head_split_pages(100, 64, 30_000.0, 70_000.0) == 30
    assert head_split_pages(100, 64, 1e9, 1.0) == 99
    assert head_split_pages(100, 64, None, 70_000.0) == 0  # not measured yet: read it all
    assert head_split_pages(100, 64, 30_000.0, None) == 0
    assert head_split_pages(10, 64, 1_000.0, 70_000.0) == 0  # under MIN_HEAD_TOKENS
    assert head_split_pages(1, 64, 1e9, 1.0) == 0


def _split_engine(make_engine, store, monkeypatch, engine_kw=None, **kw):  # noqa: F811
    """An engine on the warm store whose next lookups split their pages in two halves: compute
    rate 2 tokens/s against a read rate of 2 (storage still pays against the prefill's 1)."""
    monkeypatch.setattr(head_split, "MIN_HEAD_TOKENS", 1)
    eng = _tiered(lambda **e: make_engine(**e, **(engine_kw or {})), store, **kw)
    _set_rates(eng)
    return eng


def _set_rates(eng) -> None:
    def setup(cache):
        cache.split_heads = True
        cache._prefill_tps, cache._head_tps = 1.0, 2.0
        cache._read_bps = 2.0 * cache.host.token_bytes

    _cache_call(eng, setup)


def _counters(eng) -> dict:
    return _cache_call(eng, lambda c: dict(c.counters))


@pytest.mark.parametrize("chunk,loads", [(None, "sync"), (8, "sync"), (None, "async"),
                                         (8, "async")])
def test_split_request_matches_the_reference(make_engine, integrity, reference,  # noqa: F811
                                             warm_store, monkeypatch, request, chunk, loads):
    # chunk 8: a head of 16 tokens in two chunks; async: loads as on CUDA (test_hicache_preload's
    # stand-in), so the tail's pages stream to the device below the head while the read goes on
    # and the request's preload and head locks both hand over at admission
    if loads == "async":
        request.getfixturevalue("slow_loads")
    extra = {} if chunk is None else {"chunked_prefill_size": chunk}
    eng = _split_engine(make_engine, warm_store, monkeypatch, engine_kw=extra)
    out = eng.generate(input_ids=PROMPTS[0], sampling_params=SP)
    assert out["output_ids"] == reference[0]
    head = STORED_PAGES // 2 * PAGE  # 2 pages computed, 3 read
    meta = out["meta_info"]
    assert meta["cached_tokens_details"] == {"device": 0, "host": 0,
                                             "storage": (STORED_PAGES * PAGE - head)}
    assert meta["cached_tokens"] == STORED_PAGES * PAGE - head
    c = _counters(eng)
    assert c["head_splits"] == 1 and c["head_split_tokens"] == head
    assert c["hit_tokens_storage"] == STORED_PAGES * PAGE - head and c["hit_tokens_device"] == 0
    assert (c["preloads"] > 0) == (loads == "async")
    integrity(eng)
    assert _cache_call(eng, lambda c: c._head_tps) != 2.0  # the head's forward was timed


def test_two_requests_share_one_head(make_engine, integrity, reference,  # noqa: F811
                                     warm_store, monkeypatch):
    # slow reads: the second lookup ends while the first request waits for its tail (or before
    # its head is computed); both split, the second finds the first's head in the tree (no
    # second compute) and waits for its own tail
    eng = _split_engine(make_engine, warm_store, monkeypatch)
    _slow_reads(eng, 0.2)
    outs = eng.generate(input_ids=[PROMPTS[1], PROMPTS[1]], sampling_params=SP)
    assert [o["output_ids"] for o in outs] == [reference[1]] * 2
    head = STORED_PAGES // 2 * PAGE
    tail = {"host": 0, "storage": STORED_PAGES * PAGE - head}
    details = sorted((o["meta_info"]["cached_tokens_details"] for o in outs),
                     key=lambda d: d["device"])
    # the first: its head computed, its tail read; the second: its head from the first (and its
    # tail too when the first has finished by the time its own read ends)
    assert details[0] == dict(tail, device=0) and details[1]["device"] >= head
    for o in outs:
        meta = o["meta_info"]
        assert sum(meta["cached_tokens_details"].values()) == meta["cached_tokens"]
    assert _counters(eng)["head_splits"] == 2
    integrity(eng)


def test_abort_while_the_tail_is_read(make_engine, integrity, warm_store,  # noqa: F811
                                      monkeypatch):
    eng = _split_engine(make_engine, warm_store, monkeypatch, policy="wait_complete")
    _slow_reads(eng, 0.3)  # 3 tail pages: 0.9 s unless cancelled
    done = {}
    thread = threading.Thread(target=lambda: done.update(eng.generate(
        input_ids=PROMPTS[0], sampling_params=SP, rid="split")))
    thread.start()

    wait_until(eng, lambda cache: any(r.parked is not None for r in eng.scheduler.waiting),
               "the request never computed its head")
    # the head's lock is the parked request's; the tail's host slots are held by its read
    assert _cache_call(eng, lambda c: c.protected_size()) == STORED_PAGES // 2 * PAGE
    eng.abort_request("split")
    thread.join(timeout=5)
    assert done["meta_info"]["finish_reason"]["type"] == "abort"
    _cache_call(eng, lambda c: c.drain_prefetch())
    stats = _cache_call(eng, lambda c: (c.check_integrity(), c.prefetch_stats())[1])
    assert stats["held_pages"] == 0 and stats["ops"] == 0
    integrity(eng)  # idle: no lock left (the parked one released), every row free


def test_a_bad_tail_page_is_recomputed(make_engine, integrity, reference,  # noqa: F811
                                       warm_store, monkeypatch):
    # every page read after the first fails its checks (as a corrupt file does): the read ends
    # there, the request takes what landed (if anything) below its head, recomputes the rest
    eng = _split_engine(make_engine, warm_store, monkeypatch)
    store = eng.scheduler.tree_cache.storage
    real, calls = store.get_into, []

    def first_only(key, out):
        calls.append(key)
        return real(key, out) if len(calls) == 1 else False

    monkeypatch.setattr(store, "get_into", first_only)
    out = eng.generate(input_ids=PROMPTS[0], sampling_params=SP)
    assert out["output_ids"] == reference[0]
    meta = out["meta_info"]
    head = STORED_PAGES // 2 * PAGE
    assert meta["cached_tokens_details"]["storage"] in (0, PAGE)  # at most the first tail page
    assert meta["cached_tokens"] == sum(meta["cached_tokens_details"].values())
    c = _counters(eng)
    assert c["head_splits"] == 1 and c["head_split_tokens"] == head
    assert c["storage_load_failures"] == 1
    integrity(eng)


def test_a_slow_tail_read_gives_up_at_the_deadline(make_engine, integrity, reference,  # noqa: F811
                                                   warm_store, monkeypatch):
    # the timeout policy's deadline (0.2 s here) passes while the request waits for its tail:
    # it is admitted below its head and recomputes the tail; the read in flight is cancelled
    eng = _split_engine(make_engine, warm_store, monkeypatch, prefetch_timeout_base=0.2,
                        prefetch_timeout_per_ki_token=0.0)
    _slow_reads(eng, 1.5)
    t0 = time.perf_counter()
    out = eng.generate(input_ids=PROMPTS[0], sampling_params=SP)
    assert time.perf_counter() - t0 < 1.2  # not one whole page read
    assert out["output_ids"] == reference[0]
    assert out["meta_info"]["cached_tokens_details"] == {"device": 0, "host": 0, "storage": 0}
    assert _counters(eng)["head_splits"] == 1
    integrity(eng)


def test_a_restart_starts_with_the_rates_its_store_kept(tmp_path, monkeypatch):
    # the rates a run measured are kept in the store at shutdown; the next run's head split
    # uses them until it has measured its own: its first lookup splits; a broken file is as
    # good as none
    from hicache_helpers import make_tiered, put

    monkeypatch.setattr(head_split, "MIN_HEAD_TOKENS", 1)
    cache, pool, alloc = make_tiered(capacity=16, host_capacity=24, storage_dir=str(tmp_path))
    seq = list(range(10, 18))  # 4 pages of 2 tokens
    assert put(cache, pool, alloc, seq)
    cache._prefill_tps, cache._head_tps = 10.0, 20.0
    cache._read_bps = 20.0 * cache.host.token_bytes
    cache.close()
    cache, pool, alloc = make_tiered(capacity=16, host_capacity=24, storage_dir=str(tmp_path))
    try:
        assert cache._prefill_tps is None and cache._read_bps is None  # nothing measured yet
        assert cache._rate_priors == {"prefill_tps": 10.0, "head_tps": 20.0,
                                      "read_bps": 20.0 * cache.host.token_bytes}
        cache.split_heads = True
        op = cache.start_prefetch(seq + [1], may_split=True)
        cache.reader.work(1 << 30)
        cache.apply_prefetch_news(release=True, idle=True)
        assert op.head_end == 4 and op.first == 2  # h = 4 pages x 20 / (20 + 20)
        assert cache._storage_pays()  # read-or-recompute waits for this run's own rates
        cache._head_tps = 1e9  # this run's own measure wins over the prior
        assert cache._rate("head_tps") == 1e9
        cache.cancel_prefetch(op)
        cache.reader.drain()
    finally:
        cache.close()
    with open(tmp_path / "ns" / "rates.json", "w") as f:
        f.write("{not json")
    cache, _, _ = make_tiered(capacity=16, host_capacity=24, storage_dir=str(tmp_path))
    try:
        assert cache._rate_priors == {}
    finally:
        cache.close()


@pytest.mark.parametrize("overlap", [False, True])
def test_a_fresh_single_prompt_times_as_a_head(make_engine, integrity,  # noqa: F811
                                               monkeypatch, overlap):
    # an extend that computes what a head would (one prompt from its first token, no decode
    # rows beside it) gives the head rate its sample before any split: the first split after
    # a start is cut by it, not by the mean rate of every extend. A prompt with a cached prefix
    # or two prompts in one extend do not count. overlap: the extend is launched in flight
    # (overlap_extend's `_launch_extend`, the GPU's path), not run by the plain step
    from radixlm.runtime.scheduler import split_heads

    monkeypatch.setattr(head_split, "MIN_HEAD_TOKENS", 40)
    samples = []
    real = split_heads.SplitHeads._observe_heads

    def observe(self):
        before = self.tree_cache._head_tps
        real(self)
        if self.tree_cache._head_tps != before:
            samples.append(self.tree_cache._head_tps)

    monkeypatch.setattr(split_heads.SplitHeads, "_observe_heads", observe)
    # (a pool that takes both prompts of the two-at-once call in one extend: in _tiered's 110
    # tokens the second could wait for the first to finish, then run alone, as a head)
    eng = make_engine(max_total_tokens=400, enable_hicache=True, hicache_ratio=2)
    eng._call_in_loop(lambda: setattr(eng.scheduler, "overlap", overlap))
    launched = eng.scheduler.stats["overlapped_extend_steps"]
    eng.generate(input_ids=PROMPTS[0], sampling_params=SP)  # (read at its decode steps)
    assert (eng.scheduler.stats["overlapped_extend_steps"] > launched) == overlap
    assert len(samples) == 1 and samples[0] > 0
    eng.generate(input_ids=[7] * 30, sampling_params=SP)  # under 40 tokens
    assert len(samples) == 1
    eng.generate(input_ids=PROMPTS[1], sampling_params=SP)
    assert len(samples) == 2
    eng.generate(input_ids=PROMPTS[0] + [5] * 44, sampling_params=SP)  # a cached prefix
    eng.generate(input_ids=[PROMPTS[2], PROMPTS[3]], sampling_params=SP)  # two at once
    assert len(samples) == 2
    integrity(eng)
