"""Storage prefetch through the scheduler (fp32, the tiny random Llama of test_hicache_engine.py):
a store whose reads stall never stalls a step (the request goes on and recomputes, with the same
greedy tokens); a queued request's abort cancels its prefetch and frees its host slots, with the
KV accounting exact while the read is still in flight; the cache-aware order ranks storage hits
below host hits below device hits."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from hicache_helpers import make_tiered, prefetch_all, put
from radixlm.runtime.scheduler.policy import match_score, order_waiting
from test_hicache_engine import (PROMPTS, SP, _tiered, make_engine, reference,  # noqa: F401
                                 tiny_path)

STALL_S = 1.5  # one page read of the slow store


@pytest.fixture(scope="module")
def warm_store(tiny_path, tmp_path_factory):  # noqa: F811
    """A store holding every page of PROMPTS[0] and [1] (6 pages of 8 tokens each; written on the
    scheduler's thread, so none is dropped)."""
    import radixlm

    folder = str(tmp_path_factory.mktemp("warm-store"))
    made = []
    _tiered(lambda **kw: made.append(radixlm.Engine(
        model_path=tiny_path, dtype="float32", context_length=512, skip_tokenizer_init=True,
        **kw)) or made[-1], folder, ratio=3, write_queue_pages=0)
    made[0].generate(input_ids=PROMPTS[:2], sampling_params=SP)
    made[0].shutdown()  # pending page writes reach the folder
    return folder


def _slow_reads(eng, seconds: float) -> None:
    """Every page read of the engine's store first sleeps (a store on a congested network): both
    read forms, `get` (scattered host slots) and `get_into` (a run of host rows)."""
    store = eng.scheduler.tree_cache.storage
    for name in ("get", "get_into"):
        real = getattr(store, name)

        def slow(*args, _real=real):
            time.sleep(seconds)
            return _real(*args)

        setattr(store, name, slow)


def _cache_call(eng, fn):
    return eng._call_in_loop(lambda: fn(eng.scheduler.tree_cache))


def wait_until(eng, pred, failure: str, timeout: float = 5.0) -> None:
    """Poll pred(tree cache) on the engine's thread until it holds (else fail with `failure`)."""
    deadline = time.monotonic() + timeout
    while not _cache_call(eng, pred):
        assert time.monotonic() < deadline, failure
        time.sleep(0.01)


@pytest.mark.parametrize("policy", ["best_effort", "timeout"])
def test_slow_store_never_blocks_a_step(make_engine, integrity, reference,  # noqa: F811
                                        warm_store, policy):
    # timeout: at most 0.2 s of waiting for a 40-token prefix, whatever the store does
    eng = _tiered(make_engine, warm_store, policy=policy, prefetch_timeout_base=0.2,
                  prefetch_timeout_per_ki_token=0.0)
    _slow_reads(eng, STALL_S)
    t0 = time.perf_counter()
    out = eng.generate(input_ids=PROMPTS[0], sampling_params=SP)
    elapsed = time.perf_counter() - t0
    assert out["output_ids"] == reference[0]  # recomputed, same greedy tokens
    assert out["meta_info"]["cached_tokens_details"]["storage"] == 0
    # a step that waited on the store would take at least one page read
    assert elapsed < STALL_S * 0.8, elapsed
    integrity(eng)  # the cancelled read may still be running: its slots are held, counted
    assert _cache_call(eng, lambda c: c.counters["prefetch_started"]) == 1


def test_abort_of_a_queued_request_frees_its_prefetch(make_engine, integrity,  # noqa: F811
                                                      warm_store):
    eng = _tiered(make_engine, warm_store, policy="wait_complete")
    _slow_reads(eng, 0.3)  # 5 pages: 1.5 s unless cancelled
    done = {}
    thread = threading.Thread(target=lambda: done.update(eng.generate(
        input_ids=PROMPTS[1], sampling_params=SP, rid="queued")))
    thread.start()

    def reading(cache):
        sched = eng.scheduler
        req = sched.waiting[0] if sched.waiting else None
        return req is not None and req.prefetch is not None and req.prefetch.reading

    wait_until(eng, reading, "the prefetch never started reading")
    held = _cache_call(eng, lambda c: (c.check_integrity(), c.host_slots_held().numel())[1])
    assert held == 40  # its 5 pages' slots (47 matchable tokens): out of the tree and free list
    eng.abort_request("queued")
    thread.join(timeout=5)
    assert done["meta_info"]["finish_reason"]["type"] == "abort"
    _cache_call(eng, lambda c: c.drain_prefetch())  # the read in flight stops at its next page
    stats = _cache_call(eng, lambda c: (c.check_integrity(), c.prefetch_stats())[1])
    assert stats["held_pages"] == 0 and stats["ops"] == 0
    assert _cache_call(eng, lambda c: c.host_slots_held().numel()) == 0
    integrity(eng)


def _req(tokens, prefetch=None):
    return SimpleNamespace(fill_ids=list(tokens), seqlen=len(tokens), prefetch=prefetch,
                           wants_input_logprobs=False, match=None)


def test_order_counts_storage_below_host_below_device(tmp_path):
    cache, pool, alloc = make_tiered(capacity=16, host_capacity=40, storage_dir=str(tmp_path))
    on_host, on_device = list(range(10, 18)), list(range(20, 28))
    stored = list(range(30, 38))
    for seq in (stored, on_host):
        put(cache, pool, alloc, seq)
    cache.evict(16)
    cache.evict_host(8)  # `stored` (least recent) is now in the store only
    put(cache, pool, alloc, on_device)
    found = prefetch_all(cache, stored + [1])  # its 4 pages landed: scored as host hits
    looked_up = cache.start_prefetch(stored + [2])
    cache.reader.work(1)  # its lookup ran, its read has not: storage hits
    cache.apply_prefetch_news(release=False)
    assert looked_up.found == 4 and looked_up.landed == 0
    reqs = {"cold": _req([1, 2, 3, 4, 5]), "found": _req(stored + [2], looked_up),
            "host": _req(on_host + [1]), "landed": _req(stored + [1], found),
            "device": _req(on_device + [1])}
    order = order_waiting(list(reqs.values()), "lpm", cache)
    names = {id(r): n for n, r in reqs.items()}
    assert [names[id(r)] for r in order] == ["device", "host", "landed", "found", "cold"]
    scores = {n: match_score(r.match, r.prefetch) for n, r in reqs.items()}
    assert scores == {"device": 8, "host": 4, "landed": 4, "found": 2, "cold": 0}
    cache.check_integrity()


def test_the_default_read_bound_takes_a_long_prompt_whole():
    """The default bound of pages in flight lets one long prompt of an 8B model (16k tokens,
    2 GiB of KV) be read whole when the host pool is large (1 GiB, the old default, read half
    of it and recomputed the rest), and stays at half the host pool when that is smaller."""
    from types import SimpleNamespace

    from radixlm.runtime.mem_cache.tier_prefetch import default_prefetch_pages

    token_bytes = 32 * 2 * 8 * 128 * 2  # Llama-3.1-8B, bf16
    big = SimpleNamespace(token_bytes=token_bytes, capacity=400_000)
    assert default_prefetch_pages(big, 64) * 64 >= 16_384
    small = SimpleNamespace(token_bytes=token_bytes, capacity=4_096)
    assert default_prefetch_pages(small, 64) * 64 == 2_048


class _LaggingEvent:
    """A copy's event that reports done after a few polls (CUDA's asynchronous load, faked)."""

    def __init__(self):
        self.polls = 2

    def query(self) -> bool:
        self.polls -= 1
        return self.polls < 0

    def synchronize(self) -> None:
        self.polls = -1


def test_landed_pages_start_their_copy_while_the_read_goes_on(make_engine, integrity,  # noqa: F811
                                                              reference, warm_store,
                                                              monkeypatch):
    """With asynchronous loads (CUDA; faked here: the copy is made at once and its event lags),
    a request waiting for its pages has the pages landed so far copied to the device while the
    reader goes on (`_stream_prefetched`), so that the copy does not wait for the whole read;
    admission still waits for the read (wait_complete), the tokens are the plain engine's and
    every stored token is reported as a storage hit."""
    from radixlm.runtime.mem_cache.kv_mover import KVMover
    from radixlm.runtime.scheduler.prefill import PrefillAdder

    real_to_device, real_stream = KVMover.to_device, PrefillAdder.stream
    monkeypatch.setattr(KVMover, "to_device", lambda self, h, d: (real_to_device(self, h, d),
                                                                  _LaggingEvent())[1])
    streamed = []

    def stream(self, req):
        op = req.prefetch
        before = (op.landed, op.page_count)
        ok = real_stream(self, req)
        if ok:
            streamed.append(before)
        return ok

    monkeypatch.setattr(PrefillAdder, "stream", stream)
    monkeypatch.setattr(KVMover, "loads_async", True)  # as on CUDA
    eng = _tiered(make_engine, warm_store, policy="wait_complete")
    _slow_reads(eng, 0.1)  # 5 pages: ~0.5 s of reading, a step per landed page
    out = eng.generate(input_ids=PROMPTS[0], sampling_params=SP)
    assert out["output_ids"] == reference[0]
    assert out["meta_info"]["cached_tokens_details"]["storage"] == 40, out["meta_info"]
    assert any(landed < pages for landed, pages in streamed), streamed  # before the read ended
    integrity(eng)


def test_each_landed_run_streams_below_a_copy_still_in_flight(make_engine, integrity,  # noqa: F811
                                                               reference, warm_store,
                                                               monkeypatch):
    """A landed run's copy starts at once, below the request's own copy still in flight (the
    mover's streams keep them in order), not after it has landed: here every copy stays in
    flight until the read has ended, and each later run still streamed as it landed. Tokens
    and storage hits as the plain engine's."""
    from radixlm.runtime.mem_cache import page_reader
    from radixlm.runtime.mem_cache.kv_mover import KVMover
    from radixlm.runtime.scheduler.prefill import PrefillAdder

    ops = []

    class _UntilTheReadEnds:  # a copy's event: done once every read seen has ended
        def query(self) -> bool:
            return all(op.done for op in ops)

        def synchronize(self) -> None:
            pass

    real_to_device, real_stream = KVMover.to_device, PrefillAdder.stream
    monkeypatch.setattr(KVMover, "to_device", lambda self, h, d: (real_to_device(self, h, d),
                                                                  _UntilTheReadEnds())[1])
    chained = []

    def stream(self, req):
        ops.extend([req.prefetch] if req.prefetch not in ops else [])
        in_flight = req.preload is not None and self.tree_cache.loading(req.preload[0])
        ok = real_stream(self, req)
        chained.append(ok and in_flight)
        return ok

    monkeypatch.setattr(PrefillAdder, "stream", stream)
    monkeypatch.setattr(KVMover, "loads_async", True)  # as on CUDA
    monkeypatch.setattr(page_reader, "READ_AHEAD", 1)  # one page at a time
    eng = _tiered(make_engine, warm_store, policy="wait_complete")
    _slow_reads(eng, 0.1)  # 5 pages, each reported as it lands
    out = eng.generate(input_ids=PROMPTS[0], sampling_params=SP)
    assert out["output_ids"] == reference[0]
    assert out["meta_info"]["cached_tokens_details"]["storage"] == 40, out["meta_info"]
    assert sum(chained) >= 3, chained  # pages 2..5 below page 1's copy, still in flight
    integrity(eng)


def test_a_threaded_read_reports_its_pages_in_runs(tmp_path):
    """The reader thread reports landed pages in runs (page_reader.LANDED_REPORT_TOKENS, or a
    quarter of the read), the last run in quarters (what is reported after the read's end is
    copied after it): each report makes the scheduler step, and page by page those steps held
    the GIL the fetchers need. Every page still lands and joins the tree."""
    import collections

    from radixlm.runtime.mem_cache.page_reader import landed_report_pages

    cache, pool, alloc = make_tiered(capacity=48, host_capacity=96, storage_dir=str(tmp_path),
                                     threaded=True)
    try:
        seq = list(range(100, 142))  # 21 pages of 2 tokens
        assert put(cache, pool, alloc, seq)
        cache.evict(48)
        cache.evict_host(96)  # in the store only
        kinds = []

        class Recorded(collections.deque):
            def append(self, item):
                kinds.append(item[0] if item[0] != "landed" else item[2])
                super().append(item)

        cache.reader.news = Recorded()
        op = cache.start_prefetch(seq + [1])
        deadline = time.monotonic() + 10
        while not op.done:
            assert time.monotonic() < deadline, "the read never ended"
            cache.apply_prefetch_news(release=True)
            time.sleep(0.001)
        assert op.landed == op.page_count == 21
        run = landed_report_pages(op)
        # runs of 5 pages while a whole run is left after them, then each quarter run (1 page)
        assert run == 5 and kinds == ["found", 5, 10, 15, 17, 18, 19, 20, 21, "read_end"]
        taken = cache.take_prefetch(op)
        assert taken == (0, 42) and cache.match_prefix(seq).lower_len == 42
        cache.check_integrity()
    finally:
        cache.close()
