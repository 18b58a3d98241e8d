"""HiRadixCache and its store, case by case: write policies, loads from each tier, a restart on
the same folder, bad page files, a full disk, the recompute-or-load choice and the flags' checks.
(The state machine in test_hicache_property.py covers the interleavings.)"""

from __future__ import annotations

import errno
import logging
import os
from types import SimpleNamespace

import pytest
import torch

from hicache_helpers import admit, check_contents, expect_kv, make_tiered, prefetch_all, put
from radixlm.runtime.mem_cache.hicache_config import HiCacheConfig
from radixlm.runtime.mem_cache.storage import file_backend
from radixlm.runtime.mem_cache.storage.file_backend import FileStorage

SEQ = [5, 6, 7, 8, 9, 10]  # three pages of two tokens


def _down_to_storage(cache) -> None:
    cache.evict(cache.allocator.capacity)
    cache.evict_host(cache.host.capacity)


@pytest.mark.parametrize("policy,backed_at_insert,backed_at_second", [
    ("write_through", True, True), ("write_through_selective", False, True),
    ("write_back", False, False)])
def test_write_policies(policy, backed_at_insert, backed_at_second):
    cache, pool, alloc = make_tiered(policy=policy)
    put(cache, pool, alloc, SEQ)
    assert (cache.host_size() == len(SEQ)) == backed_at_insert
    put(cache, pool, alloc, SEQ)  # a second request through the same node
    assert (cache.host_size() == len(SEQ)) == backed_at_second
    cache.evict(len(SEQ))  # every policy backs up before the device copy goes
    assert cache.total_size() == 0 and cache.host_size() == len(SEQ)
    check_contents(cache, pool)
    cache.check_integrity()


def test_load_from_host_and_storage(tmp_path):
    cache, pool, alloc = make_tiered(storage_dir=str(tmp_path))
    put(cache, pool, alloc, SEQ)
    put(cache, pool, alloc, [1, 2, 3])
    cache.evict(cache.allocator.capacity)  # both now host-only
    slots, node, details = admit(cache, alloc, SEQ + [11])
    assert details == {"device": 0, "host": 6, "storage": 0}
    expect_kv(pool, SEQ, slots)
    cache.dec_lock_ref(node)
    _down_to_storage(cache)
    assert cache.store_index_size() == 6 + 2  # [1, 2, 3] keeps its stored page only
    slots, node, details = admit(cache, alloc, SEQ)
    assert details == {"device": 0, "host": 0, "storage": 6}
    expect_kv(pool, SEQ, slots)
    cache.dec_lock_ref(node)
    cache.check_integrity()
    check_contents(cache, pool)


def test_restart_finds_pages_past_the_tree(tmp_path):
    first, pool, alloc = make_tiered(storage_dir=str(tmp_path))
    put(first, pool, alloc, SEQ)
    first.close()
    cache, pool, alloc = make_tiered(storage_dir=str(tmp_path))  # a new process, empty tree
    m = cache.match_prefix(SEQ + [1])
    assert m[0].numel() == 0 and m.storage_len == 0  # a match does no store I/O
    op = prefetch_all(cache, SEQ + [1])  # the prefetch's lookup finds them
    assert op.found == 3 and op.landed == 3
    assert m.prefetch_score(op) == 0.5 * 6  # landed: scored as host hits
    assert prefetch_all(cache, SEQ[:5]).found == 2  # a partial page is recomputed
    cache.drain_prefetch()
    slots, node, details = admit(cache, alloc, SEQ + [1])
    assert details["storage"] == 6
    expect_kv(pool, SEQ, slots)
    cache.dec_lock_ref(node)
    other, _, _ = make_tiered(storage_dir=str(tmp_path), seed=b"another model")
    assert prefetch_all(other, SEQ + [1]).found == 0  # keys name the model too
    cache.check_integrity()


@pytest.mark.parametrize("damage", ["flip", "truncate", "empty", "foreign", "header", "format1",
                                    "format2"])
