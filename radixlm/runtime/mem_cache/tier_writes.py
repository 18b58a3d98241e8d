"""HiRadixCache's downward copies: backups (device -> host) and page writes (host -> storage). A
mixin: the state is HiRadixCache's; the page writes themselves run on `PageWriter`'s thread.

Backup (`_backup`): a device node gets host slots and a copy of its KV (KVMover.to_host).
Page writes (`_write_pages`, after every backup when a store is configured): the path's pages
completed up to the node's end (full pages, aligned to absolute positions) that the store does
not hold and no pending write covers are queued, as many as the writer's bounded queue takes
(the rest are dropped and counted: `pages_write_dropped`). When a write lands, the scheduler
applies it at the start of a step (`apply_write_completions`): the held host slots are unpinned,
and the path's nodes, found again by its tokens, record the pages the store accepted
(storage_len), as long as each such node's stored part reaches the job's first page (storage_len
counts a node's *leading* stored tokens). So a node records only pages the store confirmed; a
page still in flight, dropped or refused is simply not counted, and a later lookup by key (or a
recompute) finds or rebuilds it.

Host slots leave the tree through `_free_host`: slots a pending write still reads are held back
(out of the tree, out of the free list) until it lands; `check_integrity` counts them.
"""

from __future__ import annotations

import time

import torch

from radixlm.runtime.mem_cache.page_writer import PageWriteJob, PageWriter
from radixlm.runtime.mem_cache.storage.keys import page_keys

# default bound of the write queue: this many bytes of pages, and at most this share of the host
# pool pinned by pending writes (pins keep host slots from being evicted and reused)
WRITE_QUEUE_BYTES = 1 << 30
WRITE_QUEUE_HOST_SHARE = 4


