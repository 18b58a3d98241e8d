"""On a CUDA GPU, fp32: the hierarchical cache's device<->host copies (pinned host pool, the
transfer stream) and file store give the same greedy tokens as the plain engine when prefixes
come back from the host pool, from the store, and after a restart on the same store (through the
storage prefetch: the reader thread's CPU writes into the pinned pool, then the load's DMA); the
KV accounting holds after each run. Run with `pytest -m gpu tests/gpu`."""

from __future__ import annotations

import json

import pytest
import torch

pytestmark = pytest.mark.gpu

PAGE = 16
SP = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(3, 512, (120,), generator=gen).tolist() for _ in range(6)]


def _engine(path, **kw):
    import radixlm

    return radixlm.Engine(model_path=path, device="cuda", dtype="float32", skip_tokenizer_init=True,
                          context_length=1024, attention_backend="triton", **kw)


def _run(eng, prompts, order) -> tuple[dict, dict]:
    outs, details = {}, {}
    for i in order:
        out = eng.generate(input_ids=prompts[i], sampling_params=SP)
        outs[i] = out["output_ids"]
        details[i] = out["meta_info"].get("cached_tokens_details")
        eng.wait_idle()
        eng.check_integrity()
    return outs, details


def _reference(path, prompts) -> dict:
    plain = _engine(path, max_total_tokens=4096)
    try:
        return _run(plain, prompts, range(len(prompts)))[0]
    finally:
        plain.shutdown()


def _tiered(folder) -> dict:
    """Every stored page is worth a prefetch (SGLang's default threshold is 256 tokens), and a
    request waits for its pages (on a GPU the tiny model computes faster than the disk reads,
    so the default timeout policy would rightly recompute instead)."""
    extra = json.dumps({"file_storage_path": str(folder), "page_tokens": PAGE,
                        "prefetch_threshold": PAGE})
    return dict(max_total_tokens=300, enable_hicache=True, hicache_ratio=2.0,
                hicache_storage_backend="file", hicache_storage_backend_extra_config=extra,
                hicache_storage_prefetch_policy="wait_complete")


def test_tiers_on_cuda_match_the_plain_engine(tiny_llama_path, tmp_path):
    prompts = _prompts()
    ref = _reference(tiny_llama_path, prompts)
    tiered = _tiered(tmp_path)
    eng = _engine(tiny_llama_path, **tiered)
    try:
        first, _ = _run(eng, prompts, range(6))
        again, details = _run(eng, prompts, reversed(range(6)))
        stats = eng.get_stats()["hicache"]
    finally:
        eng.shutdown()  # queued pages reach the folder
    assert first == ref and again == ref
    assert sum(d["host"] for d in details.values()) > 0, details
    assert sum(d["storage"] for d in details.values()) > 0, details
    assert stats["bytes_host_to_device"] > 0 and stats["bytes_device_to_host"] > 0
    eng = _engine(tiny_llama_path, **tiered)  # a restart: empty device and host pools
    try:
        restarted, details = _run(eng, prompts, range(6))
    finally:
        eng.shutdown()
    assert restarted == ref
    assert all(d["storage"] > 0 for d in details.values()), details


def test_split_heads_after_a_restart_match_the_plain_engine(tiny_llama_path, tmp_path,
                                                            monkeypatch):
    """Compute the head, read the tail (mem_cache/head_split.py) on CUDA: the tail's pages
    stream to the device below the head while the request waits (preloads), its head's lock and
    its preload's hand over at admission; rates set so that every restart request splits."""
    from radixlm.runtime.mem_cache import head_split

    prompts = _prompts()
    ref = _reference(tiny_llama_path, prompts)
    tiered = _tiered(tmp_path)
    eng = _engine(tiny_llama_path, **tiered)
    try:
        _run(eng, prompts, range(6))
    finally:
        eng.shutdown()  # queued pages reach the folder
    monkeypatch.setattr(head_split, "MIN_HEAD_TOKENS", 1)
    eng = _engine(tiny_llama_path, **tiered)

    def half(cache):  # heads of half the pages found
        cache._head_tps = cache._prefill_tps = 1.0
        cache._read_bps = float(cache.host.token_bytes)

    try:
        outs, details = {}, {}
        for i in range(6):
            eng._call_in_loop(lambda: half(eng.scheduler.tree_cache))
            o, d = _run(eng, prompts, [i])
            outs.update(o)
            details.update(d)
        stats = eng.get_stats()["hicache"]
    finally:
        eng.shutdown()
    assert outs == ref
    assert stats["head_splits"] == 6, stats
    # the heads are computed, not hits (a random prompt may share a first token with another)
    assert all(d["storage"] > 0 and d["device"] < PAGE for d in details.values()), details


