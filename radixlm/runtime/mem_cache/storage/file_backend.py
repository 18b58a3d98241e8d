"""The `file` storage backend: one file per page under DIR/<namespace>/<kk>/<key>.kv.

File layout (64-byte header, then the payload):
    magic b"RLMKVPG3" | key (32 bytes) | payload length (u64 LE) | CRC-32 of the payload (u32 LE,
    12 zero bytes) | payload
The payload is the page's KV as the host pool holds it (mem_cache/host_pool.py): slot-major,
(page tokens, layers, 2 [K, V], KV heads, head dim) in the KV dtype. Format 2 had the same header
and a layer-major payload (layers, 2, page tokens, heads, dim), the host pool's old layout.
A read (`get`, or `get_into` straight into the caller's buffer, the host pool's rows) checks
all four against what it asked for; a file that fails (truncated by a crash, bytes
flipped, a page of another key copied or renamed into place, another format) is reported missing,
deleted, and its tokens are recomputed: a bad page is never served.

The checksum is CRC-32 (checksum.py says why, and which implementation). Reads and writes
release the GIL, so the store's threads run in parallel; a read takes the GIL back ~8 times a
page in Python, once through the native reader (native_read.py, csrc/page_read.c: the same bytes
and checks), used whenever it builds. A format-1 or format-2 file reads as
"not a radixlm page file": removed and recomputed (its payload has the same length as a
format-3 one, so the magic is what tells them apart).

Writes run on WRITER_THREADS background threads of the store's own (pages come from the cache's
page writer thread, mem_cache/page_writer.py): each page goes to a temporary file in the same
folder and is renamed into place, so a reader never sees half a page. No fsync: a crash can leave a truncated or empty page, which the
checks above catch. A full disk (ENOSPC, EDQUOT) turns writes off for this process with one
warning; reads go on. Queued pages are served from memory until they are on disk. `max_bytes`
(the extra config's `file_storage_max_gb`) caps the folder: past it a write removes the least
recently written or read pages (storage/page_budget.py), so the store never fills its disk.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import queue
import shutil
import struct
import threading
from typing import Optional

from radixlm.runtime.mem_cache.storage import native_read
# (module names here: the reads look crc32 up at each call, so a probe may swap it)
from radixlm.runtime.mem_cache.storage.checksum import CRC_IMPL, crc32  # noqa: F401
from radixlm.runtime.mem_cache.storage.base import StorageBackend, byte_view
from radixlm.runtime.mem_cache.storage.page_budget import PageBudget, page_files

logger = logging.getLogger(__name__)

MAGIC = b"RLMKVPG3"
_HEADER = struct.Struct("<8s32sQ16s")
WRITER_THREADS = 4  # pages written at once: each thread's CRC + write runs without the GIL
# pages accepted and not yet on disk, held in memory: past this a put drops its page (the store
# misses it; a restart recomputes from there). 512 MiB (64 pages of an 8B model) until
# 2026-11-28: an H200 run writing 8 prompts of 16k tokens (~17 GB in 8 s) dropped 31-34 pages a
# run, which left holes in up to half the prompts that a warm restart then recomputed past
MAX_PENDING_BYTES = 2 << 30
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
# get_into's read(2) size. Each read(2) and each CRC call releases the GIL and takes it back,
# and a fetcher waits for it while another thread runs Python (the scheduler launching a
# forward: up to the 0.5 ms switch interval, runtime/gil_switch.py), so fewer calls a page read
# faster beside it: on this project's 2-core CPU (2 fetchers, a thread spinning in Python
# beside them, median of 5) 8 MiB pieces 2.4-2.7 GB/s against 0.85-0.9 with 1 MiB, alone
# 7.5-9.6 against 9.6-10; on an H100's 16-core host, alone (8 fetchers), a whole 8 MiB page
# then its CRC 14.9 GB/s against 15.6 for 1 MiB pieces CRC'd while in the core's L2 (256 KiB:
# 10.3). A restart's split request reads its tail while its head's forward is launched: on an
# H200 (8B, 16k-token prompts, one call) its tails read at 72-81k tokens/s with 8 MiB against
# 61-67k with 1 MiB, and the restart's TTFT p50 ratio was 3.31x and 3.23x against 3.00x
# (docs/hicache.md). 8 MiB: one read(2) for a page of an 8B model (64 tokens)
READ_CHUNK = 8 << 20


def _checksum_field(crc: int) -> bytes:
    """The header's 16-byte checksum field: CRC-32 (LE) padded with zeros."""
    return crc.to_bytes(4, "little") + bytes(12)


def _read_checked(f, dest: memoryview) -> tuple[int, int]:
    """Read f (unbuffered) into dest until it is full or the file ends: (bytes read, their
    CRC-32). In READ_CHUNK pieces, each CRC'd right after its read(2)."""
    got, crc = 0, 0
    while got < len(dest):
        n = f.readinto(dest[got:got + READ_CHUNK])
        if not n:
            break
        crc = crc32(dest[got:got + n], crc)
        got += n
    return got, crc


