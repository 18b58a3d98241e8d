"""Store pages read straight into the host pool's rows (`StorageBackend.get_into`, the file store's
readinto, PageReader's direct path): pages land bit for bit (random bit patterns, NaN payloads
included) whether their slots are one run (read into the rows) or scattered (get + a copy), with
the reader's thread pool or without; a truncated, longer, flipped, foreign or other-format file
is refused by get_into exactly as by get (counted, removed) and never served through the cache;
a queued page not yet on disk is served from memory; a destination of the wrong size or kind is
refused with a clear error; the store's CRC-32 (zlib-ng's when installed) is zlib's. The file
store's reads run both ways: in Python and through the native reader (native_read.py)."""

from __future__ import annotations

import os
import threading
import zlib

import pytest
import torch

from hicache_helpers import admit, expect_kv, make_tiered, put
from radixlm.runtime.mem_cache.host_pool import HostKVPool
from radixlm.runtime.mem_cache.kv_pool import KVPool
from radixlm.runtime.mem_cache.page_reader import PageReader, PrefetchOp
from radixlm.runtime.mem_cache.storage import file_backend, native_read
from radixlm.runtime.mem_cache.storage.base import StorageBackend
from radixlm.runtime.mem_cache.storage.file_backend import FileStorage

CPU = torch.device("cpu")
P = 4  # tokens a page
SEQ = [5, 6, 7, 8, 9, 10]  # three pages of two tokens (make_tiered's page)


@pytest.fixture(params=["python", "native"])
def read_impl(request, monkeypatch):
    """Stores made in the test read in Python or through the native reader."""
    if request.param == "python":
        monkeypatch.setattr(native_read, "reader", lambda: None)
    elif native_read.reader() is None:
        pytest.skip("the native reader did not build here (its warning says why)")
    return request.param


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


def _host(capacity=64):
    host = HostKVPool(capacity, KVPool(8, 3, 2, 8, torch.bfloat16, CPU), CPU)
    host.kv.view(torch.int16).fill_(0x7FC1)  # (a NaN pattern: rows never written show up)
    return host


def _pages(host, n, seed=0) -> list[torch.Tensor]:
    """n random pages (P, L, 2, H, D), every bf16 bit pattern possible."""
    gen = torch.Generator().manual_seed(seed)
    shape = host.block_shape(P)
    return [torch.randint(-32768, 32767, shape, generator=gen, dtype=torch.int16)
            .view(torch.bfloat16) for _ in range(n)]


def _store(tmp_path, host, pages) -> tuple[FileStorage, list[bytes]]:
    store = FileStorage(str(tmp_path), "ns", P * host.token_bytes)
    keys = [bytes([i]) * 32 for i in range(len(pages))]
    for key, page in zip(keys, pages):
        assert store.put(key, page.view(torch.uint8).reshape(-1).numpy().tobytes())
    store.flush()
    return store, keys


def _read(reader, store, keys, slots) -> PrefetchOp:
    op = PrefetchOp(store, (), 0, keys, P, 0.0, found=len(keys), slots=slots, reading=True)
    reader.read(op)
    if reader._thread is None:
        reader.work(1 << 30)
    else:
        reader.drain()
    ends = [n for n in reader.news if n[0] == "read_end" and n[1] is op]
    op.landed = max([n[2] for n in reader.news if n[0] == "landed" and n[1] is op], default=0)
    assert len(ends) == 1
    return op


class _Spy:
    """Counts a store's calls of get and get_into (instance attributes shadow the methods)."""

    def __init__(self, store):
        self.calls = {"get": 0, "get_into": 0}
        for name in self.calls:
            real = getattr(store, name)

            def call(*args, _real=real, _name=name):
                self.calls[_name] += 1
                return _real(*args)

            setattr(store, name, call)


# scattered: every page's slots out of order or in two runs; mixed: pages 0 and 2 one run each,
# page 1 scattered
LAYOUTS = {"runs": list(range(1, 13)), "scattered": [2, 1, 3, 4, 8, 7, 6, 5, 20, 21, 30, 31],
           "mixed": [40, 41, 42, 43, 9, 11, 13, 15, 50, 51, 52, 53]}


