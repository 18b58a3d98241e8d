"""Page writes (host -> storage) on a writer thread, so the scheduler's step only enqueues them.

What runs where:
- scheduler thread (`submit`): decides which pages of a path to write, pins their host slots and
  queues a `PageWriteJob`: a few tensor ops on slot indices, no KV bytes touched (a part of the
  range that has no host copy, only under write_back, is copied out of the device there, as
  before: those slots are not pinned and could be reused the moment the job is queued).
- writer thread: gathers each page's rows out of the host pool ((P, L, 2, H, D), one
  index_select of P slot rows, already the page's layout), hands them to the store (`batch_put`; the file store
  checksums and writes them on a thread of its own) and reports (job, pages accepted).
- scheduler thread again (`take_done`, at the start of a step): the completions unpin the slots,
  and only then does the cache mark the pages stored on the tree. The writer never touches the
  tree.

Pins are per host slot, not per node: a pending write holds its slots whatever happens to the
nodes that own them (split, demoted to storage-only, dropped, flushed). The cache frees host slots
through `hold_back`, which keeps the pinned ones out of the free list until their write lands; so
a slot is never reallocated (and overwritten) under a write that still reads it. Accounting:
    host allocator free + host tokens in the tree + held back (out of the tree, pinned) == capacity

Bounded: at most `queue_pages` pages are submitted and not yet taken back; past that the tail of a
job is dropped (counted by the cache as pages_write_dropped) and `submit` never blocks. A dropped
page is only a page not in the store: a later backup of the path, or a recompute, covers it.

`queue_pages == 0` writes on the caller's thread inside `submit` (the behaviour before this
module: the measured 0.22x on the H200), kept for comparison and for tests that want writes
settled at once.

CUDA: a backup's DMA into the host rows may still be in flight when its write is submitted; such
jobs wait in `_staged` until the cache has landed the backups queued before them and calls
`release`: at each step's start those whose backups have completed (`KVMover.land_ready`, no
wait: a batch chained with overlap may keep a forward in flight for a long time), or all, after
`KVMover.complete`, at a step with no forward of ours in flight.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
from dataclasses import dataclass
from typing import Optional

import torch

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class PageWriteJob:
    storage: object  # the store when submitted (a rekey swaps the cache's; a job keeps its own)
    keys: list  # page j covers absolute positions [lo + j*P, lo + (j+1)*P) of `tokens`
    tokens: tuple  # the path's tokens (at least up to the last page): to find its nodes again
    lo: int
    # the rows of [lo, lo + len(keys)*P) in order: host slots int64 (n,) or a KV block
    # (n, L, 2, H, D) already copied out of the device
    segments: list
    pinned: torch.Tensor  # the host slots among the segments, int64
    cancelled: bool = False  # set by the scheduler thread; the writer then skips the job


class PageWriter:
    def __init__(self, host, page_tokens: int, queue_pages: int):
        self.host, self.page, self.queue_pages = host, page_tokens, queue_pages
        self.pending_pages = 0  # submitted and not yet taken back (scheduler thread only)
        self.inflight_keys: set[bytes] = set()  # their keys: not stored yet, not to resubmit
        self.write_errors = 0
        self._outstanding: set[PageWriteJob] = set()
        self._pins = torch.zeros(host.capacity + 1, dtype=torch.int32)  # pending writes per slot
        self._held = torch.zeros(host.capacity + 1, dtype=torch.bool)  # freed by the tree, pinned
        # host rows not landed yet (CUDA backups): (job, backups queued when it was submitted)
        self._staged: list[tuple[PageWriteJob, int]] = []
        self._jobs: queue.Queue = queue.Queue()  # never full: the bound is pending_pages
        self._done: collections.deque = collections.deque()  # (job, accepted), writer -> scheduler
        self._running = threading.Event()  # cleared by `pause` (tests hold writes in flight)
        self._running.set()
        self._thread: Optional[threading.Thread] = None
        if queue_pages:
            self._thread = threading.Thread(target=self._loop, name="radixlm-hicache-pages",
                                            daemon=True)
            self._thread.start()

    @property
    def synchronous(self) -> bool:
        return self._thread is None

    def room(self) -> int:
        """Pages `submit` takes now (any number when writing synchronously)."""
        return (1 << 62) if self.synchronous else max(self.queue_pages - self.pending_pages, 0)

    # --- scheduler thread ------------------------------------------------------------------------
    def submit(self, job: PageWriteJob, rows_ready: bool, backups_queued: int = 0) -> None:
        """Queue a job of at most `room()` pages; `rows_ready`: its host rows hold their KV (no
        backup DMA may still be landing in them); else it waits for the first `backups_queued`
        backups to land (KVMover's count)."""
        assert len(job.keys) <= self.room(), (len(job.keys), self.room())
        self._pins.index_add_(0, job.pinned, torch.ones_like(job.pinned, dtype=torch.int32))
        self.pending_pages += len(job.keys)
        self.inflight_keys.update(job.keys)
        self._outstanding.add(job)
        if self.synchronous:
            self._done.append((job, self._write(job)))
        elif rows_ready and not self._staged:
            self._jobs.put(job)
        else:
            self._staged.append((job, backups_queued))

    def release(self, backups_landed: Optional[int] = None) -> None:
        """Hand the staged jobs to the writer thread, in order: all (the caller ran
        KVMover.complete), or those whose backups are among the first `backups_landed`."""
        n = 0
        for job, waits_for in self._staged:
            if backups_landed is not None and waits_for > backups_landed:
                break
            self._jobs.put(job)
            n += 1
        del self._staged[:n]

    def has_staged(self) -> bool:
        return bool(self._staged)

    def take_done(self) -> tuple[list[tuple[PageWriteJob, int]], torch.Tensor]:
        """The finished jobs since the last call, in submission order, with the pages each had
        accepted; and the held-back host slots their unpinning makes free (int64)."""
        done = []
        while self._done:
            done.append(self._done.popleft())
        freed = []
        for job, _ in done:
            slots = job.pinned
            self._pins.index_add_(0, slots, torch.full_like(slots, -1, dtype=torch.int32))
            now_free = slots[(self._pins[slots] == 0) & self._held[slots]]
            self._held[now_free] = False
            freed.append(now_free)
            self.pending_pages -= len(job.keys)
            self.inflight_keys.difference_update(job.keys)
            self._outstanding.discard(job)
        return done, torch.cat(freed) if freed else torch.empty(0, dtype=torch.int64)

    def hold_back(self, slots: torch.Tensor) -> torch.Tensor:
        """The tree lets go of host `slots`: returns those free now; the pinned ones are held back
        until their writes are taken back."""
        pinned = self._pins[slots] > 0
        if not bool(pinned.any()):
            return slots
        self._held[slots[pinned]] = True
        return slots[~pinned]

    def held_slots(self) -> torch.Tensor:
        """Host slots out of the tree, waiting for a write to finish reading them."""
        return torch.nonzero(self._held).flatten()

    def drain(self, cancel: bool = False) -> None:
        """Wait until every submitted job has finished (`cancel`: jobs not started are skipped and
        report 0 pages). Staged jobs must have been released. Completions stay to be taken."""
        assert not self._staged, "release() the staged jobs first"
        if cancel:
            for job in self._outstanding:
                job.cancelled = True
        self._running.set()
        self._jobs.join()

    def close(self) -> None:
        """Finish what is queued and stop the thread (take_done afterwards)."""
        self.release()
        self.drain()
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join()
            self._thread = None

    def pause(self) -> None:
        """Tests: the writer takes no new job until `resume` (or a drain)."""
        self._running.clear()

    def resume(self) -> None:
        self._running.set()

    # --- writer thread ---------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            try:
                if job is None:
                    return
                self._running.wait()
                self._done.append((job, self._write(job)))
            finally:
                self._jobs.task_done()

    def _write(self, job: PageWriteJob) -> int:
        if job.cancelled:
            return 0
        try:
            payloads = []
            for j in range(len(job.keys)):
                page = self._page_rows(job.segments, j * self.page, (j + 1) * self.page)
                # a bytes-like view, not .tobytes(): no second copy, and no GIL held for one
                payloads.append(memoryview(page.view(torch.uint8).reshape(-1).numpy()))
            return job.storage.batch_put(job.keys, payloads)
        except Exception as e:  # a store's bug must not kill the thread: those pages are lost
            self.write_errors += 1
            logger.warning("hicache: writing %d pages failed: %r", len(job.keys), e)
            return 0

    def _page_rows(self, segments: list, a: int, b: int) -> torch.Tensor:
        """Rows [a, b) of the job's range: (b - a, L, 2, H, D), contiguous."""
        parts, off = [], 0
        for seg in segments:
            n = seg.shape[0]
            lo, hi = max(a, off), min(b, off + n)
            if lo < hi:
                if seg.dim() == 1:  # host slots: gathered now, under their pins
                    parts.append(self.host.rows(seg[lo - off:hi - off]))
                else:
                    parts.append(seg[lo - off:hi - off])
            off += n
        return parts[0].contiguous() if len(parts) == 1 else torch.cat(parts)