def test_bad_page_is_never_served(tmp_path, damage):
    cache, pool, alloc = make_tiered(storage_dir=str(tmp_path))
    put(cache, pool, alloc, SEQ)
    cache.storage.flush()
    _down_to_storage(cache)
    assert len(list(tmp_path.rglob("*.kv"))) == 3
    # the pages by key (several writer threads: their files' mtimes need not follow the pages)
    files = [(None, cache.storage.path(k)) for k in cache._keys(tuple(SEQ), 3)]
    second = files[1][1]  # the middle page: tokens [7, 8]
    data = open(second, "rb").read()
    if damage == "flip":
        data = data[:-3] + bytes([data[-3] ^ 1]) + data[-2:]
    elif damage == "truncate":
        data = data[:-4]
    elif damage == "empty":
        data = b""
    elif damage == "foreign":  # a valid page of another key copied into place
        data = open(files[0][1], "rb").read()
    elif damage == "format1":  # a page of the BLAKE2b format: another layout, not served
        data = b"RLMKVPG1" + data[8:]
    elif damage == "format2":  # the layer-major payload of the old host layout: same length
        data = b"RLMKVPG2" + data[8:]
    else:
        data = b"NOTAPAGE" + data[8:]
    open(second, "wb").write(data)
    slots, node, details = admit(cache, alloc, SEQ)
    assert details["storage"] == 2  # only the page before the bad one
    assert cache.store_index_size() == 0  # the tree's index forgot the pages from there on
    expect_kv(pool, SEQ, slots)
    assert cache.storage.counters["pages_corrupt"] == 1 and not os.path.exists(second)
    cache.dec_lock_ref(node)
    cache.check_integrity()
    put(cache, pool, alloc, SEQ)  # recomputed: the page is written again
    cache.storage.flush()
    assert os.path.exists(second)


def test_full_disk_turns_writes_off_once(tmp_path, monkeypatch, caplog):
    store = FileStorage(str(tmp_path), "ns", 8)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    # the store's own `open` only: other threads of the test session keep the real one
    monkeypatch.setattr(file_backend, "open", full, raising=False)
    with caplog.at_level(logging.WARNING):
        assert store.put(b"a" * 32, b"x" * 8)
        store.flush()
        assert not store.writes_enabled
        assert not store.put(b"b" * 32, b"y" * 8)
        store.flush()
    monkeypatch.undo()
    assert sum("full" in r.message for r in caplog.records) == 1
    assert store.get(b"a" * 32) is None and not list(tmp_path.rglob("*.kv*"))
    store.close()


def test_prefetch_policies_wait_or_not(tmp_path):
    cache, pool, alloc = make_tiered(storage_dir=str(tmp_path))
    put(cache, pool, alloc, SEQ)
    _down_to_storage(cache)
    for policy, ready_in_flight in (("best_effort", True), ("wait_complete", False),
                                    ("timeout", False)):
        cache.prefetch_policy = policy
        op = cache.start_prefetch(SEQ)
        assert cache.prefetch_ready(op) == ready_in_flight  # its lookup has not run yet
        cache.reader.work(1 << 30)
        cache.apply_prefetch_news(release=True)
        cache.reader.work(1)  # one of its three pages has landed
        cache.apply_prefetch_news(release=True)
        assert op.landed == 1 and cache.prefetch_ready(op) == ready_in_flight
        cache.check_integrity()  # the landed page and the two in flight are held
        cache.reader.work(1 << 30)
        cache.apply_prefetch_news(release=True)
        assert op.done and cache.prefetch_ready(op)
        cache.cancel_prefetch(op)
    op = cache.start_prefetch(SEQ)
    op.deadline = 0.0  # timeout: past its deadline it goes with what it has
    assert cache.prefetch_ready(op)
    op = cache.start_prefetch(SEQ)
    token_bytes = cache.host.token_bytes
    cache._prefill_tps, cache._read_bps = 1000.0, 100.0 * token_bytes  # reads 10x slower
    assert cache.prefetch_ready(op) and cache.counters["storage_loads_skipped"] == 1
    cache._read_bps = 1e6 * token_bytes
    assert not cache.prefetch_ready(cache.start_prefetch(SEQ))  # reading pays: it waits
    cache.drain_prefetch()
    cache.check_integrity()
    assert cache.host_slots_held().numel() == 0


def test_flush_keeps_or_clears_the_store(tmp_path):
    cache, pool, alloc = make_tiered(storage_dir=str(tmp_path))
    put(cache, pool, alloc, SEQ)
    cache.reset()
    alloc.clear()
    assert cache.total_size() == cache.host_size() == 0
    assert prefetch_all(cache, SEQ).found == 3
    cache.drain_prefetch()
    cache.clear_storage()
    assert prefetch_all(cache, SEQ).found == 0 and not list(tmp_path.rglob("*.kv"))
    cache.check_integrity()


