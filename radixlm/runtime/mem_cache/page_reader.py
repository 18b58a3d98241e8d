"""Storage prefetch (storage -> host) on a reader thread, so the scheduler never waits on a store.

A `PrefetchOp` follows one waiting request's prompt: the pages past what the tree holds on the
device or the host, by content key. It runs in two jobs on the reader thread:
  1. lookup: how many of the op's leading pages the store has (`exists`, which may be optimistic);
  2. read: the found pages, verified by the store, into host slots that the scheduler allocated
     for them between the two jobs (the host allocator is the scheduler's alone): a page whose
     slots are one run of host rows is read straight into them (`get_into`), a scattered one
     through `get` and a copy. A page that is missing, truncated, corrupt or foreign ends the
     read.
The thread reports through `news` (lookup results, each page landed, a read's end); the
scheduler applies them at the start of a step (tier_prefetch.py) and never blocks on a job.

Host slots of a read belong to its op until the scheduler hands them to the tree or back to the
allocator ("held": out of the tree, out of the free list). A cancelled op (abort, or the request
was admitted with part of its pages) stops at the next page; slots the reader may still be
writing stay held until its read ends.

With the thread, a read keeps up to READ_AHEAD pages in flight on a small pool of fetchers (a
store's read and check, straight into the host rows or through a copy: file reads, the CRC and
torch's copy all release the GIL), and lands them in order: one thread read ~1 GB/s, below the
rate an H200 prefills an 8B model's KV (~4 GB/s), so restarts recomputed what the store held.
(get + put_rows also crossed memory three times a page and faulted in a fresh page-sized buffer
for each: get_into reads into the rows once; benchmarks/probes/store_read.py measures both.)
The read rate a read reports is its bytes over its wall time, so the cache compares what the
store really delivers with what a prefill computes.

`threaded=False` (tests): no thread; `work(units)` runs queued jobs on the caller's thread, one
unit = one lookup or one page read, so a test decides exactly where each read stands.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass
from typing import Optional

import torch


logger = logging.getLogger(__name__)

# pages of one read in flight at once (threaded reader): half the cores, 4..16 (a 16-core H200
# host read ~4.6 GB/s with 4, about what its prefill computes for an 8B model)
READ_AHEAD = max(4, min(16, (os.cpu_count() or 8) // 2))
# a threaded read reports its landed pages in runs of this many tokens (or a quarter of the read
# if less; the last run at its end): each report makes the scheduler step (a landed run starts
# its copy to the device, scheduler/waiting.py), and page by page (~8 MB of an 8B model's KV)
# those steps held the GIL the fetcher threads need (a 16k-token restart read at ~50k tokens/s
# on an H200 host, then 70k once the loop stopped spinning as well, 2026-11-28)
LANDED_REPORT_TOKENS = 2048  # (the last run's in quarters: _read_ahead)


def landed_report_pages(op: "PrefetchOp") -> int:
    return max(1, min(LANDED_REPORT_TOKENS // op.page, op.page_count // 4))


@dataclass(eq=False)
class PrefetchOp:
    storage: object  # the store when started (a rekey swaps the cache's; the op keeps its own)
    tokens: tuple  # the prompt tokens its pages cover
    first: int  # absolute page index of keys[0]: page j covers [(first+j)*P, (first+j+1)*P)
    keys: list
    page: int  # tokens per page
    deadline: float  # time.monotonic() past which the `timeout` policy stops waiting
    found: Optional[int] = None  # leading pages the lookup found (None: lookup pending)
    slots: Optional[torch.Tensor] = None  # host slots int64 (n*P,), page j at [j*P, (j+1)*P)
    landed: int = 0  # leading pages verified and written into `slots`
    released: int = 0  # leading pages whose slots left the op (to the tree or freed)
    reading: bool = False  # a read job is queued or running
    staged: bool = False  # slots allocated, read waits for the host rows (CUDA backups)
    staged_after: int = 0  # ... of the first this many backups (KVMover.backups_queued)
    done: bool = False  # nothing more will land
    cancelled: bool = False  # set by the scheduler; the reader stops at the next page
    # compute the head, read the tail (mem_cache/head_split.py): `may_split` the request may
    # (the scheduler's choice at queueing); `head_end` > 0: it does, computing tokens up to
    # head_end (= first * page: the op reads from there) before its pages join the tree
    may_split: bool = False
    head_end: int = 0
    head_done: bool = False  # the head is computed and in the tree (the request waits again)
    probe: bool = False  # a read only to measure the store (tier_prefetch.probe_read_rate)

    @property
    def head_pending(self) -> bool:
        """Split, its head not yet computed: the request goes now to compute it, and the
        pages read meanwhile cannot join the tree (nothing there to hang them below) yet."""
        return self.head_end > 0 and not self.head_done

    @property
    def page_count(self) -> int:
        return 0 if self.slots is None else self.slots.numel() // self.page

    @property
    def landed_end(self) -> int:
        """Absolute end of the landed pages (first * P when none)."""
        return (self.first + self.landed) * self.page

    @property
    def found_end(self) -> int:
        return (self.first + (self.found or 0)) * self.page


class PageReader:
    def __init__(self, host, page_tokens: int, threaded: bool = True, direct: bool = True):
        self.host, self.page = host, page_tokens
        # pages whose slots are one run are read straight into the host rows (`get_into`);
        # False: always get + put_rows (benchmarks/probes/store_read.py compares the two)
        self.direct = direct
        self.news: collections.deque = collections.deque()  # reader -> scheduler, in order
        # called (reader thread) after a lookup's or a read's end: an idle scheduler loop that
        # polls its inbox can wake at once instead of at its next poll (Engine sets it)
        self.notify = None
        self.read_errors = 0
        self._pool_bytes: Optional[memoryview] = None  # the host pool's memory, flat (_dests)
        self._jobs: queue.Queue = queue.Queue()  # bounded by the cache (lookups, read pages)
        self._current = None  # manual mode: the job `work` is in the middle of
        self._thread: Optional[threading.Thread] = None
        self._fetchers: Optional[concurrent.futures.ThreadPoolExecutor] = None
        if threaded:
            self._fetchers = concurrent.futures.ThreadPoolExecutor(
                READ_AHEAD, thread_name_prefix="radixlm-hicache-fetch")
            self._thread = threading.Thread(target=self._loop, name="radixlm-hicache-prefetch",
                                            daemon=True)
            self._thread.start()

    # --- scheduler thread ------------------------------------------------------------------------
    def lookup(self, op: PrefetchOp) -> None:
        self._jobs.put(_Job("lookup", op))

    def read(self, op: PrefetchOp) -> None:
        """Read op.slots' pages (op.slots set, op.reading set by the caller)."""
        self._jobs.put(_Job("read", op))

    def drain(self) -> None:
        """Wait until every queued job has ended (cancel the ops first to make it quick)."""
        if self._thread is None:
            while self.work(1 << 30):
                pass
        else:
            self._jobs.join()

    def close(self) -> None:
        self.drain()
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join()
            self._thread = None
            self._fetchers.shutdown()

    def work(self, units: int) -> int:
        """Manual mode: run up to `units` units of queued work here. Returns the units run."""
        assert self._thread is None, "work() is for a reader without a thread"
        ran = 0
        while ran < units:
            if self._current is None:
                try:
                    self._current = self._jobs.get_nowait()
                except queue.Empty:
                    break
            ran += 1
            if self._unit(self._current):
                self._current = None
                self._jobs.task_done()
        return ran

    # --- reader thread ---------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            try:
                if job is None:
                    return
                if job.kind == "read":
                    self._read_ahead(job)
                else:
                    while not self._unit(job):
                        pass
            except Exception as e:  # a store's bug must not kill the thread: recomputed instead
                self.read_errors += 1
                logger.warning("hicache: prefetch from storage failed: %r", e)
                self.news.append(("read_end", job.op, 0.0, 0) if job.kind == "read"
                                 else ("found", job.op, 0))
            finally:
                self._jobs.task_done()

    def _unit(self, job: "_Job") -> bool:
        """One lookup, or one page of a read. True when the job has ended (its news posted)."""
        op = job.op
        if job.kind == "lookup":
            n = 0
            if not op.cancelled:
                for key in op.keys:  # exists is cheap (a stat, a set lookup): one unit in all
                    if not op.storage.exists(key):
                        break
                    n += 1
            self.news.append(("found", op, n))
            self._wake()
            return True
        j = job.next
        if op.cancelled or j >= op.page_count:
            self.news.append(("read_end", op, job.seconds, job.bytes))
            self._wake()
            return True
        t0 = time.perf_counter()
        nbytes = self._fetch(op, j, self._dests(job))
        job.seconds += time.perf_counter() - t0
        if nbytes is None:  # missing or failed its checks: never served, recomputed
            self.news.append(("read_end", op, job.seconds, job.bytes))
            self._wake()
            return True
        job.bytes += nbytes
        job.next = j + 1
        self.news.append(("landed", op, j + 1))
        return False

    def _fetch(self, op: PrefetchOp, j: int, dests: list) -> Optional[int]:
        """Page j of op from its store into the op's host slots; its bytes, or None (missing or
        bad). Any thread: the op's slots are its own, page j's rows no other fetch's. dests:
        _dests' views, so a direct page costs its fetcher no torch call (each gives the GIL up
        and takes it back, a wait of up to the switch interval beside the scheduler)."""
        dest = dests[j]
        if dest is not None:
            # straight into the rows (the file store reads into them, then checks). A page that
            # fails leaves garbage there, never served: rows past `landed` belong to the op
            # alone (held: out of the tree and the free list) until the read's end frees them,
            # and only landed pages ever join the tree (tier_prefetch.py); a freed slot is
            # written (a backup, a later read) before anything reads it
            return len(dest) if op.storage.get_into(op.keys[j], dest) else None
        payload = op.storage.get(op.keys[j])
        if payload is None:
            return None
        page = decode_page(payload, self.host.block_shape(self.page), self.host.dtype)
        # (P, L, 2, H, D) into the op's own slots: no other thread reads or writes these rows
        self.host.put_rows(op.slots[j * self.page:(j + 1) * self.page], page)
        return len(payload)

    def _dests(self, job: "_Job") -> list:
        """Per page of the job's op: its host rows as one flat byte view (a slice of the pool's
        memory, pinned on CUDA) when its slots are one run of consecutive slots (a slot-major
        run is one contiguous block, the page's layout), else None (then get + put_rows).
        Computed once a job, in a few torch calls for all its pages."""
        if job.dests is None:
            op, page = job.op, self.page
            job.dests = [None] * op.page_count
            if self.direct and op.page_count:
                if self._pool_bytes is None:  # the whole pool, flat (rows are slot-major)
                    self._pool_bytes = memoryview(
                        self.host.kv.view(torch.uint8).view(-1).numpy()).cast("B")
                pages = op.slots[:op.page_count * page].view(-1, page)
                one_run = (pages - pages[:, :1] == torch.arange(page)).all(1).tolist()
                nbytes = page * self.host.token_bytes
                for j, first in enumerate(pages[:, 0].tolist()):
                    if one_run[j]:
                        lo = first * self.host.token_bytes
                        job.dests[j] = self._pool_bytes[lo:lo + nbytes]
        return job.dests

    def _read_ahead(self, job: "_Job") -> None:
        """A read job on the thread: pages fetched READ_AHEAD at a time, landed in order. Its end
        is posted only once no fetch is running, since the slots go back to the scheduler then."""
        op, t0, inflight = job.op, time.perf_counter(), collections.deque()
        run, reported, dests = landed_report_pages(op), job.next, self._dests(job)
        try:
            while True:
                while (len(inflight) < READ_AHEAD and not op.cancelled
                       and job.next + len(inflight) < op.page_count):
                    inflight.append(self._fetchers.submit(self._fetch, op,
                                                          job.next + len(inflight), dests))
                if not inflight:
                    break
                try:
                    nbytes = inflight.popleft().result()
                except Exception as e:  # a store's bug must not kill the thread: recomputed
                    self.read_errors += 1
                    logger.warning("hicache: prefetch from storage failed: %r", e)
                    break
                if nbytes is None or op.cancelled:
                    break
                job.bytes += nbytes
                job.next += 1
                # the read's last run in quarters: pages reported after the read's end are
                # copied to the device after it, on the request's way to its first token
                step = run if op.page_count - job.next >= run else max(1, run // 4)
                if job.next - reported >= step:
                    self.news.append(("landed", op, job.next))
                    reported = job.next
        finally:
            for f in inflight:  # a page past a missing one, or a cancelled read: not landed
                f.cancel()
            concurrent.futures.wait(inflight)
            if job.next > reported:  # (before the end: it releases what has not landed)
                self.news.append(("landed", op, job.next))
            self.news.append(("read_end", op, time.perf_counter() - t0, job.bytes))
            self._wake()


    def _wake(self) -> None:
        if self.notify is not None:
            self.notify()


class _Job:
    __slots__ = ("kind", "op", "next", "seconds", "bytes", "dests")

    def __init__(self, kind: str, op: PrefetchOp):
        self.kind, self.op, self.next, self.seconds, self.bytes = kind, op, 0, 0.0, 0
        self.dests: Optional[list] = None  # a read's page destinations (PageReader._dests)


def decode_page(payload, page_shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    """A page's bytes -> its (P, L, 2, H, D) tensor: a view of the payload when it is a bytearray
    (the file store reads into one), else of a private copy (torch views only writable buffers)."""
    buf = payload if isinstance(payload, bytearray) else bytearray(payload)
    return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).view(tuple(page_shape))
