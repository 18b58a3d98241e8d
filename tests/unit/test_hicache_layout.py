"""The slot-major host pool (mem_cache/host_pool.py): a run of host slots holds every layer's K and
V contiguously, and copies between it and the layer-major device pool keep every bit. Checked
with random bit patterns (NaN and denormal payloads included) in bf16 and fp32, several layers and
heads, for runs of slots that start and end anywhere (not aligned to store pages), a random
scatter, and the pages a store receives. The CUDA path (pinned pool, copy stream, chunked
staging) is tests/gpu/test_hicache_gpu.py's."""

from __future__ import annotations

import pytest
import torch

from radixlm.runtime.mem_cache import host_pool
from radixlm.runtime.mem_cache.host_pool import HostKVPool, contiguous_runs, split_runs
from radixlm.runtime.mem_cache.kv_mover import KVMover
from radixlm.runtime.mem_cache.kv_pool import KVPool, MLAKVPool
from radixlm.runtime.mem_cache.page_reader import decode_page
from radixlm.runtime.mem_cache.page_writer import PageWriteJob, PageWriter

CPU = torch.device("cpu")
L, H, D = 3, 2, 8


def _random_bits(shape, dtype, gen) -> torch.Tensor:
    """Every bit pattern of the dtype is possible (NaNs with payloads too): a copy that goes
    through arithmetic or a conversion would change some of them."""
    ints = {torch.bfloat16: torch.int16, torch.float32: torch.int32}[dtype]
    info = torch.iinfo(ints)
    return torch.randint(info.min, info.max, shape, generator=gen, dtype=ints).view(dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def _pools(dtype, capacity=200, host_capacity=300, seed=0):
    gen = torch.Generator().manual_seed(seed)
    pool = KVPool(capacity, L, H, D, dtype, CPU)
    pool.kv.copy_(_random_bits(pool.kv.shape, dtype, gen))
    host = HostKVPool(host_capacity, pool, CPU)
    return pool, host, KVMover(pool, host, CPU), gen


def _device_rows(pool, slots) -> torch.Tensor:
    """(n, L, 2, H, D) from the per-layer buffers the kernels use (not through slot_view)."""
    return torch.stack([torch.stack((pool.k_buffers[layer][slots], pool.v_buffers[layer][slots]),
                                    dim=1) for layer in range(pool.num_layers)], dim=1)


def _layouts(gen):
    """host slot layouts of a copy: one run, runs that start and end off any page boundary, a
    run of one slot, and a random scatter"""
    return {"one_run": torch.arange(17, 17 + 90),
            "unaligned_runs": torch.cat([torch.arange(3, 10), torch.arange(41, 74),
                                         torch.arange(120, 121), torch.arange(200, 249)]),
            "scattered": torch.randperm(300, generator=gen)[:90] + 1}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_runs_round_trip_bit_for_bit(dtype):
    pool, host, mover, gen = _pools(dtype)
    for name, host_idx in _layouts(gen).items():
        n = host_idx.numel()
        src = torch.randperm(200, generator=gen)[:n] + 1
        want = _device_rows(pool, src).clone()
        mover.to_host(src, host_idx)
        assert torch.equal(_bits(host.kv[host_idx]), _bits(want)), name
        # each host slot is one contiguous block of every layer's K and V
        first = int(host_idx[0])
        flat = host.kv.reshape(host.capacity + 1, -1)[first]
        assert torch.equal(_bits(flat), _bits(want[0].reshape(-1))), name
        dst = torch.randperm(200, generator=gen)[:n] + 1
        before = pool.kv.clone()
        mover.to_device(host_idx, dst)
        assert torch.equal(_bits(_device_rows(pool, dst)), _bits(want)), name
        untouched = torch.ones(201, dtype=torch.bool)
        untouched[dst] = False  # nothing but the destination slots changed
        assert torch.equal(_bits(pool.kv[:, :, untouched]), _bits(before[:, :, untouched])), name
    assert torch.equal(_bits(mover.read_device(src)), _bits(_device_rows(pool, src)))


def test_pool_buffers_are_views_of_one_slot_indexed_tensor():
    pool = KVPool(10, L, H, D, torch.float32, CPU)
    k = torch.arange(2 * H * D, dtype=torch.float32).view(2, H, D)
    pool.write(1, torch.tensor([4, 7]), k, -k)
    assert all(b.is_contiguous() for b in pool.k_buffers + pool.v_buffers)
    assert torch.equal(pool.slot_view()[[4, 7], 1, 0], k)
    assert torch.equal(pool.slot_view()[[4, 7], 1, 1], -k)
    assert float(pool.slot_view()[[4, 7]].abs().sum()) == 2 * float(k.abs().sum())


def test_pages_in_the_store_are_the_host_rows(tmp_path):
    """A page written from the host pool (and one copied out of the device, write_back's path)
    is its slots' rows (P, L, 2, H, D), bytes as the reader decodes them."""
    pool, host, mover, gen = _pools(torch.bfloat16)
    host_idx = torch.cat([torch.arange(5, 8), torch.arange(60, 66)])  # a page across two runs
    mover.to_host(torch.arange(1, 10), host_idx)

    class Store:
        page_bytes = 9 * host.token_bytes

        def __init__(self):
            self.pages = []

        def batch_put(self, keys, payloads):
            self.pages += [bytes(p) for p in payloads]
            return len(keys)

    store, writer = Store(), PageWriter(host, 9, 0)
    dev_rows = mover.read_device(torch.arange(10, 19))
    for segments in ([host_idx[:4], host_idx[4:]], [host_idx[:2], dev_rows[2:]]):
        pinned = torch.cat([s for s in segments if s.dim() == 1])
        writer.submit(PageWriteJob(store, [b"k"], (), 0, segments, pinned), rows_ready=True)
    page = decode_page(bytearray(store.pages[0]), host.block_shape(9), host.dtype)
    assert torch.equal(_bits(page), _bits(host.kv[host_idx]))
    mixed = decode_page(bytearray(store.pages[1]), host.block_shape(9), host.dtype)
    assert torch.equal(_bits(mixed[:2]), _bits(host.kv[host_idx[:2]]))
    assert torch.equal(_bits(mixed[2:]), _bits(_device_rows(pool, torch.arange(12, 19))))
    writer.take_done()


def test_which_copies_go_by_dma_and_how_chunks_cut_runs():
    tb = 1000  # bytes a token
    runs = [torch.arange(s, s + 10) for s in range(1, 400, 20)]  # 20 runs of 10 tokens
    idx = torch.cat(runs)
    assert host_pool.direct_runs(idx[:80], tb) is not None  # 8 runs: always direct
    assert host_pool.direct_runs(idx, tb) is None  # 10 KB a run: gathered first
    assert host_pool.direct_runs(idx, 64 << 10) is not None  # 640 KiB a run: DMA each
    got = contiguous_runs(idx, 100)
    assert got == [(10 * i, 1 + 20 * i, 10) for i in range(20)]
    # chunks [0, 15) and [15, 30): the second run is cut at offset 15
    assert split_runs(got, 0, 15) == [(0, 1, 10), (10, 21, 5)]
    assert split_runs(got, 15, 30) == [(0, 26, 5), (5, 41, 10)]
    pieces = [split_runs(got, lo, min(lo + 7, 200)) for lo in range(0, 200, 7)]
    rebuilt = torch.cat([torch.arange(f, f + n) for part in pieces for _, f, n in part])
    assert torch.equal(rebuilt, idx)


def test_the_host_pool_refuses_mla():
    pool = MLAKVPool(8, 2, 16, 4, torch.float32, CPU)
    with pytest.raises(ValueError, match="MLA"):
        HostKVPool(16, pool, CPU)


def test_rows_land_from_a_misaligned_buffer():
    """A store page read into a bytearray need not be 8-byte aligned: it lands by the dtype's own
    copy instead of as words, with the same bits."""
    pool, host, mover, gen = _pools(torch.bfloat16)
    want = _random_bits(host.block_shape(5), torch.bfloat16, gen)
    raw = bytearray(want.numel() * 2 + 2)
    block = torch.frombuffer(raw, dtype=torch.uint8)[2:].view(torch.bfloat16).view(want.shape)
    block.copy_(want)
    assert block.data_ptr() % 8 != 0
    idx = torch.tensor([9, 10, 11, 40, 2])
    host.put_rows(idx, block)
    assert torch.equal(_bits(host.rows(idx)), _bits(want))
    out = torch.frombuffer(bytearray(want.numel() * 2 + 2), dtype=torch.uint8)[2:]
    assert torch.equal(_bits(host.rows(idx, out=out.view(torch.bfloat16).view(want.shape))),
                       _bits(want))
    mover.to_device(idx, torch.arange(1, 6))
    assert torch.equal(_bits(_device_rows(pool, torch.arange(1, 6))), _bits(want))


class _FakeEvent:
    def record(self, stream=None):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True


class _FakeStream:
    def wait_stream(self, stream):
        pass

    def wait_event(self, event):
        pass


@pytest.mark.parametrize("chunked", [False, True])
def test_cuda_paths_move_the_right_rows(monkeypatch, chunked):
    """The CUDA branches of KVMover (DMA run by run, the pinned staging of a scattered copy,
    staging chunks that cut runs and reuse the ring's buffers) run here with streams and
    events faked:
    every copy is synchronous, so this checks which rows go where, not the streams' ordering
    (tests/gpu/test_hicache_gpu.py does that on a GPU)."""
    import contextlib

    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: _FakeStream())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _FakeStream())
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, s: None, raising=False)
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, pin_memory=False, **k: empty(*a, **k))
    pool, host, mover, gen = _pools(torch.bfloat16, capacity=400, host_capacity=400)
    mover.cuda = True
    mover.stream = mover.load_stream = mover.scatter_stream = _FakeStream()
    host.kv.copy_(_random_bits(host.kv.shape, torch.bfloat16, gen))
    if chunked:  # chunks of 25 tokens: a load of 90 goes through 4 ring buffers
        mover.chunk = 25
    for name, host_idx in _layouts(gen).items():
        n = host_idx.numel()
        want = host.kv[host_idx].clone()
        a = torch.randperm(200, generator=gen)[:n] + 1
        b = torch.randperm(200, generator=gen)[:n] + 201
        assert mover.to_device(host_idx, a) is not None, name  # the event to wait for
        mover.to_device(host_idx, b)
        back = host_idx.flip(0)  # a backup into the rows a load read (staged when scattered)
        mover.to_host(a, back)
        mover.complete()
        for slots in (a, b):
            assert torch.equal(_bits(_device_rows(pool, slots)), _bits(want)), name
        assert torch.equal(_bits(host.kv[back]), _bits(want)), name