class FileStorage(StorageBackend):
    def __init__(self, root: str, namespace: str, page_bytes: int,
                 max_pending_bytes: int = MAX_PENDING_BYTES, max_bytes: Optional[int] = None):
        """max_bytes: the cap on this namespace's page files (None: until the disk is full)."""
        self.dir = os.path.join(root, namespace)
        os.makedirs(self.dir, exist_ok=True)
        self.page_bytes = page_bytes
        self.max_pending_bytes = max_pending_bytes
        # read through native_read's reader when it loads (tests set False for the Python read);
        # built or loaded here, so the first read of a restart does not wait for a compiler
        self.native = native_read.reader() is not None
        self.writes_enabled = True
        self._pending: dict[bytes, bytes] = {}  # accepted, not yet on disk
        self._pending_bytes = 0
        self._lock = threading.Lock()
        self._queue: queue.Queue = queue.Queue()
        self.counters = {"pages_written": 0, "pages_read": 0, "pages_corrupt": 0,
                         "pages_dropped": 0, "write_errors": 0, "pages_evicted": 0}
        self.max_pages = None if max_bytes is None else max(
            1, max_bytes // (_HEADER.size + page_bytes))
        # keys seen on disk, least recently used first (may go stale: get is the truth)
        self._known = PageBudget(self.max_pages)
        if self.max_pages is not None:  # what earlier runs left counts against the cap
            self._evict(self._known.scan(self.dir))
        self._writers = [threading.Thread(target=self._write_loop, daemon=True,
                                          name=f"radixlm-hicache-writer-{i}")
                         for i in range(WRITER_THREADS)]
        for t in self._writers:
            t.start()

    # --- reads -----------------------------------------------------------------------------------
    def path(self, key: bytes) -> str:
        hexkey = key.hex()
        return os.path.join(self.dir, hexkey[:2], hexkey + ".kv")

    def exists(self, key: bytes) -> bool:
        if key in self._pending or key in self._known:
            return True
        if os.path.exists(self.path(key)):
            self._evict(self._known.touch(key))  # (another process wrote it)
            return True
        return False

    def sample_keys(self, n: int) -> list[bytes]:
        """Up to n keys named by page files in the folder (the first found; not checked)."""
        keys = []
        for _, key in page_files(self.dir):
            if len(keys) >= n:
                break
            keys.append(key)
        return keys

    def get(self, key: bytes) -> Optional[bytes]:
        """A verified page's payload (a bytearray, so a reader can view it as a tensor without
        copying it again), or None: get_into into a fresh buffer."""
        payload = self._pending.get(key)
        if payload is not None:
            return payload
        buf = bytearray(self.page_bytes)
        return buf if self._read_into(key, memoryview(buf)) else None

    def get_into(self, key: bytes, out) -> bool:
        """get, read straight into `out` (header first, then the payload chunk by chunk, each
        chunk's CRC taken while it is still in the core's cache): no page-sized allocation, and
        the page crosses memory once on its way from the page cache, where get + a copy into the
        host rows crossed it three times and faulted in a fresh buffer for every page. On False
        `out` holds whatever the file had (or part of it): never to be used."""
        dest = byte_view(out, self.page_bytes)
        payload = self._pending.get(key)
        if payload is not None:  # queued, not on disk yet
            dest[:] = memoryview(payload).cast("B")
            return True
        return self._read_into(key, dest)

    def _read_into(self, key: bytes, dest: memoryview) -> bool:
        """The file of `key` into dest (page_bytes), checked: get_into's and get's read. Through
        the native reader (one call without the GIL, native_read.py) when it is available."""
        path = self.path(key)
        try:
            native = native_read.reader() if self.native else None
            if native is not None:
                header, got, crc = native.read(path, _HEADER.size, dest)
                problem = self._check_header(key, header)
                if problem is None:
                    problem = self._check_payload(header, got, crc)
            else:
                problem = self._read_python(key, path, dest)
        except FileNotFoundError:  # (evicted, perhaps by another process)
            self._known.discard(key)
            return False
        except OSError as e:
            logger.warning("hicache: reading %s failed (%s); recomputing those tokens", path, e)
            return False
        return self._verdict(key, path, problem)

    def _read_python(self, key: bytes, path: str, dest: memoryview) -> Optional[str]:
        """_read_into's read in Python: what is wrong with the file, or None."""
        # unbuffered: each readinto is one read(2) into `dest`, no copy through a buffer
        with open(path, "rb", buffering=0) as f:
            header = f.read(_HEADER.size)
            problem = self._check_header(key, header)
            if problem is None:  # (a bad header: not worth reading the payload)
                got, crc = _read_checked(f, dest)
                if got == len(dest) and f.read(1):  # the one byte more that get reads
                    got += 1
                problem = self._check_payload(header, got, crc)
        return problem

    def _check_header(self, key: bytes, header: bytes) -> Optional[str]:
        if len(header) < _HEADER.size:
            return "truncated header"
        magic, stored_key, length, _ = _HEADER.unpack(header)
        if magic != MAGIC:
            return "not a radixlm page file"
        if stored_key != key:
            return "a page of another key"
        if length != self.page_bytes:
            return f"payload length {length}, this layout's is {self.page_bytes}"
        return None

    def _check_payload(self, header: bytes, length: int, crc: int) -> Optional[str]:
        """A payload of `length` bytes (page_bytes + 1: longer than that) with CRC-32 `crc`
        against a header that passed _check_header."""
        if length != self.page_bytes:
            return f"payload of {length} bytes, the header says {self.page_bytes}"
        if _checksum_field(crc) != _HEADER.unpack(header)[3]:
            return "checksum mismatch"
        return None

    def _verdict(self, key: bytes, path: str, problem: Optional[str]) -> bool:
        """True for a good page (counted as read); else the file is counted, reported and
        removed (so the recomputed page can be written again)."""
        if problem is None:
            self._evict(self._known.touch(key))
            self._count("pages_read")
            return True
        self._count("pages_corrupt")
        logger.warning("hicache: ignoring %s (%s); its tokens are recomputed", path, problem)
        self._known.discard(key)
        try:
            os.remove(path)
        except OSError:
            pass
        return False

    # --- writes ----------------------------------------------------------------------------------
    def put(self, key: bytes, payload: bytes) -> bool:
        if len(payload) != self.page_bytes:
            raise ValueError(f"page payload is {len(payload)} bytes, expected {self.page_bytes}")
        if not self.writes_enabled:
            return False
        if key in self._pending or key in self._known:
            return True
        with self._lock:
            if self._pending_bytes + len(payload) > self.max_pending_bytes:
                self.counters["pages_dropped"] += 1  # the disk is slower than the KV we make
                return False
            self._pending[key] = payload
            self._pending_bytes += len(payload)
        self._queue.put(key)
        return True

    def _write_loop(self) -> None:
        while True:
            key = self._queue.get()
            try:
                if key is None:
                    return
                payload = self._pending.get(key)
                if payload is not None:
                    self._write(key, payload)
            finally:
                with self._lock:
                    payload = self._pending.pop(key, None) if key is not None else None
                    if payload is not None:
                        self._pending_bytes -= len(payload)
                self._queue.task_done()

    def _write(self, key: bytes, payload: bytes) -> None:
        path = self.path(key)
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(_HEADER.pack(MAGIC, key, len(payload),
                                     _checksum_field(crc32(payload))))
                f.write(payload)
            os.replace(tmp, path)
            self._count("pages_written")
            self._evict(self._known.touch(key))
        except OSError as e:
            try:
                os.remove(tmp)
            except OSError:
                pass
            self._count("write_errors")
            if e.errno in _DISK_FULL:
                if self.writes_enabled:
                    logger.warning("hicache: storage %s is full (%s); writes to it are off for this "
                                   "process, reads go on", self.dir, e)
                self.writes_enabled = False
            else:
                logger.warning("hicache: writing %s failed: %s", path, e)

    def _evict(self, keys: list) -> None:
        """Remove the files of pages the budget let go (least recently used past the cap)."""
        for key in keys:
            try:
                os.remove(self.path(key))
            except OSError:  # (gone already: removed by another process, or never complete)
                continue
            self._count("pages_evicted")

    def _count(self, name: str) -> None:
        with self._lock:  # several reader and writer threads count
            self.counters[name] += 1

    # --- metadata: DIR/<namespace>/<name>.json (not a page file: the page scan skips it) ---------
    def load_meta(self, name: str) -> Optional[dict]:
        try:
            with open(os.path.join(self.dir, f"{name}.json")) as f:
                doc = json.load(f)
        except (OSError, ValueError):  # none yet, or unreadable: as if none
            return None
        return doc if isinstance(doc, dict) else None

    def save_meta(self, name: str, doc: dict) -> None:
        """Written atomically (a temporary file renamed into place); a failure is only logged."""
        path = os.path.join(self.dir, f"{name}.json")
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            with open(tmp, "w") as f:
                json.dump(doc, f)
            os.replace(tmp, path)
        except OSError as e:
            logger.warning("hicache: writing %s failed: %s", path, e)
            try:
                os.remove(tmp)
            except OSError:
                pass

    # --- maintenance -----------------------------------------------------------------------------
    def flush(self) -> None:
        self._queue.join()

    def clear(self) -> None:
        with self._lock:  # queued pages are dropped, not written
            self._pending.clear()
            self._pending_bytes = 0
        self._queue.join()
        self._known.clear()
        shutil.rmtree(self.dir, ignore_errors=True)
        os.makedirs(self.dir, exist_ok=True)

    def close(self) -> None:
        alive = [t for t in self._writers if t.is_alive()]
        for _ in alive:
            self._queue.put(None)  # one stop sign a thread
        for t in alive:
            t.join()

    def stats(self) -> dict:
        return dict(self.counters, backend="file", dir=self.dir, writes_enabled=self.writes_enabled,
                    read_impl="native" if self.native else "python", crc=CRC_IMPL,
                    pending_bytes=self._pending_bytes, pages_known=len(self._known),
                    max_pages=self.max_pages)
