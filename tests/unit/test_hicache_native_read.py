"""The file store's native page read (storage/native_read.py, csrc/page_read.c): it builds into
the kernel cache and is reused from there; it reads what the Python read reads (header, payload,
length with the byte past the end, CRC-32 chained over its pieces); a missing file raises
FileNotFoundError and a folder OSError; without a compiler the store warns once and reads in
Python, with the same results."""

from __future__ import annotations

import errno
import logging
import zlib

import pytest
import torch

from radixlm.runtime.mem_cache.storage import file_backend, native_read
from radixlm.runtime.mem_cache.storage.file_backend import FileStorage


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """native_read with no reader loaded, building into a kernel cache of its own."""
    monkeypatch.setenv("RADIXLM_KERNEL_CACHE", str(tmp_path / "kernels"))
    native_read.reset()
    yield tmp_path
    native_read.reset()


def _reader():
    r = native_read.reader()
    if r is None:
        pytest.skip("the native reader did not build here (its warning says why)")
    return r


def test_builds_once_into_the_kernel_cache(fresh):
    _reader()
    built = list((fresh / "kernels").glob("radixlm_page_read_*/page_read.so"))
    assert len(built) == 1
    stamp = built[0].stat().st_mtime_ns
    native_read.reset()
    assert native_read.reader() is not None  # loaded from the cache, not compiled again
    assert built[0].stat().st_mtime_ns == stamp
    assert native_read.reader().crc_name == file_backend.CRC_IMPL


@pytest.mark.parametrize("payload_len", [0, 1, 39, 40, 41, 1000])
@pytest.mark.parametrize("file_extra", [-5, 0, 1, 7], ids=["short", "exact", "one_more", "longer"])
def test_reads_header_payload_length_and_crc(fresh, monkeypatch, payload_len, file_extra):
    monkeypatch.setattr(native_read, "NATIVE_CHUNK", 40)  # many pieces: the CRC chains
    data = bytes(range(256)) * 8
    header, body = data[:64], data[64:64 + max(0, payload_len + file_extra)]
    path = fresh / "page.kv"
    path.write_bytes(header + body)
    dest = bytearray(b"\xee" * payload_len)
    got_header, got, crc = _reader().read(str(path), 64, memoryview(dest))
    assert got_header == header
    expect = min(len(body), payload_len + 1)  # the Python read's length: + 1 when longer
    assert got == expect
    assert crc == zlib.crc32(body[:payload_len])
    assert bytes(dest[:min(len(body), payload_len)]) == body[:payload_len]


def test_short_header_reads_no_payload(fresh):
    path = fresh / "short.kv"
    path.write_bytes(b"x" * 30)
    dest = bytearray(b"\xee" * 16)
    header, got, crc = _reader().read(str(path), 64, memoryview(dest))
    assert header == b"x" * 30 and got == 0 and crc == 0 and dest == bytearray(b"\xee" * 16)


def test_errors_are_oserrors(fresh):
    r = _reader()
    with pytest.raises(FileNotFoundError):
        r.read(str(fresh / "missing.kv"), 64, memoryview(bytearray(8)))
    with pytest.raises(OSError) as err:
        r.read(str(fresh), 64, memoryview(bytearray(8)))  # a folder: read(2) fails
    assert err.value.errno == errno.EISDIR


def test_without_a_compiler_the_store_warns_once_and_reads_in_python(fresh, monkeypatch,
                                                                         caplog):
    monkeypatch.setenv("CC", str(fresh / "no-such-cc"))
    page = torch.arange(256, dtype=torch.uint8)
    with caplog.at_level(logging.WARNING):
        stores = [FileStorage(str(fresh / "store"), f"ns{i}", 256) for i in range(2)]
    warned = [r for r in caplog.records if "reads pages in Python" in r.getMessage()]
    assert len(warned) == 1 and "no C compiler" in warned[0].getMessage()
    store = stores[0]
    assert store.stats()["read_impl"] == "python"
    assert store.put(b"k" * 32, page.numpy().tobytes())
    store.flush()
    out = torch.zeros(256, dtype=torch.uint8)
    assert store.get_into(b"k" * 32, out) and torch.equal(out, page)
    for s in stores:
        s.close()


def test_disabled_by_the_environment(fresh, monkeypatch):
    monkeypatch.setenv("RADIXLM_DISABLE_NATIVE_READ", "1")
    assert native_read.reader() is None
