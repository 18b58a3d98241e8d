"""The file store's checksum: CRC-32, zlib-ng's when installed, else the standard library's.

Why CRC-32 and not a cryptographic hash: the check is against accidents (a crash's torn write, a
flipped byte, a file copied over another), and the key in the page's header catches a page put in
the wrong place. Format 1 used BLAKE2b-128, ~0.2-0.5 GB/s a thread: below the rate an H200 makes
and loads KV for an 8B model (one page of 64 tokens is 8 MiB), so the store dropped pages it
could not write in time and read slower than a prefill recomputes them. The standard library's
zlib computes CRC-32 at ~2-4 GB/s a thread (measured 3.8 GB/s on this project's CPU), which
bounds a thread's page reads below the page cache's copy rate (7-15 GB/s a thread there);
zlib-ng's (PyPI `zlib-ng`: the same CRC-32, its SIMD code) ran at ~50 GB/s there, so it is used
when installed. Both compute zlib's CRC-32, so files are the same either way, and both release
the GIL.

`crc32(data, value=0)` and `CRC_IMPL` ("zlib-ng" or "zlib") for Python; `crc32_address()` the
same function's address in its loaded library, for the native read (native_read.py)."""

from __future__ import annotations

import ctypes
import ctypes.util

try:  # the same CRC-32 as zlib's, ~10x faster; optional
    from zlib_ng.zlib_ng import crc32
    CRC_IMPL = "zlib-ng"
except ImportError:
    from zlib import crc32
    CRC_IMPL = "zlib"


def crc32_address() -> int:
    """The address of CRC_IMPL's C function (zlib-ng's module exports `zng_crc32`; zlib's is
    libz's `crc32`): both take (crc, buffer, length) and return the CRC-32."""
    if CRC_IMPL == "zlib-ng":
        import zlib_ng.zlib_ng as zng
        return ctypes.cast(ctypes.CDLL(zng.__file__).zng_crc32, ctypes.c_void_p).value
    libz = ctypes.util.find_library("z") or "libz.so.1"
    return ctypes.cast(ctypes.CDLL(libz).crc32, ctypes.c_void_p).value
