"""The store's read rate measured at start (tier_prefetch.probe_read_rate): a start on a store
that holds pages and kept no read rate reads a few of them into host slots that go back at the
read's end, and keeps the rate as the store's prior (the head split's, for the first requests
after a restart). Nothing joins the tree, no counter of requests' reads moves, and the KV
accounting holds throughout; an empty store, a kept rate, a page that fails its checks or a
probe cancelled by a flush leave no prior and no slot behind."""

from __future__ import annotations

import os

from radixlm.runtime.mem_cache import tier_prefetch
from radixlm.runtime.mem_cache.kv_mover import KVMover
from radixlm.runtime.mem_cache.tier_transfers import RATES_META

from hicache_helpers import make_tiered, put

HOST = 96


def _start(folder):
    """A cache (2-token pages) on the store in `folder`, as a restart makes it."""
    cache, _, _ = make_tiered(capacity=48, host_capacity=HOST, storage_dir=str(folder))
    return cache


def _warm(folder) -> None:
    """A run that stores 21 pages of one prompt, then stops."""
    cache, pool, alloc = make_tiered(capacity=48, host_capacity=HOST, storage_dir=str(folder))
    assert put(cache, pool, alloc, list(range(100, 142)))  # (written at once: queue 0)
    cache.close()


def _run_reader(cache) -> None:
    while cache.reader.work(1 << 10):
        pass
    cache.apply_prefetch_news(release=True)


def test_a_start_reads_a_few_stored_pages_and_keeps_their_rate(tmp_path, monkeypatch):
    monkeypatch.setattr(tier_prefetch, "PROBE_PAGES", 4)
    _warm(tmp_path)
    assert len(_start(tmp_path).storage.sample_keys(100)) == 21
    cache = _start(tmp_path)
    assert "read_bps" not in cache._rate_priors and cache._rate("read_bps") is None
    assert cache.probe_read_rate()
    assert cache.host.allocator.available_size() == HOST - 8  # 4 pages' slots, held
    cache.check_integrity()
    _run_reader(cache)
    assert cache._rate_priors["read_bps"] > 0 and cache._read_bps is None  # a prior only
    assert cache._rate("read_bps") == cache._rate_priors["read_bps"]
    assert cache.host.allocator.available_size() == HOST and not cache._ops
    assert cache.counters["pages_loaded"] == 0 and cache.host_size() == 0
    cache.check_integrity()
    assert not cache.probe_read_rate()  # measured: no second probe


def test_no_probe_without_pages_or_with_a_kept_rate(tmp_path):
    assert not _start(tmp_path / "empty").probe_read_rate()
    _warm(tmp_path)
    _start(tmp_path).storage.save_meta(RATES_META, {"read_bps": 5e9})
    cache = _start(tmp_path)
    assert not cache.probe_read_rate() and cache._rate("read_bps") == 5e9
    assert cache.host.allocator.available_size() == HOST


def test_a_bad_page_or_a_flush_leaves_no_prior_and_no_slot(tmp_path, monkeypatch):
    monkeypatch.setattr(tier_prefetch, "PROBE_PAGES", 4)
    _warm(tmp_path)
    cache = _start(tmp_path)
    path = cache.storage.path(cache.storage.sample_keys(4)[2])
    with open(path, "r+b") as f:  # a flipped payload byte: fails its CRC
        f.seek(os.path.getsize(path) - 1)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 1]))
    assert cache.probe_read_rate()
    _run_reader(cache)
    assert "read_bps" not in cache._rate_priors
    assert cache.host.allocator.available_size() == HOST and not cache._ops
    cache.check_integrity()
    cache = _start(tmp_path)  # (the bad file was deleted; the others are still there)
    assert cache.probe_read_rate()
    cache.reset()  # a flush cancels it before the reader has run
    assert "read_bps" not in cache._rate_priors
    assert cache.host.allocator.available_size() == HOST and not cache._ops
    cache.check_integrity()


def test_the_cache_probes_at_start_where_heads_split(tmp_path, monkeypatch):
    _warm(tmp_path)
    monkeypatch.setattr(KVMover, "loads_async", True)  # as on CUDA, where heads split
    cache = _start(tmp_path)
    assert cache.split_heads and [op.probe for op in cache._ops] == [True]
    _run_reader(cache)
    assert cache._rate_priors["read_bps"] > 0 and not cache._ops
    cache.check_integrity()
