"""Page writes on the writer thread (mem_cache/page_writer.py, tier_writes.py), on the tiny tiered
cache of hicache_helpers (page of 2 tokens): a full queue drops and counts without blocking;
host slots under a pending write survive the eviction of their node and are never reused before
it lands; a node records only confirmed pages, even after the tree changed under the write; the
store ends up byte for byte as with synchronous writes; close finishes pending writes, and a new
cache on the same folder finds them."""

from __future__ import annotations

import pathlib
import time

import pytest

from hicache_helpers import admit, expect_kv, make_tiered, put

SEQ = [5, 6, 7, 8, 9, 10]  # 3 pages


def _files(folder) -> dict:
    return {p.name: p.read_bytes() for p in pathlib.Path(folder).rglob("*.kv")}


@pytest.fixture
def paused(tmp_path):
    """An async cache whose writer holds every write until finish_writes."""
    cache, pool, alloc = make_tiered(storage_dir=str(tmp_path), write_queue_pages=4)
    cache.writer.pause()
    yield cache, pool, alloc
    cache.close()


def test_full_queue_drops_and_counts_without_blocking(paused):
    cache, pool, alloc = paused
    t0 = time.perf_counter()
    assert put(cache, pool, alloc, SEQ) and put(cache, pool, alloc, [1, 2, 3, 4])
    assert time.perf_counter() - t0 < 1.0  # the writer is paused: nothing waited for it
    # 3 pages of SEQ queued, the 4-page bound left room for 1 of [1, 2, 3, 4]'s 2
    assert cache.counters["pages_write_dropped"] == 1 and cache.writer.pending_pages == 4
    node = cache.match_prefix(SEQ)[1]
    assert node.storage_len == 0  # queued is not stored
    cache.check_integrity()
    cache.finish_writes()
    assert cache.counters["pages_stored"] == 4 and cache.writer.pending_pages == 0
    assert node.storage_len == 6 and cache.match_prefix([1, 2, 3, 4])[1].storage_len == 2
    cache.check_integrity()


def test_slots_under_a_pending_write_are_held_until_it_lands(paused):
    cache, pool, alloc = paused
    put(cache, pool, alloc, SEQ)
    cache.evict(16)
    cache.evict_host(24)  # not stored yet: the node goes, its 6 host slots stay held
    assert not cache.root.children and cache.host_slots_held().numel() == 6
    assert cache.host.allocator.available_size() == 24 - 6
    cache.check_integrity()
    # fill the host pool with other KV: the held slots are not handed out
    held = set(cache.host_slots_held().tolist())
    for first in range(100, 106):
        put(cache, pool, alloc, [first] + list(range(1, 6)))
        cache.evict(16)
        cache.check_integrity()
    in_tree = set()
    stack = [cache.root]
    while stack:
        n = stack.pop()
        stack.extend(n.children.values())
        if n is not cache.root and n.host_value is not None:
            in_tree |= set(n.host_value.tolist())
    assert not held & in_tree
    cache.finish_writes()
    assert cache.host_slots_held().numel() == 0
    cache.check_integrity()
    cache.evict(16)
    slots, _, details = admit(cache, alloc, SEQ + [1])
    assert details["storage"] == 6  # the pages were written from the held rows: right bytes
    expect_kv(pool, SEQ, slots)


def test_marks_follow_the_tree_after_a_split(paused):
    cache, pool, alloc = paused
    put(cache, pool, alloc, SEQ)
    put(cache, pool, alloc, SEQ[:3] + [99, 98])  # splits SEQ's node after 3 tokens
    cache.finish_writes()
    upper = cache.match_prefix(SEQ[:3])[1]
    lower = cache.match_prefix(SEQ)[1]
    assert (upper.storage_len, lower.storage_len) == (3, 3)  # pages [0, 6) of SEQ
    cache.check_integrity()


