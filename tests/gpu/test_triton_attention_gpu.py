"""On a CUDA GPU: the Triton attention kernels against a dense fp32 reference and against
TorchNativeAttention at Llama-3.1-8B attention shapes (32 query heads, 8 KV heads, head_dim 128,
lengths up to 4096, batch 64); decode captured in a CUDA graph and replayed on new data; a printed
(never asserted) micro-benchmark against torch_native.
Run: `pytest -q -s -m gpu tests/gpu/test_triton_attention_gpu.py` (-s shows the benchmark).

triton and the kernel modules are imported inside the tests: this module is collected on CPU
machines too, where triton must first be imported by the interpreter tests (TRITON_INTERPRET=1)."""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = pytest.mark.gpu

HQ, HKV, D = 32, 8, 128
SCALE = D ** -0.5
TOL = {torch.float32: 1e-4, torch.bfloat16: 1e-2, torch.float16: 5e-3}


@pytest.fixture(autouse=True)
def _compiled():
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("TRITON_INTERPRET=1: these tests are for the compiled kernels")


def make_pool(lens, shared, dtype, seed):
    """Random K/V for requests of `lens` tokens in scattered slots; every even request shares its
    first `shared` slots with request 0 (a radix-cache prefix; never a row's last token, which a
    decode writes: duplicate slots in one write would make the pool's contents racy). Request i
    is pool row 2*i+1. Returns (k_buf, v_buf, req_to_token, rows)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    ctx = max(lens) + 1
    n = sum(lens)
    perm = torch.randperm(n, generator=gen, device="cuda") + 1  # never slot 0 (scratch)
    r2t = torch.zeros(2 * len(lens) + 2, ctx, dtype=torch.int64, device="cuda")
    rows, at = [], 0
    for i, ln in enumerate(lens):
        r2t[2 * i + 1, :ln] = perm[at:at + ln]
        at += ln
        rows.append(2 * i + 1)
    for i in range(2, len(lens), 2):
        m = min(shared, lens[i] - 1, lens[0] - 1)
        r2t[rows[i], :m] = r2t[rows[0], :m]
    k = torch.randn(n + 1, HKV, D, generator=gen, device="cuda").to(dtype)
    v = torch.randn(n + 1, HKV, D, generator=gen, device="cuda").to(dtype)
    return k, v, r2t, torch.tensor(rows, device="cuda")


def dense(q, k_buf, v_buf, slots, causal_offset=None):
    """fp32 reference: q (n, Hq, D) over keys k_buf[slots]; query i sees keys j <= offset + i."""
    g = q.shape[1] // k_buf.shape[1]
    k = k_buf[slots].float().repeat_interleave(g, 1)
    v = v_buf[slots].float().repeat_interleave(g, 1)
    s = torch.einsum("qhd,khd->qhk", q.float(), k) * SCALE
    if causal_offset is not None:
        j = torch.arange(len(slots), device="cuda")
        ok = j[None, :] <= causal_offset + torch.arange(q.shape[0], device="cuda")[:, None]
        s = s.masked_fill(~ok[:, None, :], float("-inf"))
    lse = torch.logsumexp(s, -1)
    return torch.einsum("qhk,khd->qhd", torch.exp(s - lse[..., None]).nan_to_num(0.0), v), lse


def check_lse(lse, ref):
    assert torch.equal(torch.isinf(lse), torch.isinf(ref))
    fin = torch.isfinite(ref)
    torch.testing.assert_close(lse[fin], ref[fin], atol=1e-3, rtol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32],
                         ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("batch", [64, 3])
def test_decode_kernel(dtype, batch):
    from radixlm.runtime.attention.triton_decode import decode_attention

    gen = torch.Generator().manual_seed(batch)
    lens = [1, 7, 33, 130, 4096] + torch.randint(1, 4097, (batch,), generator=gen).tolist()
    lens = lens[:batch]
    k_buf, v_buf, r2t, rows = make_pool(lens, 1000, dtype, seed=0)
    q = torch.randn(batch, HQ, D, device="cuda").to(dtype)
    seq_lens = torch.tensor(lens, device="cuda")
    starts = torch.tensor([int(torch.randint(0, n + 1, (1,), generator=gen)) for n in lens],
                          device="cuda")  # some ranges empty
    for kv_start, splits in [(None, None), (starts, None), (starts, 7), (None, 1)]:
        out = torch.full_like(q, float("nan"))
        lse = torch.full((batch, HQ), float("nan"), device="cuda")
        decode_attention(q, k_buf, v_buf, r2t, rows, kv_start, seq_lens, SCALE, out, lse,
                         num_splits=splits)
        for i in range(batch):
            lo = 0 if kv_start is None else int(kv_start[i])
            ro, rl = dense(q[i:i + 1], k_buf, v_buf, r2t[rows[i], lo:lens[i]])
            torch.testing.assert_close(out[i].float(), ro[0], atol=TOL[dtype], rtol=TOL[dtype])
            check_lse(lse[i], rl[0])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("causal", [True, False])
def test_extend_kernel(dtype, causal):
    from radixlm.runtime.attention.triton_extend import extend_attention

    gen = torch.Generator().manual_seed(5)
    lens = [1200, 1100, 1, 4096, 77, 513, 2000, 16]
    k_buf, v_buf, r2t, rows = make_pool(lens, 1000, dtype, seed=1)
    n_q = [200, 1100, 1, 300, 77, 1, 999, 16]  # some full prefills, some extends of a prefix
    if causal:
        kv_start, kv_len = [0] * 8, list(lens)
    else:  # a slice of each row; queries are unrelated to it (shared-prefix attention)
        kv_start = [int(torch.randint(0, n + 1, (1,), generator=gen)) for n in lens]
        kv_len = [n - s for n, s in zip(lens, kv_start)]
    indptr = torch.tensor([0] + n_q, device="cuda").cumsum(0)
    q = torch.randn(int(indptr[-1]), HQ, D, device="cuda").to(dtype)
    out = torch.full_like(q, float("nan"))
    lse = torch.full(q.shape[:2], float("nan"), device="cuda")
    extend_attention(q, k_buf, v_buf, r2t, rows, indptr, torch.tensor(kv_start, device="cuda"),
                     torch.tensor(kv_len, device="cuda"), causal, SCALE, out, lse,
                     max_q_len=max(n_q))
    for s in range(len(lens)):
        a, e = int(indptr[s]), int(indptr[s + 1])
        slots = r2t[rows[s], kv_start[s]:kv_start[s] + kv_len[s]]
        ro, rl = dense(q[a:e], k_buf, v_buf, slots, kv_len[s] - n_q[s] if causal else None)
        torch.testing.assert_close(out[a:e].float(), ro, atol=TOL[dtype], rtol=TOL[dtype])
        check_lse(lse[a:e], rl)


def _pool(lens, dtype, seed):
    from radixlm.runtime.mem_cache.kv_pool import KVPool

    k, v, r2t, rows = make_pool(lens, 1000, dtype, seed)
    pool = KVPool(k.shape[0] - 1, 1, HKV, D, dtype, "cuda")
    pool.k_buffers[0], pool.v_buffers[0] = k, v
    return pool, r2t, rows


def _decode_fb(rows, lens, loc, cpu_lens=True):
    from radixlm.runtime.executor.forward_batch import ForwardBatch, ForwardMode

    b = rows.shape[0]
    z = torch.zeros(b, dtype=torch.int64, device="cuda")
    return ForwardBatch(mode=ForwardMode.DECODE, input_ids=z, positions=z, out_cache_loc=loc,
                        req_pool_indices=rows, seq_lens=lens, logits_indices=z,
                        seq_lens_cpu=lens.tolist() if cpu_lens else [])


def _run(backend, fb, qkv):
    backend.init_forward_metadata(fb)
    return backend.forward(*qkv, 0, fb)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_backend_matches_torch_native(dtype):
    """DECODE at batch 64 and EXTEND (prefixes, shared prefixes, a decode tail) through both
    backends."""
    from radixlm.runtime.attention.torch_native import TorchNativeAttention
    from radixlm.runtime.attention.triton_backend import TritonAttention
    from radixlm.runtime.executor.forward_batch import ForwardBatch, ForwardMode

    gen = torch.Generator().manual_seed(7)
    lens = torch.randint(1, 4097, (64,), generator=gen).tolist()
    pool, r2t, rows = _pool(lens, dtype, seed=2)
    backends = [cls(pool, r2t, SCALE, max_batch_size=64, max_context_len=r2t.shape[1])
                for cls in (TorchNativeAttention, TritonAttention)]
    seq_lens = torch.tensor(lens, device="cuda")
    loc = r2t[rows, seq_lens - 1]
    qkv = [torch.randn(64, h, D, device="cuda").to(dtype) for h in (HQ, HKV, HKV)]
    ref, out = [_run(b, _decode_fb(rows, seq_lens, loc), qkv) for b in backends]
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])

    # EXTEND: 6 requests with prefixes of 0..1000 tokens, 4 decode rows last. Even rows share
    # request 0's first (up to) 1000 slots and keep them as cached prefix: no slot written twice.
    want = [0, 1000, 1000, 3, 1000, 500] + [n - 1 for n in lens[6:10]]
    prefix = [min(p, n - 1) for p, n in zip(want, lens)]
    ext = [n - p for n, p in zip(lens[:10], prefix)]
    loc = torch.cat([r2t[rows[i], prefix[i]:lens[i]] for i in range(10)])
    t = loc.shape[0]
    qkv = [torch.randn(t, h, D, device="cuda").to(dtype) for h in (HQ, HKV, HKV)]
    z = torch.zeros(t, dtype=torch.int64, device="cuda")

    def fb():
        return ForwardBatch(mode=ForwardMode.EXTEND, input_ids=z, positions=z, out_cache_loc=loc,
                            req_pool_indices=rows[:10], seq_lens=seq_lens[:10], logits_indices=z,
                            seq_lens_cpu=lens[:10], extend_prefix_lens_cpu=prefix,
                            extend_lens_cpu=ext, num_decode_tail=4)

    ref, out = [_run(b, fb(), qkv) for b in backends]
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])


def test_decode_cuda_graph_replay():
    """Capture TritonAttention's decode (metadata + forward) once, then replay it on new rows,
    lengths, slots and q written into the same buffers: equals an eager torch_native run."""
    from radixlm.runtime.attention.torch_native import TorchNativeAttention
    from radixlm.runtime.attention.triton_backend import TritonAttention

    b, dtype = 4, torch.bfloat16  # small batch: several splits, so stage 2 is in the graph too
    lens = [4000, 17, 1500, 999, 3000, 1, 64, 2048]
    pool, r2t, rows = _pool(lens, dtype, seed=3)
    backend = TritonAttention(pool, r2t, SCALE, max_batch_size=8, max_context_len=r2t.shape[1])
    s_rows, s_lens = rows[:b].clone(), torch.tensor(lens[:b], device="cuda")
    s_loc = r2t[s_rows, s_lens - 1].clone()
    s_qkv = [torch.randn(b, h, D, device="cuda").to(dtype) for h in (HQ, HKV, HKV)]
    fb = _decode_fb(s_rows, s_lens, s_loc, cpu_lens=False)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up: compiles and allocates the persistent scratch
        backend.init_forward_metadata_for_graph(fb)
        backend.forward(*s_qkv, 0, fb)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        backend.init_forward_metadata_for_graph(fb)
        s_out = backend.forward(*s_qkv, 0, fb)

    new_rows, new_lens = rows[b:], torch.tensor(lens[b:], device="cuda")
    new_loc = r2t[new_rows, new_lens - 1]
    new_qkv = [torch.randn_like(x) for x in s_qkv]
    for dst, src in zip([s_rows, s_lens, s_loc, *s_qkv], [new_rows, new_lens, new_loc, *new_qkv]):
        dst.copy_(src)
    graph.replay()
    ref = _run(TorchNativeAttention(pool, r2t, SCALE), _decode_fb(new_rows, new_lens, new_loc),
               new_qkv)
    torch.testing.assert_close(s_out.float(), ref.float(), atol=1e-2, rtol=1e-2)


def _time_ms(fn, reps=50):
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


DECODE_SWEEP = [(64, 4, 2), (32, 4, 2), (32, 4, 3), (64, 8, 2), (128, 8, 2)]  # block_n, warps, st
EXTEND_SWEEP = [(128, 64, 8, 2), (128, 32, 8, 2), (64, 64, 4, 2), (64, 32, 4, 3), (128, 64, 4, 2)]


def test_benchmark_decode_and_extend():
    """Printed, not asserted: per-layer attention time in bf16 (metadata built outside the timed
    loop) of torch_native and the Triton backend, and the kernels under each tuning config."""
    from radixlm.runtime.attention.torch_native import TorchNativeAttention
    from radixlm.runtime.attention.triton_backend import TritonAttention
    from radixlm.runtime.attention.triton_decode import decode_attention
    from radixlm.runtime.attention.triton_extend import extend_attention
    from radixlm.runtime.executor.forward_batch import ForwardBatch, ForwardMode

    dtype = torch.bfloat16
    print(f"\n[decode] Hq={HQ} Hkv={HKV} D={D} bf16, ms per layer; GB/s = K/V bytes read / time")
    print(f"  sweep (block_n, warps, stages): {DECODE_SWEEP}")
    for b, n in [(1, 1024), (1, 4096), (16, 1024), (16, 4096), (64, 1024), (64, 4096)]:
        pool, r2t, rows = _pool([n] * b, dtype, seed=4)
        lens = torch.full((b,), n, device="cuda")
        loc = r2t[rows, lens - 1]
        qkv = [torch.randn(b, h, D, device="cuda").to(dtype) for h in (HQ, HKV, HKV)]
        times = []
        for cls in (TorchNativeAttention, TritonAttention):
            backend = cls(pool, r2t, SCALE, max_batch_size=64, max_context_len=r2t.shape[1])
            fb = _decode_fb(rows, lens, loc)
            backend.init_forward_metadata(fb)
            times.append(_time_ms(lambda: backend.forward(*qkv, 0, fb)))
        k_buf, v_buf = pool.k_buffers[0], pool.v_buffers[0]
        out = torch.empty_like(qkv[0])
        sweep = [_time_ms(lambda: decode_attention(qkv[0], k_buf, v_buf, r2t, rows, None, lens,
                                                   SCALE, out, block_n=bn, num_warps=w,
                                                   num_stages=st))
                 for bn, w, st in DECODE_SWEEP]
        gbs = 2 * b * n * HKV * D * 2 / (times[1] * 1e-3) / 1e9
        print(f"  B={b:3d} len={n:5d}: torch_native {times[0]:8.3f}  triton {times[1]:7.3f} "
              f"({gbs:5.0f} GB/s, {times[0] / times[1]:5.1f}x)  kernel sweep "
              + " ".join(f"{t:.3f}" for t in sweep))
    print(f"[extend] causal prefill, no prefix, ms per layer; sweep (BM, BN, warps, stages): "
          f"{EXTEND_SWEEP}")
    for s, n in [(1, 4096), (8, 1024), (32, 512)]:
        pool, r2t, rows = _pool([n] * s, dtype, seed=5)
        loc = r2t[rows, :n].reshape(-1)
        z = torch.zeros(s * n, dtype=torch.int64, device="cuda")
        qkv = [torch.randn(s * n, h, D, device="cuda").to(dtype) for h in (HQ, HKV, HKV)]
        times = []
        for cls in (TorchNativeAttention, TritonAttention):
            backend = cls(pool, r2t, SCALE, max_batch_size=64, max_context_len=r2t.shape[1])
            fb = ForwardBatch(mode=ForwardMode.EXTEND, input_ids=z, positions=z, out_cache_loc=loc,
                              req_pool_indices=rows, seq_lens=torch.full((s,), n, device="cuda"),
                              logits_indices=z, seq_lens_cpu=[n] * s,
                              extend_prefix_lens_cpu=[0] * s, extend_lens_cpu=[n] * s)
            backend.init_forward_metadata(fb)
            times.append(_time_ms(lambda: backend.forward(*qkv, 0, fb), reps=10))
        meta = fb.attn_metadata  # the Triton backend's, from the last loop iteration
        out = torch.empty_like(qkv[0])
        sweep = [_time_ms(lambda: extend_attention(
                     qkv[0], pool.k_buffers[0], pool.v_buffers[0], r2t, rows, meta.qo_indptr,
                     meta.kv_start, meta.kv_len, True, SCALE, out, max_q_len=n, config=cfg),
                     reps=10) for cfg in EXTEND_SWEEP]
        tflops = 4 * s * n * n / 2 * HQ * D / (times[1] * 1e-3) / 1e12
        print(f"  {s:2d} x {n:5d} tokens: torch_native {times[0]:8.3f}  triton {times[1]:7.3f} "
              f"({tflops:4.0f} TFLOP/s, {times[0] / times[1]:5.1f}x)  kernel sweep "
              + " ".join(f"{t:.3f}" for t in sweep))
