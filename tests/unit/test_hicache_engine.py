"""The hierarchical cache end to end on the CPU (fp32, the tiny random Llama of tests/tiny_models.py:
every check here holds for any deterministic model): greedy tokens equal the plain engine's when
prefixes come back from the host pool and from the file store, with page writes on the writer
thread, on the scheduler's thread, or held in flight; after a shutdown with writes pending and a
restart on the same store; after its pages are spoiled; reporting (meta_info, get_stats,
/metrics, /get_server_info, /flush_cache?storage=true). KV integrity is checked after every
engine run."""

from __future__ import annotations

import json
import random

import pytest
from fastapi.testclient import TestClient

SP = {"temperature": 0, "max_new_tokens": 2}
PAGE = 8


def _prompts() -> list[list[int]]:
    rng = random.Random(25)
    return [[rng.randrange(100, 20000) for _ in range(48)] for _ in range(4)]


PROMPTS = _prompts()


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory) -> str:
    """A random 2-layer Llama without a tokenizer (the prompts are token ids)."""
    from tiny_models import write_tiny_llama

    return write_tiny_llama(str(tmp_path_factory.mktemp("tiny-llama")), vocab=20480, heads=4,
                            kv_heads=2, tied=True)


def _engine(path, **kwargs):
    import radixlm

    return radixlm.Engine(model_path=path, dtype="float32", context_length=512,
                          skip_tokenizer_init=True, **kwargs)


@pytest.fixture
def make_engine(tiny_path):
    """Engines on the tiny model (a forward costs microseconds); each is shut down at the end."""
    made = []

    def factory(**kwargs):
        made.append(_engine(tiny_path, **kwargs))
        return made[-1]

    yield factory
    for eng in made:
        eng.shutdown()


@pytest.fixture(scope="module")
def reference(tiny_path):
    engine = _engine(tiny_path, max_total_tokens=2000)
    outs = engine.generate(input_ids=PROMPTS, sampling_params=SP)
    engine.shutdown()
    assert "cached_tokens_details" not in outs[0]["meta_info"]  # tiers off: as before
    return [o["output_ids"] for o in outs]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return str(tmp_path_factory.mktemp("hicache-store"))


def _tiered(make_engine, folder, ratio=1.5, policy="timeout", **extra):
    # device pool of 110 tokens: two 50-token conversations; host pool 1.5x: three; every
    # stored page is worth a prefetch (the prompts are shorter than SGLang's 256-token default)
    return make_engine(max_total_tokens=110, enable_hicache=True, hicache_ratio=ratio,
                       hicache_storage_backend="file", hicache_storage_prefetch_policy=policy,
                       hicache_storage_backend_extra_config=json.dumps(
                           dict(file_storage_path=folder, page_tokens=PAGE,
                                prefetch_threshold=PAGE, **extra)))


def _landed(eng) -> None:
    """Let the writer finish (the counts below are exact only once a request's pages are in)."""
    eng._call_in_loop(eng.scheduler.tree_cache.finish_writes)


def _run_each(eng, integrity, reference, order=(0, 1, 2, 3), land=True) -> list[dict]:
    details = []
    for i in order:
        out = eng.generate(input_ids=PROMPTS[i], sampling_params=SP)
        assert out["output_ids"] == reference[i]
        meta = out["meta_info"]
        assert sum(meta["cached_tokens_details"].values()) == meta["cached_tokens"]
        details.append(meta["cached_tokens_details"])
        integrity(eng)
        if land:
            _landed(eng)
    return details


@pytest.mark.parametrize("queue", [None, 0], ids=["writer-thread", "scheduler-thread"])
def test_prefixes_back_from_host_and_storage(make_engine, integrity, reference, tmp_path, queue):
    extra = {} if queue is None else {"write_queue_pages": queue}
    eng = _tiered(make_engine, str(tmp_path), **extra)
    first = _run_each(eng, integrity, reference)
    assert all(d == {"device": 0, "host": 0, "storage": 0} for d in first)
    # newest first: the device holds the last, the host the two before, the store the first
    again = _run_each(eng, integrity, reference, order=(3, 2, 1, 0))
    assert again[2]["host"] > 0 and again[3]["storage"] == 40, again
    assert all(sum(d.values()) == 47 for d in again[:3]), again  # all but the last token
    tiers = eng.get_stats()["hicache"]
    assert tiers["hit_tokens_storage"] == sum(d["storage"] for d in again)
    assert tiers["bytes_host_to_device"] > 0 and tiers["storage"]["pages_written"] > 0
    # the default queue here is 5 pages (a quarter of the 165-token host pool): a 6-page backup
    # drops its last page; written synchronously, nothing is bounded
    assert (tiers["pages_write_dropped"] > 0) == (queue is None)


