"""The file store's page read without the GIL: csrc/page_read.c, built with the C compiler
(`cc -O2 -shared -fPIC`, ~0.1 s) on first use and called through ctypes.

Why: a page read in Python is ~8 calls that each release the GIL and take it back; beside a
scheduler thread running Python (launching a forward), every take-back can wait up to the switch
interval, and a restart's store read lagged the page cache by several times. ctypes releases
the GIL once for the whole page (open, header, payload in NATIVE_CHUNK read(2)s each CRC'd while
in cache, the byte past the end, close). benchmarks/probes/store_read.py on an H200's 16-core host
(8 fetchers): 24.9 GB/s against 20.9 for the Python read, beside a thread spinning in Python
(0.5 ms switch interval) 11.2 against 7.9; a warm restart's TTFT p50 ratio went from 3.05-3.31x
to 4.66x (docs/hicache.md).

The build lives in `$RADIXLM_KERNEL_CACHE/radixlm_page_read_<hash>/page_read.so` (the CPU
kernels' cache: attention/cpu_kernels.py), its name a hash of the source, the compiler and the
machine; each process compiles to a file of its own and renames it into place, so concurrent
builds need no lock. Without a compiler, on a failed build or with
`RADIXLM_DISABLE_NATIVE_READ=1`, `reader()` is None and file_backend reads in Python (the same
checks, the same results: tests run both), after one warning that says why.

The CRC-32 is the store's (checksum.py): zlib-ng's `zng_crc32` (its module exports it) or
zlib's `crc32` from libz, whichever the Python read uses, so a page's checksum is the same
either way.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import threading
from pathlib import Path
from typing import Optional

from radixlm.runtime.mem_cache.storage import checksum

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).resolve().parents[4] / "csrc" / "page_read.c"
CFLAGS = ("-O2", "-shared", "-fPIC")
# a payload's read(2) size: each piece is CRC'd right after its read, while still in the core's
# L2 (without the GIL a read(2) costs nothing extra; an H100 host read 15.6 GB/s in 1 MiB pieces
# against 14.9 for a whole page then its CRC, file_backend.READ_CHUNK's comment)
NATIVE_CHUNK = 1 << 20

_lock = threading.Lock()
_reader = None
_tried = False


class NativeReader:
    """read(path, header_len, dest) around the C function: one ctypes call a page."""

    def __init__(self, lib: ctypes.CDLL, crc_fn: int, crc_name: str):
        fn = lib.radixlm_read_page
        fn.restype = ctypes.c_int64
        fn.argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.c_int64,
                       ctypes.POINTER(ctypes.c_int64), ctypes.c_void_p, ctypes.c_int64,
                       ctypes.c_int64, ctypes.c_void_p, ctypes.POINTER(ctypes.c_uint32)]
        self._fn, self._crc_fn, self.crc_name = fn, crc_fn, crc_name

    def read(self, path: str, header_len: int, dest: memoryview) -> tuple[bytes, int, int]:
        """(the file's first header_len bytes (fewer: the file is shorter), the payload's length
        read into dest (len(dest) + 1: the file is longer), its CRC-32). Raises
        FileNotFoundError / OSError as open() and read() would."""
        header = ctypes.create_string_buffer(header_len)
        header_got, crc = ctypes.c_int64(), ctypes.c_uint32()
        addr = ctypes.addressof(ctypes.c_char.from_buffer(dest)) if len(dest) else None
        got = self._fn(os.fsencode(path), header, header_len, ctypes.byref(header_got), addr,
                       len(dest), NATIVE_CHUNK, self._crc_fn, ctypes.byref(crc))
        if got < 0:
            code = -got
            cls = FileNotFoundError if code == errno.ENOENT else OSError
            raise cls(code, os.strerror(code), path)
        return header.raw[:header_got.value], got, crc.value


def reader() -> Optional[NativeReader]:
    """The native reader, built and loaded on first use; None when unavailable (warned once)."""
    global _reader, _tried
    if _tried:
        return _reader
    with _lock:
        if not _tried:
            try:
                _reader = _load()
            except Exception as e:  # noqa: BLE001 - any failure means "read in Python"
                logger.warning("hicache: the file store reads pages in Python, slower beside a "
                               "busy scheduler (the native read is unavailable: %s)",
                               f"{type(e).__name__}: {e}"[:500])
            _tried = True
    return _reader


def reset() -> None:
    """Forget the loaded reader (tests: build again, or run without)."""
    global _reader, _tried
    with _lock:
        _reader, _tried = None, False


def _load() -> NativeReader:
    if os.environ.get("RADIXLM_DISABLE_NATIVE_READ") == "1":
        raise RuntimeError("disabled by RADIXLM_DISABLE_NATIVE_READ=1")
    from radixlm.runtime.attention.cpu_kernels import cache_root

    cc = os.environ.get("CC") or "cc"
    source = _SOURCE.read_bytes()
    h = hashlib.sha256(source)
    for part in (cc, *CFLAGS, platform.machine(), platform.system()):
        h.update(part.encode())
    folder = cache_root() / f"radixlm_page_read_{h.hexdigest()[:16]}"
    lib_path = folder / "page_read.so"
    if not lib_path.exists():
        if shutil.which(cc) is None:
            raise FileNotFoundError(f"no C compiler ({cc!r} not found; set CC)")
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f"page_read.{os.getpid()}.{threading.get_ident()}.so"
        run = subprocess.run([cc, *CFLAGS, "-o", str(tmp), str(_SOURCE)], capture_output=True,
                             text=True, timeout=120)
        if run.returncode != 0:
            tmp.unlink(missing_ok=True)
            raise RuntimeError(f"{cc} failed: {(run.stderr or run.stdout).strip()[:300]}")
        os.replace(tmp, lib_path)  # atomic: a reader never loads half a library
    return NativeReader(ctypes.CDLL(str(lib_path)), checksum.crc32_address(), checksum.CRC_IMPL)