def _args(**kw):
    base = dict(disable_radix_cache=False, tp_size=1, hicache_write_policy="write_through",
                hicache_size=0.0, hicache_ratio=2.0, hicache_storage_backend=None,
                hicache_storage_backend_extra_config=None)
    return SimpleNamespace(**{**base, **kw})


@pytest.mark.parametrize("kw,field", [
    (dict(hicache_ratio=1.0), "hicache_ratio"), (dict(hicache_ratio=-1), "hicache_ratio"),
    (dict(hicache_size=0.000001), "hicache_size"), (dict(hicache_size=-2), "hicache_size"),
    (dict(hicache_write_policy="write_sometimes"), "hicache_write_policy"),
    (dict(hicache_storage_backend="mooncake"), "hicache_storage_backend"),
    (dict(hicache_storage_backend="file", hicache_storage_backend_extra_config="{oops"),
     "hicache_storage_backend_extra_config"),
    (dict(hicache_storage_backend="file", hicache_storage_backend_extra_config='{"dir": 1}'),
     "hicache_storage_backend_extra_config"),
    (dict(hicache_storage_backend="file",
          hicache_storage_backend_extra_config='{"page_tokens": 0}'),
     "hicache_storage_backend_extra_config"),
    (dict(hicache_storage_backend="file", hicache_storage_prefetch_policy="eventually"),
     "hicache_storage_prefetch_policy"),
    (dict(hicache_storage_backend="file",
          hicache_storage_backend_extra_config='{"prefetch_timeout_base": -1}'),
     "prefetch_timeout_base"),
    (dict(hicache_storage_backend="file",
          hicache_storage_backend_extra_config='{"prefetch_threshold": 2.5}'),
     "prefetch_threshold"),
    (dict(hicache_storage_backend="file",
          hicache_storage_backend_extra_config='{"file_storage_max_gb": 0}'),
     "file_storage_max_gb"),
    (dict(disable_radix_cache=True), "enable_hierarchical_cache"),
    (dict(tp_size=2), "enable_hierarchical_cache")])
def test_bad_flags_name_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        HiCacheConfig.from_args(_args(**kw), device_capacity=1000, token_bytes=1000)


def test_storage_folder_from_config_env_or_default(monkeypatch):
    monkeypatch.delenv("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", raising=False)
    cfg = HiCacheConfig.from_args(_args(hicache_storage_backend="file"), 1000, 1000)
    assert cfg.storage_dir == "/tmp/hicache" and cfg.host_capacity == 2000
    monkeypatch.setenv("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", "/data/kv")
    assert HiCacheConfig.from_args(_args(hicache_storage_backend="file"), 1, 1).storage_dir == \
        "/data/kv"
    cfg = HiCacheConfig.from_args(_args(
        hicache_storage_backend="file", hicache_size=0.01,
        hicache_storage_backend_extra_config='{"file_storage_path": "/x", "page_tokens": 16}'),
        1000, 1000)
    assert (cfg.storage_dir, cfg.page_tokens, cfg.host_capacity) == ("/x", 16, 10000)
    assert cfg.prefetch_policy == "timeout" and dict(cfg.prefetch)["threshold"] is None
    cfg = HiCacheConfig.from_args(_args(
        hicache_storage_backend="file", hicache_storage_prefetch_policy="best_effort",
        hicache_storage_backend_extra_config='{"prefetch_threshold": 64, '
                                             '"prefetch_timeout_per_ki_token": 1}'), 1000, 1000)
    assert cfg.prefetch_policy == "best_effort"
    assert dict(cfg.prefetch)["threshold"] == 64
    assert dict(cfg.prefetch)["timeout_per_ki_token"] == 1.0


def test_device_eviction_keeps_locked_paths():
    cache, pool, alloc = make_tiered(capacity=8, host_capacity=12)
    put(cache, pool, alloc, [1, 2, 3, 4])
    slots, node, _ = admit(cache, alloc, [1, 2, 3, 4, 9])
    put(cache, pool, alloc, [7, 7, 7, 7])
    assert cache.evict(8) == 4  # only the unlocked sequence moves down
    assert torch.equal(node.value, slots) and cache.protected_size() == 4
    cache.dec_lock_ref(node)
    cache.check_integrity()