def test_shutdown_with_writes_pending(make_engine, integrity, reference, store):
    # a host pool for all four conversations and a queue for all their pages: every page waits
    eng = _tiered(make_engine, store, ratio=3, write_queue_pages=64)
    cache = eng.scheduler.tree_cache
    cache.writer.pause()  # every page write stays in flight while the requests run
    _run_each(eng, integrity, reference, land=False)  # integrity holds with writes in flight
    stats = eng.get_stats()["hicache"]
    assert stats["pages_stored"] == 0 and stats["storage"]["write_queue"]["pending_pages"] == 24
    thread = cache.writer._thread
    eng.shutdown()  # the pending writes reach the folder; nothing is left held or running
    assert not thread.is_alive() and cache.writer.pending_pages == 0
    cache.check_integrity()
    assert cache.counters["pages_stored"] == 4 * 6  # each prompt's 48 tokens: 6 pages


def test_restart_on_the_same_store(make_engine, integrity, reference, store):
    eng = _tiered(make_engine, store)  # a new engine: empty device and host pools
    details = _run_each(eng, integrity, reference)
    assert all(d == {"device": 0, "host": 0, "storage": 40} for d in details), details
    eng.flush_cache()  # device and host only: the pages stay
    assert eng.generate(input_ids=PROMPTS[0], sampling_params=SP)[
        "meta_info"]["cached_tokens_details"]["storage"] == 40
    integrity(eng)


def test_spoiled_store_is_recomputed(make_engine, integrity, reference, store, tmp_path):
    import pathlib

    eng = _tiered(make_engine, store)
    for path in pathlib.Path(store).rglob("*.kv"):  # flip a value in every page
        data = bytearray(path.read_bytes())
        data[-1] ^= 0x80
        path.write_bytes(bytes(data))
    out = eng.generate(input_ids=PROMPTS[1], sampling_params=SP)
    assert out["output_ids"] == reference[1]
    assert out["meta_info"]["cached_tokens_details"]["storage"] == 0
    # the first bad page ends the read; the few read ahead of it (page_reader.READ_AHEAD) are
    # checked too, and none of them is served
    from radixlm.runtime.mem_cache.page_reader import READ_AHEAD

    assert 1 <= eng.get_stats()["hicache"]["storage"]["pages_corrupt"] <= READ_AHEAD
    integrity(eng)


def test_reporting_routes(make_engine, integrity, reference, tmp_path):
    from radixlm.server.http_server import build_app
    from radixlm.server.metrics import ServerMetrics

    eng = _tiered(make_engine, str(tmp_path))
    _run_each(eng, integrity, reference)  # fills the store
    eng.generate(input_ids=PROMPTS[0], sampling_params=SP)
    _landed(eng)
    eng.scheduler.tree_cache.storage.flush()
    assert list(tmp_path.rglob("*.kv"))

    class TM:  # the TokenizerManager's control channel, answered by the engine's scheduler
        metrics, info = ServerMetrics(), {"max_total_tokens": 110, "device": "cpu",
                                          "dtype": "float32", "hf_config": {},
                                          "eos_token_ids": [2]}
        model_path = model_name = "smol"
        server_args, tokenizer = eng.server_args, eng.tokenizer

        async def control(self, kind, payload=None, timeout=30.0):
            if kind == "flush_cache":
                return eng.flush_cache(bool((payload or {}).get("storage")))
            return eng.get_stats()

    client = TestClient(build_app(TM(), eng.server_args, lambda: None))
    text = client.get("/metrics").text
    assert 'radixlm:hicache_hit_tokens{tier="host"}' in text
    assert 'radixlm:hicache_capacity_tokens{tier="host"} 165.0' in text
    assert 'radixlm:hicache_bytes_moved{direction="host_to_storage"}' in text
    info = client.get("/get_server_info").json()
    assert info["internal_states"][0]["hicache"]["host"]["capacity"] == 165
    assert info["enable_hierarchical_cache"] is True
    assert client.post("/flush_cache?storage=maybe").status_code == 400
    assert client.post("/flush_cache").status_code == 200
    assert list(tmp_path.rglob("*.kv"))  # L1 and L2 only
    assert client.post("/flush_cache?storage=true").status_code == 200
    assert not list(tmp_path.rglob("*.kv"))
    integrity(eng)