@pytest.mark.parametrize("threaded", [False, True], ids=["manual", "thread-pool"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_pages_land_bit_for_bit(tmp_path, layout, threaded, read_impl):
    host = _host()
    pages = _pages(host, 3)
    store, keys = _store(tmp_path, host, pages)
    assert store.stats()["read_impl"] == read_impl
    spy = _Spy(store)
    reader = PageReader(host, P, threaded=threaded)
    slots = torch.tensor(LAYOUTS[layout])
    op = _read(reader, store, keys, slots)
    reader.close()
    assert op.landed == 3
    for j, page in enumerate(pages):
        assert torch.equal(_bits(host.kv[slots[j * P:(j + 1) * P]]), _bits(page)), j
    runs = {"runs": 3, "scattered": 0, "mixed": 2}[layout]
    assert spy.calls == {"get_into": runs, "get": 3 - runs}
    untouched = torch.ones(host.capacity + 1, dtype=torch.bool)
    untouched[slots] = False
    assert bool((_bits(host.kv[untouched]) == 0x7FC1).all())  # no other row written


def _damage(path, how, other_path) -> None:
    data = bytearray(open(path, "rb").read())
    if how == "flip_first":  # a byte of the first read chunk
        data[64 + 3] ^= 1
    elif how == "flip_last":
        data[-1] ^= 0x80
    elif how == "truncate":
        del data[-4:]
    elif how == "longer":
        data += b"\0"
    elif how == "empty":
        data = bytearray()
    elif how == "short_header":
        del data[40:]
    elif how == "foreign":
        data = bytearray(open(other_path, "rb").read())
    elif how == "format2":
        data[:8] = b"RLMKVPG2"
    open(path, "wb").write(bytes(data))


DAMAGES = ["flip_first", "flip_last", "truncate", "longer", "empty", "short_header", "foreign",
           "format2"]


@pytest.mark.parametrize("how", DAMAGES)
def test_get_into_refuses_what_get_refuses(tmp_path, monkeypatch, how, read_impl):
    # 40-byte reads: a page of 1536 bytes goes in many chunks, a flip in any of them counts
    monkeypatch.setattr(file_backend, "READ_CHUNK", 40)
    monkeypatch.setattr(native_read, "NATIVE_CHUNK", 40)
    host = _host()
    pages = _pages(host, 2)
    store, keys = _store(tmp_path, host, pages)
    assert store.stats()["read_impl"] == read_impl
    out = torch.zeros(store.page_bytes, dtype=torch.uint8)
    assert store.get_into(keys[1], out)
    assert torch.equal(out, pages[1].view(torch.uint8).reshape(-1))
    path = store.path(keys[1])
    _damage(path, how, store.path(keys[0]))
    saved = open(path, "rb").read()
    assert not store.get_into(keys[1], out)
    assert store.counters["pages_corrupt"] == 1 and not os.path.exists(path)
    open(path, "wb").write(saved)  # the same file through get: the same verdict
    assert store.get(keys[1]) is None and store.counters["pages_corrupt"] == 2
    assert not store.get_into(keys[1], out)  # gone: missing, not counted again
    assert store.counters["pages_corrupt"] == 2 and store.counters["pages_read"] == 1


@pytest.mark.parametrize("direct", [True, False])
def test_bad_page_is_never_served_by_either_path(tmp_path, direct, read_impl):
    cache, pool, alloc = make_tiered(storage_dir=str(tmp_path))
    cache.reader.direct = direct
    spy = _Spy(cache.storage)
    put(cache, pool, alloc, SEQ)
    cache.storage.flush()
    cache.evict(cache.allocator.capacity)
    cache.evict_host(cache.host.capacity)
    keys = cache._keys(tuple(SEQ), 3)
    _damage(cache.storage.path(keys[1]), "flip_last", None)
    slots, node, details = admit(cache, alloc, SEQ)
    assert details["storage"] == 2  # the page before the bad one; the bad one recomputed
    expect_kv(pool, SEQ, slots)
    assert spy.calls["get_into" if direct else "get"] == 2
    assert spy.calls["get" if direct else "get_into"] == 0
    assert cache.storage.counters["pages_corrupt"] == 1
    cache.dec_lock_ref(node)
    cache.check_integrity()


def test_queued_page_is_served_from_memory(tmp_path, monkeypatch):
    gate = threading.Event()
    real_write = FileStorage._write
    monkeypatch.setattr(FileStorage, "_write", lambda self, k, p: (gate.wait(), real_write(
        self, k, p)))
    host = _host()
    store = FileStorage(str(tmp_path), "ns", P * host.token_bytes)
    page = _pages(host, 1)[0]
    payload = memoryview(page.view(torch.uint8).reshape(-1).numpy())  # as the page writer puts
    assert store.put(b"k" * 32, payload)
    assert not os.path.exists(store.path(b"k" * 32))
    rows = host.kv[10:10 + P]
    assert store.get_into(b"k" * 32, rows)
    assert torch.equal(_bits(rows), _bits(page))
    gate.set()
    store.close()
    assert os.path.exists(store.path(b"k" * 32))


def test_a_destination_of_the_wrong_size_or_kind_is_refused(tmp_path):
    store = FileStorage(str(tmp_path), "ns", 16)
    assert store.put(b"k" * 32, bytes(range(16)))
    store.flush()
    for bad, why in ((torch.zeros(15, dtype=torch.uint8), "15 bytes, a page is 16"),
                     (torch.zeros(4, 8, dtype=torch.uint8)[:, :4], "contiguous"),
                     (bytes(16), "writable"), (torch.zeros(32, dtype=torch.uint8)[::2],
                                               "contiguous")):
        with pytest.raises(ValueError, match=why):
            store.get_into(b"k" * 32, bad)
    out = bytearray(16)  # any writable buffer of the right size
    assert store.get_into(b"k" * 32, out) and bytes(out) == bytes(range(16))
    words = torch.zeros(4, dtype=torch.float32)  # any dtype: its bytes
    assert store.get_into(b"k" * 32, words)
    assert bytes(words.view(torch.uint8).tolist()) == bytes(range(16))


class _DictStore(StorageBackend):
    """A minimal store with no get_into of its own: the interface's default serves it."""

    def __init__(self, page_bytes):
        self.page_bytes, self.pages = page_bytes, {}

    def exists(self, key):
        return key in self.pages

    def get(self, key):
        return self.pages.get(key)

    def put(self, key, payload):
        self.pages[key] = bytes(payload)
        return True

    def clear(self):
        self.pages.clear()


def test_default_get_into_is_get_and_a_copy():
    host = _host()
    store = _DictStore(P * host.token_bytes)
    pages = _pages(host, 2, seed=1)
    keys = [b"a" * 32, b"b" * 32]
    store.put(keys[0], pages[0].view(torch.uint8).reshape(-1).numpy())
    reader = PageReader(host, P, threaded=False)
    op = _read(reader, store, keys, torch.arange(1, 1 + 2 * P))
    assert op.landed == 1  # the second page is missing: the read ends there
    assert torch.equal(_bits(host.kv[1:1 + P]), _bits(pages[0]))
    with pytest.raises(ValueError, match="a page is"):
        store.get_into(keys[0], torch.zeros(3, dtype=torch.uint8))


def test_the_stores_crc_is_zlibs():
    """Files written with one CRC implementation are read with the other (zlib-ng or zlib): the
    values, chained over pieces as get_into computes them, must be zlib's."""
    data = os.urandom(3 << 20) + b"tail"
    assert file_backend.crc32(data) == zlib.crc32(data)
    view, crc = memoryview(data), 0
    for lo in range(0, len(data), 100_003):
        crc = file_backend.crc32(view[lo:lo + 100_003], crc)
    assert crc == zlib.crc32(data)
    assert file_backend.crc32(b"") == 0 and file_backend.crc32(b"a", 7) == zlib.crc32(b"a", 7)