def default_write_queue_pages(host, page_tokens: int) -> int:
    page_bytes = page_tokens * host.token_bytes
    return max(1, min(WRITE_QUEUE_BYTES // page_bytes,
                      host.capacity // (WRITE_QUEUE_HOST_SHARE * page_tokens)))


class TierWrites:
    def _init_writes(self, write_queue_pages) -> None:
        self.writer = None
        if self.storage is not None:
            if write_queue_pages is None:
                write_queue_pages = default_write_queue_pages(self.host, self.page)
            self.writer = PageWriter(self.host, self.page, write_queue_pages)

    # --- backups ---------------------------------------------------------------------------------
    def _backup(self, node) -> bool:
        """Give a device node a host copy (and queue its completed pages). False: no host room."""
        n = len(node.key)
        host_slots = self._alloc_host(n)
        if host_slots is None:
            return False
        node.backup = self.mover.to_host(node.value, host_slots)
        node.host_value = host_slots
        self._host_tokens += n
        self.counters["bytes_device_to_host"] += n * self.host.token_bytes
        self._sync(node)
        self._sync(node.parent)
        if self.storage is not None:
            t0 = time.perf_counter()
            self._write_pages(node)
            self.counters["storage_write_scheduler_s"] += time.perf_counter() - t0
        return True

    def _free_host(self, slots: torch.Tensor) -> None:
        """The tree lets go of host slots (eviction, drops): pinned ones wait for their write."""
        if self.writer is not None:
            slots = self.writer.hold_back(slots)
        self.host.allocator.free(slots)

    def host_slots_held(self) -> torch.Tensor:
        """Host slots out of the tree and out of the free list (int64): those a pending page
        write still reads, and those a storage prefetch holds (tier_prefetch.py)."""
        held = self.prefetch_held_slots()
        if self.writer is None:
            return held
        return torch.cat((self.writer.held_slots(), held))

    # --- page writes -----------------------------------------------------------------------------
    def _write_pages(self, node) -> None:
        storage, writer, page = self.storage, self.writer, self.page
        if not getattr(storage, "writes_enabled", True):
            return
        end = (node.start + len(node.key)) // page * page
        if end == 0:
            return
        path = []
        x = node
        while x is not self.root:
            path.append(x)
            x = x.parent
        path.reverse()
        tokens = tuple(t for x in path for t in x.key)
        keys = page_keys(self.seed, tokens, page, end // page)
        # The path's stored pages: ask the store, not the nodes. A node's storage_len can come
        # from another path through it (its last page, when it ends mid-page, is a different page
        # on each branch), and another process may have written this path's pages.
        stored = storage.batch_exists(keys)
        self._mark_stored(path, stored * page)
        first = stored  # then skip the pages a pending write covers (or that exist past it)
        while first < len(keys) and (keys[first] in writer.inflight_keys
                                     or storage.exists(keys[first])):
            first += 1
        take = min(len(keys) - first, writer.room())
        self.counters["pages_write_dropped"] += len(keys) - first - take
        if take <= 0:
            return
        lo, hi = first * page, (first + take) * page
        segments, pinned = [], []
        for x in path:
            a, b = max(lo, x.start), min(hi, x.start + len(x.key))
            if a >= b:
                continue
            if x.host_value is not None:
                segments.append(x.host_value[a - x.start:b - x.start].clone())
                pinned.append(segments[-1])
            else:  # no host copy (write_back's ancestors): copied out now, nothing to pin
                segments.append(self.mover.read_device(x.value[a - x.start:b - x.start]))
        job = PageWriteJob(storage, keys[first:first + take], tokens, lo, segments,
                           torch.cat(pinned) if pinned else torch.empty(0, dtype=torch.int64))
        rows_ready = not self.mover.backups_in_flight()
        if writer.synchronous and not rows_ready:
            self.mover.complete()
            rows_ready = True
        writer.submit(job, rows_ready, self.mover.backups_queued)
        if writer.synchronous:
            self._apply_done()  # (timed by the caller)

    @staticmethod
    def _mark_stored(path: list, stored_to: int) -> None:
        """The path's tokens before stored_to lie in stored pages."""
        for x in path:
            if x.start >= stored_to:
                break
            x.storage_len = max(x.storage_len, min(len(x.key), stored_to - x.start))

    def apply_write_completions(self) -> None:
        """Scheduler thread: take the finished page writes, free the host slots they held back,
        and record the accepted pages on the nodes of their paths that still exist."""
        if self.writer is None:
            return
        t0 = time.perf_counter()
        self._apply_done()
        self.counters["storage_write_scheduler_s"] += time.perf_counter() - t0

    def _apply_done(self) -> None:
        done, freed = self.writer.take_done()
        if freed.numel():
            self.host.allocator.free(freed)
        for job, accepted in done:
            self.counters["pages_stored"] += accepted
            self.counters["bytes_host_to_storage"] += accepted * job.storage.page_bytes
            if accepted and job.storage is self.storage:
                self._mark_range_stored(job.tokens, job.lo, job.lo + accepted * self.page)

    def _mark_range_stored(self, tokens: tuple, lo: int, hi: int) -> None:
        """Positions [lo, hi) of `tokens` now lie in stored pages: extend the storage_len of each
        node of that path (walked from the root; it may have been split, cut short or dropped
        since) whose stored head already reaches lo."""
        node, pos = self.root, 0
        while pos < hi:
            child = node.children.get(tokens[pos])
            n = 0 if child is None else len(child.key)
            if child is None or tokens[pos:pos + n] != child.key:
                return  # the path is no longer in the tree past here
            if pos + n > lo and pos + child.storage_len >= lo:
                child.storage_len = max(child.storage_len, min(n, hi - pos))
            node, pos = child, pos + n

    def settle_page_writes(self, release: bool) -> None:
        """Start of a step: apply finished writes; hand the writes that waited for backups (CUDA)
        to the writer: with `release` (no forward of ours in flight) all, landing every backup;
        else those whose backups have completed (a step in flight: no wait, so that a batch that
        stays chained with overlap does not hold the writes back)."""
        if self.writer is None:
            return
        if self.writer.has_staged():
            if release:
                self.mover.complete()
                self.writer.release()
            else:
                self.writer.release(self.mover.land_ready())
        self.apply_write_completions()

    def finish_writes(self, cancel: bool = False) -> None:
        """Wait for every pending write (`cancel`: skip those not started) and apply them."""
        if self.writer is None:
            return
        if self.writer.has_staged():
            self.mover.complete()  # even to cancel: a released job may start before it is marked
            self.writer.release()
        self.writer.drain(cancel)
        self.apply_write_completions()

    def write_queue_stats(self) -> dict:
        w = self.writer
        if w is None:
            return {}
        return {"capacity_pages": w.queue_pages, "pending_pages": w.pending_pages,
                "held_host_tokens": int(w.held_slots().numel()), "write_errors": w.write_errors}

    # --- maintenance -----------------------------------------------------------------------------
    def clear_storage(self) -> None:
        """Delete every page of this model's namespace (flush_cache?storage=true); pending writes
        are cancelled first."""
        if self.storage is not None:
            self.finish_writes(cancel=True)
            self.storage.clear()
            self._key_memo.clear()

    def close(self) -> None:
        """Shutdown: prefetches stop, pending writes reach the store, the writer stops, the
        measured rates are kept in the store (tier_transfers `save_rates`), the store flushes."""
        if self.reader is not None:
            self.drain_prefetch()
            self.reader.close()
        if self.writer is not None:
            if self.writer.has_staged():
                self.mover.complete()
            self.writer.close()
            self.apply_write_completions()
        if self.storage is not None:
            self.save_rates()
            self.storage.close()
