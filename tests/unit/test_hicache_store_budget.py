"""The file store's size cap (`file_storage_max_gb`; storage/page_budget.py): past it a write
removes the least recently written or read pages, what a restart finds counts against it, and a
tiered cache whose pages were evicted recomputes them (never serves a missing page)."""

from __future__ import annotations

import os
import time

from radixlm.runtime.mem_cache.hicache_config import HiCacheConfig
from radixlm.runtime.mem_cache.storage.file_backend import FileStorage
from tests.unit.hicache_helpers import admit, expect_kv, make_tiered, prefetch_all, put
from tests.unit.test_hicache_tree import _args

PAGE = 16  # payload bytes: a file is the 64-byte header and the payload


def _key(i: int) -> bytes:
    return bytes([i]) * 32


def _on_disk(store) -> set:
    return {k for k in map(_key, range(1, 10)) if os.path.exists(store.path(k))}


def test_least_recently_used_pages_go_past_the_cap(tmp_path):
    store = FileStorage(str(tmp_path), "ns", PAGE, max_bytes=3 * (64 + PAGE) + 10)
    assert store.max_pages == 3
    for i in (1, 2, 3, 4):
        assert store.put(_key(i), bytes([i]) * PAGE)
        store.flush()  # (one at a time: the writer threads would race the order otherwise)
    assert _on_disk(store) == {_key(2), _key(3), _key(4)}
    assert store.get(_key(1)) is None and store.counters["pages_evicted"] == 1
    assert store.get(_key(2)) == bytes([2]) * PAGE  # read: now the most recent
    store.put(_key(5), bytes([5]) * PAGE)
    store.flush()
    assert _on_disk(store) == {_key(2), _key(4), _key(5)}  # 3 went, not the page just read
    assert store.stats()["pages_known"] == 3 and store.stats()["max_pages"] == 3
    store.close()


def test_a_restart_counts_the_pages_on_disk(tmp_path):
    first = FileStorage(str(tmp_path), "ns", PAGE)  # no cap: every page stays
    for i in (1, 2, 3, 4):
        first.put(_key(i), bytes([i]) * PAGE)
        first.flush()
        os.utime(first.path(_key(i)), (time.time() - 100 + i, time.time() - 100 + i))
    first.close()
    assert len(_on_disk(first)) == 4
    again = FileStorage(str(tmp_path), "ns", PAGE, max_bytes=2 * (64 + PAGE))
    assert _on_disk(again) == {_key(3), _key(4)}  # the oldest modified went at start
    assert again.get(_key(4)) == bytes([4]) * PAGE and again.counters["pages_evicted"] == 2
    open(os.path.join(again.dir, "stray.txt"), "w").write("not a page")  # left alone
    again.put(_key(5), bytes([5]) * PAGE)
    again.flush()
    assert _on_disk(again) == {_key(4), _key(5)}
    assert os.path.exists(os.path.join(again.dir, "stray.txt"))
    again.close()


def test_cap_from_the_extra_config():
    cfg = HiCacheConfig.from_args(_args(
        hicache_storage_backend="file",
        hicache_storage_backend_extra_config='{"file_storage_max_gb": 0.5}'), 1000, 1000)
    assert cfg.storage_max_bytes == 500_000_000
    assert HiCacheConfig.from_args(_args(hicache_storage_backend="file"), 1000,
                                   1000).storage_max_bytes is None


def test_a_restart_serves_what_the_cap_kept(tmp_path):
    probe, _, _ = make_tiered(storage_dir=str(tmp_path / "probe"))
    two_pages = 2 * (64 + probe.storage.page_bytes)
    first, pool, alloc = make_tiered(storage_dir=str(tmp_path), store_max_bytes=two_pages)
    old, new = [1, 2, 3, 4], [9, 8, 7, 6]  # two pages each (page = 2 tokens)
    put(first, pool, alloc, old)
    first.storage.flush()  # (the writer threads would race `old`'s and `new`'s order otherwise)
    put(first, pool, alloc, new)  # the store keeps two pages: `old`'s went
    first.close()
    assert first.storage.counters["pages_evicted"] == 2 and len(_files(tmp_path)) == 2
    cache, pool, alloc = make_tiered(storage_dir=str(tmp_path), store_max_bytes=two_pages)
    assert prefetch_all(cache, old + [5]).found == 0  # evicted: recomputed, never served
    cache.drain_prefetch()
    slots, node, details = admit(cache, alloc, new + [5])
    assert details["storage"] == 4
    expect_kv(pool, new, slots)
    cache.dec_lock_ref(node)
    cache.check_integrity()


def _files(root) -> list:
    return [p for p in root.glob("ns/*/*.kv")]
