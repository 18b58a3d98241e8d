"""The file store's CRC-32 (file_backend.py says why CRC-32): zlib-ng's when installed (PyPI
`zlib-ng`: the same values, its SIMD code, ~10x faster), else the standard library's zlib. Both
compute zlib's CRC-32, so files are the same either way.

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