@pytest.mark.parametrize("layout", ["one_run", "many_runs", "scattered", "chunked"])
def test_mover_loads_and_backs_up_any_slot_layout(layout):
    """KVMover on CUDA, slot-major host pool: host rows -> device slots and back, bit for bit (bf16
    random bits, so NaN payloads too), for one run of host slots, 24 runs of 20 (the direct DMA
    path past MAX_DIRECT_RUNS), a random scatter (the CPU gather into pinned staging), and runs
    cut across staging chunks (chunks of 90 tokens: a load of 480 goes round the ring of staging
    buffers, each reused after its scatter); loads queued back to back (no wait between them),
    the compute stream waiting only for their events, and a backup of the first in between."""
    from radixlm.runtime.mem_cache import host_pool
    from radixlm.runtime.mem_cache.host_pool import HostKVPool
    from radixlm.runtime.mem_cache.kv_mover import KVMover
    from radixlm.runtime.mem_cache.kv_pool import KVPool

    dev = torch.device("cuda")
    pool = KVPool(2048, 3, 8, 64, torch.bfloat16, dev)  # 6 KiB a token: 20-token runs go by DMA
    host = HostKVPool(2048, pool, dev)
    mover = KVMover(pool, host, dev)
    if layout == "chunked":
        mover.chunk = 90  # cutting runs of 20 (at offsets 80..100, 180..200, ...)
    gen = torch.Generator().manual_seed(0)
    host.kv.view(torch.int16).copy_(torch.randint(-2**15, 2**15 - 1, host.kv.shape, generator=gen,
                                                  dtype=torch.int16))
    n = 480
    if layout == "one_run":
        host_idx = torch.arange(100, 100 + n)
    elif layout in ("many_runs", "chunked"):
        host_idx = torch.cat([torch.arange(s, s + 20) for s in range(1, 1 + 24 * 70, 70)])
        assert host_pool.direct_runs(host_idx, host.token_bytes) is not None
    else:
        host_idx = torch.randperm(2047, generator=gen)[:n] + 1
        assert host_pool.direct_runs(host_idx, host.token_bytes) is None
    expect = host.kv[host_idx].clone().view(torch.int16)  # (n, L, 2, H, D)
    dev_a = (torch.randperm(1000, generator=gen)[:n] + 1).to(dev)
    dev_b = (torch.randperm(1000, generator=gen)[:n] + 1001).to(dev)
    for slots in (dev_a, dev_b):  # the second queued right behind the first
        torch.cuda.current_stream().wait_event(mover.to_device(host_idx, slots))  # as load_back
    back = torch.arange(1, n + 1) + 1500 if layout != "scattered" else host_idx.flip(0)
    mover.to_host(dev_a, back)  # and a backup of the first into other host rows
    mover.complete()
    torch.cuda.synchronize()
    for layer in range(pool.num_layers):
        for slots in (dev_a, dev_b):
            assert torch.equal(pool.k_buffers[layer][slots].cpu().view(torch.int16),
                               expect[:, layer, 0])
            assert torch.equal(pool.v_buffers[layer][slots].cpu().view(torch.int16),
                               expect[:, layer, 1])
    assert torch.equal(host.kv[back].view(torch.int16), expect)


def test_a_load_dma_runs_beside_the_forwards_and_the_backups():
    """A load's DMA waits for neither the compute stream nor a backup queued before it (one
    that reads other host rows): with the compute stream busy for ~0.5 s and such a backup
    waiting for it, the load's DMA completes first; its scatter waits for the compute stream
    (evicted slots' readers), so the load's event does not. (With one copy stream for loads and
    backups, the DMA waited behind the backup, and so for the compute stream.)"""
    from radixlm.runtime.mem_cache.host_pool import HostKVPool
    from radixlm.runtime.mem_cache.kv_mover import KVMover
    from radixlm.runtime.mem_cache.kv_pool import KVPool

    dev = torch.device("cuda")
    pool = KVPool(2048, 3, 8, 64, torch.bfloat16, dev)
    host = HostKVPool(2048, pool, dev)
    mover = KVMover(pool, host, dev)
    host.kv.view(torch.int16).copy_(torch.randint(-2**15, 2**15 - 1, host.kv.shape,
                                                  dtype=torch.int16))
    host_idx, dev_idx = torch.arange(1, 257), torch.arange(300, 556, device=dev)
    mover.to_device(host_idx, dev_idx)  # warm-up: the ring's buffers are allocated
    torch.cuda.synchronize()
    compute = torch.cuda.current_stream()
    torch.cuda._sleep(1_000_000_000)  # ~0.5 s of a busy compute stream (clock cycles)
    busy = torch.cuda.Event()
    busy.record(compute)
    mover.to_host(torch.arange(1, 65, device=dev), torch.arange(1001, 1065))
    done = mover.to_device(host_idx, dev_idx)
    mover._direct_loads[-1].synchronize()  # the load's DMA has landed in the staging ring
    assert not busy.query(), "the DMA waited for the compute stream"
    assert not done.query(), "the scatter ran before the compute stream's queued work"
    torch.cuda.synchronize()
    for layer in range(pool.num_layers):
        assert torch.equal(pool.k_buffers[layer][dev_idx].cpu().view(torch.int16),
                           host.kv[host_idx, layer, 0].view(torch.int16))