def test_same_store_as_synchronous_writes(tmp_path):
    seqs = [SEQ, SEQ[:4] + [1, 2], [3, 4, 5, 6, 7], SEQ + [11, 12]]
    stores = {}
    for queue in (0, 8):
        folder = tmp_path / f"q{queue}"
        cache, pool, alloc = make_tiered(storage_dir=str(folder), write_queue_pages=queue)
        for s in seqs:
            put(cache, pool, alloc, s)
            cache.settle_page_writes(release=True)
        cache.finish_writes()
        marks = sorted((n.start, n.key, n.storage_len) for n in _nodes(cache))
        cache.close()
        stores[queue] = (_files(folder), marks)
    assert stores[0][0] and stores[0] == stores[8]


def _nodes(cache):
    stack = list(cache.root.children.values())
    while stack:
        n = stack.pop()
        stack.extend(n.children.values())
        yield n


def test_close_finishes_pending_writes_for_the_next_process(paused, tmp_path):
    cache, pool, alloc = paused
    put(cache, pool, alloc, SEQ)
    thread = cache.writer._thread
    cache.close()  # the paused writer is drained, then stopped
    assert not thread.is_alive() and cache.host_slots_held().numel() == 0
    cache.check_integrity()
    assert len(_files(tmp_path)) == 3
    fresh, pool2, alloc2 = make_tiered(storage_dir=str(tmp_path), write_queue_pages=4)
    slots, _, details = admit(fresh, alloc2, SEQ + [1])
    assert details["storage"] == 6
    expect_kv(pool2, SEQ, slots)
    fresh.close()


def test_clear_storage_cancels_pending_writes(paused, tmp_path):
    cache, pool, alloc = paused
    put(cache, pool, alloc, SEQ)
    cache.clear_storage()
    assert cache.counters["pages_stored"] == 0 and not _files(tmp_path)
    assert cache.writer.pending_pages == 0 and cache.match_prefix(SEQ)[1].storage_len == 0
    cache.check_integrity()


def test_a_failing_store_loses_pages_not_the_thread(paused, monkeypatch):
    cache, pool, alloc = paused
    monkeypatch.setattr(cache.storage, "batch_put", lambda keys, payloads: 1 / 0)
    put(cache, pool, alloc, SEQ)
    cache.finish_writes()
    assert cache.writer.write_errors == 1 and cache.match_prefix(SEQ)[1].storage_len == 0
    assert cache.writer._thread.is_alive()
    cache.check_integrity()


def test_default_bound():
    from radixlm.runtime.mem_cache.tier_writes import default_write_queue_pages

    class Host:
        token_bytes, capacity = 128 << 10, 174_000  # Llama-3.1-8B bf16, the H200 run's pool

    assert default_write_queue_pages(Host, 64) == 128  # 1 GiB of 8 MiB pages
    Host.capacity = 1000
    assert default_write_queue_pages(Host, 64) == 3  # a quarter of the host pool


class _Copy:
    """A backup DMA's event (CUDA, faked): done when the test says; a wait on it is an error
    (a step with a forward in flight must not block on one)."""

    def __init__(self):
        self.done = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        raise AssertionError("waited for a backup with a forward in flight")


def test_staged_writes_start_once_their_backups_land_without_a_wait(tmp_path):
    """A page write submitted while a backup DMA may still write its host rows waits (staged);
    at a step's start with a forward in flight (`release=False`, the overlap schedule) it is
    handed to the writer as soon as the backups queued before it have completed, without a
    host sync. Before, only a step with nothing in flight released it: a batch that stayed
    chained held every write back."""
    cache, pool, alloc = make_tiered(storage_dir=str(tmp_path), write_queue_pages=8)
    try:
        mover = cache.mover
        copy = _Copy()
        mover._backups.append((None, None, copy))  # an earlier backup, still copying
        mover.backups_queued += 1
        assert put(cache, pool, alloc, SEQ)
        assert cache.writer.has_staged()
        cache.settle_page_writes(release=False)
        assert cache.writer.has_staged()  # its backup has not landed: no write, no wait
        copy.done = True
        cache.settle_page_writes(release=False)
        assert not cache.writer.has_staged() and mover.backups_landed == mover.backups_queued
        cache.finish_writes()
        assert cache.counters["pages_stored"] == 3
        cache.check_integrity()
    finally:
        cache.close()
