"""The C++ CPU attention kernels (csrc/cpu_attention.cpp) and the `cpu` backend.

Kernel level: decode and extend against a dense fp32 reference (GQA, odd lengths and head dims,
kv_start, causal and not, lse, key splits, rows that see no key), bf16 / fp16 / fp32 pools.
Backend level: `CpuAttention` against `TorchNativeAttention` on the batches the model runner
builds (decode; extend with cached prefixes shared in the pool; extend with a decode tail).
Engine level: SmolLM2 gives the same greedy tokens with attention_backend "cpu" and
"torch_native". Plus the fallback: one warning, torch_native, never silent.

The kernels are built once per machine (~30 s, cached under ~/.cache/radixlm/kernels; `make
install` prebuilds them). The module skips only when the build tools are missing (no C++
compiler, or no ninja); any other build failure fails the tests.
"""

from __future__ import annotations

import logging
import os
import shutil

import pytest
import torch

from radixlm.runtime.attention import cpu_kernels, registry
from radixlm.runtime.attention.cpu_backend import CpuAttention
from radixlm.runtime.attention.cpu_kernels import CpuKernelsUnavailable
from radixlm.runtime.attention.torch_native import TorchNativeAttention
from radixlm.runtime.executor.forward_batch import ForwardBatch, ForwardMode
from radixlm.runtime.mem_cache.kv_pool import KVPool

if os.environ.get("RADIXLM_DISABLE_CPU_KERNELS") == "1":
    pytest.skip("RADIXLM_DISABLE_CPU_KERNELS=1: the CPU kernels are disabled on purpose",
                allow_module_level=True)
try:
    OPS = cpu_kernels.load()
except CpuKernelsUnavailable as _e:
    if not shutil.which(os.environ.get("CXX", "c++")):
        pytest.skip(f"no C++ compiler, the CPU kernels cannot be built: {_e}",
                    allow_module_level=True)
    from torch.utils.cpp_extension import is_ninja_available
    if not is_ninja_available():
        pytest.skip(f"no ninja (torch.utils.cpp_extension needs it), the CPU kernels cannot be "
                    f"built: {_e}", allow_module_level=True)
    raise  # the tools exist: a build failure is a bug, not a skip

TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture
def threads(request):
    """`threads(n)` sets torch's (and the kernels') thread count for the test, then restores it."""
    prev = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(prev)


def make_pool(lens, hkv, d, dtype, gen, shared=0):
    """req_to_token rows for requests of `lens` tokens, slots scattered through the pool (never
    slot 0); request i is pool row 2*i+1, and every request's first `shared` slots are request
    0's (a radix-cache prefix). Returns k_buf, v_buf, req_to_token, rows."""
    ctx = max(lens) + 3
    r2t = torch.zeros(2 * len(lens) + 2, ctx, dtype=torch.int64)
    n = sum(lens)
    perm = torch.randperm(n, generator=gen) + 1
    rows, at = [], 0
    for i, ln in enumerate(lens):
        r2t[2 * i + 1, :ln] = perm[at:at + ln]
        at += ln
        rows.append(2 * i + 1)
    for i, ln in enumerate(lens[1:], 1):
        s = min(shared, ln, lens[0])
        r2t[rows[i], :s] = r2t[rows[0], :s]
    k = torch.randn(n + 1, hkv, d, generator=gen).to(dtype)
    v = torch.randn(n + 1, hkv, d, generator=gen).to(dtype)
    return k, v, r2t, torch.tensor(rows)


def dense(q, k_buf, v_buf, slots, scale, causal_offset=None):
    """q (n, Hq, D) against keys k_buf[slots], fp32; causal_offset c: query i sees keys j <= c + i.
    Returns out (n, Hq, D) (0 for a row that sees no key) and lse (n, Hq) (-inf there)."""
    g = q.shape[1] // k_buf.shape[1]
    k = k_buf[slots].float().repeat_interleave(g, 1)
    v = v_buf[slots].float().repeat_interleave(g, 1)
    s = torch.einsum("qhd,khd->qhk", q.float(), k) * scale
    if causal_offset is not None:
        ok = torch.arange(len(slots))[None, :] <= causal_offset + torch.arange(q.shape[0])[:, None]
        s = s.masked_fill(~ok[:, None, :], float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    return torch.einsum("qhk,khd->qhd", p, v), lse


def close(out, ref, dtype):
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])


def close_lse(lse, ref):
    assert torch.equal(torch.isinf(lse), torch.isinf(ref)), (lse, ref)
    fin = torch.isfinite(ref)
    torch.testing.assert_close(lse[fin], ref[fin], atol=1e-4, rtol=1e-5)


# (Hq, Hkv, D): SmolLM2 (group of 3, D 64); a group of 4 at D 32; MHA with an odd D (vector tail)
SHAPES = [(9, 3, 64), (8, 2, 32), (3, 3, 20)]
SHAPE_IDS = ["gqa3-d64", "gqa4-d32", "mha-d20"]


@pytest.mark.parametrize("dtype", DTYPES + [torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("hq, hkv, d", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("with_start", [False, True], ids=["from0", "kv_start"])
def test_decode_kernel(hq, hkv, d, dtype, with_start):
    gen = torch.Generator().manual_seed(hq * 100 + d)
    lens = [1, 7, 64, 65, 333, 1029, 2]  # odd lengths, block edges, long enough to split
    k, v, r2t, rows = make_pool(lens, hkv, d, dtype, gen, shared=40)
    q = torch.randn(len(lens), hq, d, generator=gen).to(dtype)
    start = torch.tensor([0, 3, 64, 10, 200, 1, 2]) if with_start else None  # the last sees none
    scale = d ** -0.5
    out, lse = cpu_kernels.decode(q, k, v, r2t, rows, torch.tensor(lens), scale, kv_start=start,
                                  return_lse=True)
    assert out.dtype == dtype and lse.dtype == torch.float32
    for b, ln in enumerate(lens):
        s0 = int(start[b]) if with_start else 0
        ro, rl = dense(q[b:b + 1], k, v, r2t[rows[b], s0:ln], scale)
        close(out[b:b + 1], ro, dtype)
        close_lse(lse[b:b + 1], rl)
    # return_lse=False gives the same output
    close(cpu_kernels.decode(q, k, v, r2t, rows, torch.tensor(lens), scale, kv_start=start), out,
          torch.float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("hq, hkv, d", SHAPES[:2], ids=SHAPE_IDS[:2])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("with_start", [False, True], ids=["from0", "kv_start"])
def test_extend_kernel(hq, hkv, d, dtype, causal, with_start):
    gen = torch.Generator().manual_seed(7 * hq + d + causal)
    # (new query tokens, keys): prefill (n_q == keys), a cached prefix, one query (a decode row),
    # a query block longer than a task's rows, more queries than keys (causal: the first see none)
    spec = [(13, 13), (20, 300), (1, 71), (150, 190), (5, 3), (33, 1100)]
    total = [kv + 8 for _, kv in spec]  # kv_start needs room before the range
    k, v, r2t, rows = make_pool(total, hkv, d, dtype, gen, shared=60)
    n_q = [a for a, _ in spec]
    kv_len = torch.tensor([b for _, b in spec])
    start = torch.tensor([0, 8, 3, 1, 5, 2]) if with_start else None
    indptr = torch.tensor([0] + torch.tensor(n_q).cumsum(0).tolist())
    q = torch.randn(int(indptr[-1]), hq, d, generator=gen).to(dtype)
    scale = d ** -0.5
    out, lse = cpu_kernels.extend(q, k, v, r2t, rows, indptr, kv_len, scale, kv_start=start,
                                  causal=causal, return_lse=True)
    for s, (nq, kl) in enumerate(spec):
        s0 = int(start[s]) if with_start else 0
        qs = q[indptr[s]:indptr[s + 1]]
        ro, rl = dense(qs, k, v, r2t[rows[s], s0:s0 + kl], scale, kl - nq if causal else None)
        close(out[indptr[s]:indptr[s + 1]], ro, dtype)
        close_lse(lse[indptr[s]:indptr[s + 1]], rl)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("n_threads", [2, 3])
def test_key_splits_merge(dtype, n_threads, threads):
    """Few (sequence, head) tasks for the threads (batch-1 decode, one short query block over a
    long prefix): the kernel splits each key range and merges the splits by log-sum-exp. The
    same numbers as unsplit (1 thread) and as the dense reference, lse included."""
    gen = torch.Generator().manual_seed(31 + n_threads)
    hq, hkv, d = 9, 3, 64
    k, v, r2t, rows = make_pool([1029, 1100], hkv, d, dtype, gen, shared=900)
    scale = d ** -0.5
    q1 = torch.randn(1, hq, d, generator=gen).to(dtype)
    q2 = torch.randn(20, hq, d, generator=gen).to(dtype)
    indptr = torch.tensor([0, 20])
    res = {}
    for n in (1, n_threads):
        threads(n)
        res[n] = (cpu_kernels.decode(q1, k, v, r2t, rows[:1], torch.tensor([1029]), scale,
                                     return_lse=True),
                  cpu_kernels.extend(q2, k, v, r2t, rows[1:], indptr, torch.tensor([1100]), scale,
                                     return_lse=True))
    (o1, l1), (o2, l2) = res[n_threads]
    ro, rl = dense(q1, k, v, r2t[rows[0], :1029], scale)
    close(o1, ro, dtype)
    close_lse(l1, rl)
    ro, rl = dense(q2, k, v, r2t[rows[1], :1100], scale, 1080)
    close(o2, ro, dtype)
    close_lse(l2, rl)
    for split, unsplit in zip(res[n_threads], res[1]):
        torch.testing.assert_close(split[0].float(), unsplit[0].float(), atol=TOL[dtype] / 2,
                                   rtol=TOL[dtype] / 2)
        torch.testing.assert_close(split[1], unsplit[1], atol=1e-5, rtol=1e-6)


def test_extend_writes_only_its_rows_and_any_strides():
    """q and out may be strided views (heads of a fused qkv); rows outside qo_indptr stay as
    they were; an empty sequence (n_q = 0) is skipped."""
    gen = torch.Generator().manual_seed(11)
    hq, hkv, d = 9, 3, 64
    k, v, r2t, rows = make_pool([40, 50, 9], hkv, d, torch.float32, gen)
    qkv = torch.randn(30, hq + 2 * hkv, d, generator=gen)
    q = qkv[:, :hq]  # (30, 9, 64) with row stride 15 * 64
    out_full = torch.full((30, hq + 2, d), 7.0)
    out = out_full[:, 1:hq + 1]
    indptr = torch.tensor([2, 12, 12, 27])  # rows 0-1 and 27-29 belong to no sequence
    kv_len = torch.tensor([40, 50, 9])
    cpu_kernels.extend(q, k, v, r2t, rows, indptr, kv_len, 0.125, out=out)
    assert torch.all(out_full[:2] == 7.0) and torch.all(out_full[27:] == 7.0)
    assert torch.all(out_full[:, 0] == 7.0) and torch.all(out_full[:, -1] == 7.0)
    ro, _ = dense(q[2:12], k, v, r2t[rows[0], :40], 0.125, 30)
    close(out[2:12], ro, torch.float32)
    ro, _ = dense(q[12:27], k, v, r2t[rows[2], :9], 0.125, -6)
    close(out[12:27], ro, torch.float32)


def test_kernels_reject_bad_slots_and_shapes():
    gen = torch.Generator().manual_seed(12)
    k, v, r2t, rows = make_pool([10], 2, 32, torch.float32, gen)
    q = torch.randn(1, 4, 32)
    bad = r2t.clone()
    bad[rows[0], 3] = k.shape[0] + 5  # a slot outside the pool
    with pytest.raises(RuntimeError, match="outside the KV pool"):
        cpu_kernels.decode(q, k, v, bad, rows, torch.tensor([10]), 0.1)
    with pytest.raises(RuntimeError, match="exceeds req_to_token"):
        cpu_kernels.decode(q, k, v, r2t, rows, torch.tensor([r2t.shape[1] + 1]), 0.1)
    with pytest.raises(RuntimeError, match="Hq % Hkv"):
        cpu_kernels.decode(torch.randn(1, 3, 32), k, v, r2t, rows, torch.tensor([10]), 0.1)
    with pytest.raises(RuntimeError, match="req_pool_index 9 out of range"):
        cpu_kernels.decode(q, k, v, r2t, torch.tensor([9]), torch.tensor([10]), 0.1)
    with pytest.raises(RuntimeError, match="seq_lens: contiguous int64 CPU tensor of 1 elements"):
        OPS.decode(q, k, v, r2t, rows, torch.empty(0, dtype=torch.int64),
                   torch.tensor([10], dtype=torch.int32), 0.1, torch.empty_like(q), torch.empty(0))


def test_store_kv_matches_pool_write():
    gen = torch.Generator().manual_seed(13)
    for dtype in (torch.float32, torch.bfloat16):
        a = KVPool(50, 1, 3, 64, dtype, "cpu")
        b = KVPool(50, 1, 3, 64, dtype, "cpu")
        loc = torch.randperm(50, generator=gen)[:17] + 1
        kv = torch.randn(17, 2 * 3, 64, generator=gen).to(dtype)
        k, v = kv[:, :3], kv[:, 3:]  # strided views, as the model's fused projection gives
        a.write(0, loc, k, v)
        OPS.store_kv(k, v, b.k_buffers[0], b.v_buffers[0], loc)
        assert torch.equal(a.k_buffers[0], b.k_buffers[0])
        assert torch.equal(a.v_buffers[0], b.v_buffers[0])
    # a dtype mismatch (fp32 K into a bf16 pool) converts like KVPool.write
    c = KVPool(50, 1, 3, 64, torch.bfloat16, "cpu")
    k32 = torch.randn(4, 3, 64, generator=gen)
    OPS.store_kv(k32, k32, c.k_buffers[0], c.v_buffers[0], torch.tensor([1, 2, 3, 4]))
    assert torch.equal(c.k_buffers[0][1:5], k32.to(torch.bfloat16))


# ---- the backend, on ForwardBatches as the scheduler builds them ---------------------------------

def _both(pool, r2t, scale=0.125):
    return (TorchNativeAttention(pool, r2t, scale, max_batch_size=16, max_context_len=r2t.shape[1]),
            CpuAttention(pool, r2t, scale, max_batch_size=16, max_context_len=r2t.shape[1]))


def _run_backend(backend, pool, fb_factory, qkv, layer):
    fb = fb_factory()
    backend.init_forward_metadata(fb)
    return backend.forward(*qkv, layer, fb)


def _extend_batch(r2t, rows, prefix, ext, n_decode_tail):
    """An EXTEND ForwardBatch: requests with cached `prefix` tokens and `ext` new ones (the last
    `n_decode_tail` are decode rows: ext 1), new tokens' slots taken from req_to_token."""
    lens = [p + e for p, e in zip(prefix, ext)]
    loc = torch.cat([r2t[rows[i], prefix[i]:lens[i]] for i in range(len(lens))])
    t = loc.shape[0]

    def fb():
        return ForwardBatch(
            mode=ForwardMode.EXTEND, input_ids=torch.zeros(t, dtype=torch.int64),
            positions=torch.cat([torch.arange(p, p + e) for p, e in zip(prefix, ext)]),
            out_cache_loc=loc, req_pool_indices=rows.clone(), seq_lens=torch.tensor(lens),
            logits_indices=torch.zeros(len(lens), dtype=torch.int64), seq_lens_cpu=list(lens),
            extend_prefix_lens_cpu=list(prefix), extend_lens_cpu=list(ext),
            num_decode_tail=n_decode_tail)
    return fb, t


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_backend_mixed_extend_matches_torch_native(dtype):
    """Four requests with cached prefixes (three share a 70-token prefix, one has none) plus
    three decode-tail rows, in one EXTEND step over two layers; K/V written as the model does."""
    gen = torch.Generator().manual_seed(21)
    hq, hkv, d = 9, 3, 64
    prefix = [70, 70, 71, 0, 129, 4, 300]
    ext = [9, 1, 30, 17, 1, 1, 1]
    lens = [p + e for p, e in zip(prefix, ext)]
    k0, v0, r2t, rows = make_pool(lens, hkv, d, dtype, gen, shared=70)
    pools = []
    for _ in range(2):  # one pool per backend, same contents
        pool = KVPool(k0.shape[0] - 1, 2, hkv, d, dtype, "cpu")
        for layer in range(2):
            pool.k_buffers[layer].copy_(k0)
            pool.v_buffers[layer].copy_(v0)
        pools.append(pool)
    fb, t = _extend_batch(r2t, rows, prefix, ext, n_decode_tail=3)
    ref_be = TorchNativeAttention(pools[0], r2t, 0.125)
    cpu_be = CpuAttention(pools[1], r2t, 0.125)
    for layer in range(2):
        qkv = [torch.randn(t, h, d, generator=gen).to(dtype) for h in (hq, hkv, hkv)]
        ref = _run_backend(ref_be, pools[0], fb, qkv, layer)
        out = _run_backend(cpu_be, pools[1], fb, qkv, layer)
        assert out.dtype == dtype
        close(out, ref, dtype)
        assert torch.equal(pools[0].k_buffers[layer], pools[1].k_buffers[layer])
        assert torch.equal(pools[0].v_buffers[layer], pools[1].v_buffers[layer])


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_backend_decode_matches_torch_native(dtype):
    gen = torch.Generator().manual_seed(22)
    hq, hkv, d = 9, 3, 64
    lens = [1, 2, 65, 500, 77, 1000]
    k0, v0, r2t, rows = make_pool(lens, hkv, d, dtype, gen, shared=60)
    pool = KVPool(k0.shape[0] - 1, 1, hkv, d, dtype, "cpu")
    pool.k_buffers[0].copy_(k0)
    pool.v_buffers[0].copy_(v0)
    loc = torch.stack([r2t[rows[i], lens[i] - 1] for i in range(len(lens))])
    qkv = [torch.randn(len(lens), h, d, generator=gen).to(dtype) for h in (hq, hkv, hkv)]

    def fb():
        return ForwardBatch(mode=ForwardMode.DECODE, input_ids=torch.zeros(len(lens), dtype=torch.int64),
                            positions=torch.tensor(lens) - 1, out_cache_loc=loc,
                            req_pool_indices=rows.clone(), seq_lens=torch.tensor(lens),
                            logits_indices=torch.arange(len(lens)), seq_lens_cpu=list(lens))

    ref_be, cpu_be = _both(pool, r2t)
    ref = _run_backend(ref_be, pool, fb, qkv, 0)
    out = _run_backend(cpu_be, pool, fb, qkv, 0)
    close(out, ref, dtype)


def test_backend_prefill_without_prefix_matches_torch_native():
    gen = torch.Generator().manual_seed(23)
    hq, hkv, d = 9, 3, 64
    lens = [1, 37, 260]
    k0, v0, r2t, rows = make_pool(lens, hkv, d, torch.float32, gen)
    pool = KVPool(k0.shape[0] - 1, 1, hkv, d, torch.float32, "cpu")
    fb, t = _extend_batch(r2t, rows, [0, 0, 0], lens, n_decode_tail=0)
    qkv = [torch.randn(t, h, d, generator=gen) for h in (hq, hkv, hkv)]
    ref_be, cpu_be = _both(pool, r2t)
    ref = _run_backend(ref_be, pool, fb, qkv, 0)
    out = _run_backend(cpu_be, pool, fb, qkv, 0)
    close(out, ref, torch.float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_backend_shared_prefix_decode_matches_plain(dtype):
    """Decode with prefix groups (own suffix by a ranged decode, each group's prefix once by a
    non-causal extend, merged by lse) equals torch_native's plain decode over every key."""
    from test_shared_prefix import cascade_vs_plain

    out, ref = cascade_vs_plain(CpuAttention, dtype)
    close(out, ref, dtype)


def test_ranged_ops_match_torch_reference():
    from radixlm.runtime.attention import shared_prefix
    from test_shared_prefix import make_batch

    gen = torch.Generator().manual_seed(0)
    pool, r2t, fb, (q, _, _), groups = make_batch(torch.float32, gen)
    cpu_be = CpuAttention(pool, r2t, 0.125)
    k_buf, v_buf = pool.k_buffers[0], pool.v_buffers[0]
    got = cpu_be.ranged_decode(q, k_buf, v_buf, fb.req_pool_indices, groups.kv_start, fb.seq_lens)
    want = shared_prefix.torch_ranged_decode(q, k_buf, v_buf, r2t, fb.req_pool_indices,
                                             groups.kv_start, fb.seq_lens, 0.125)
    close(got[0], want[0], torch.float32)
    close_lse(got[1], want[1])
    q_sh = q.index_select(0, groups.rows)
    got = cpu_be.prefix_attention(q_sh, k_buf, v_buf, groups)
    want = shared_prefix.torch_prefix_attention(q_sh, k_buf, v_buf, r2t, groups, 0.125)
    close(got[0], want[0], torch.float32)
    close_lse(got[1], want[1])


# ---- wiring: auto picks the kernels; a failure falls back with one warning -----------------------

def test_auto_picks_cpu_kernels():
    assert registry.resolve_backend_name("auto", torch.device("cpu")) == "cpu"
    assert registry.resolve_backend_name("cpu", torch.device("cpu")) == "cpu"


def test_build_failure_falls_back_with_one_warning(monkeypatch, caplog):
    monkeypatch.setattr(cpu_kernels, "_module", None)
    monkeypatch.setattr(cpu_kernels, "_error", "RuntimeError: simulated: no compiler")
    monkeypatch.setattr(cpu_kernels, "_warned", False)
    pool = KVPool(8, 1, 1, 8, torch.float32, "cpu")
    r2t = torch.zeros(2, 8, dtype=torch.int64)
    with caplog.at_level(logging.WARNING):
        names = [registry.resolve_backend_name("auto", torch.device("cpu")) for _ in range(3)]
        backends = [CpuAttention.create(pool, r2t, 0.1) for _ in range(2)]
    assert names == ["torch_native"] * 3
    assert all(type(b) is TorchNativeAttention for b in backends)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert "torch_native" in warnings[0].getMessage()
    assert "simulated: no compiler" in warnings[0].getMessage()
    # asked for by name, the kernels' absence is an error naming the reason, not a fallback
    with pytest.raises(ValueError, match="simulated: no compiler"):
        registry.resolve_backend_name("cpu", torch.device("cpu"))


# ---- engine level: SmolLM2, the same greedy tokens as torch_native ------------------------------

def test_engine_greedy_matches_torch_native(smol_path, integrity):
    """The cache-equivalence prompts (8 chat prompts sharing a long system prompt: prefill,
    cached-prefix extend, mixed extend + decode steps, decode with the shared prefix read once per
    group, plain decode), fp32, 24 greedy tokens each, then a repeat served from the cache: the
    same tokens with either backend."""
    import radixlm
    from radixlm.runtime.attention.shared_prefix import PrefixGrouper
    from test_cache_equivalence import _prompts, _run

    seen = []
    results = {}
    for backend in ("torch_native", "cpu"):
        eng = radixlm.Engine(model_path=smol_path, attention_backend=backend, dtype="float32",
                             max_total_tokens=6000, context_length=2048)
        try:
            be = eng.runner.attn_backend
            assert type(be).__name__ == {"torch_native": "TorchNativeAttention",
                                         "cpu": "CpuAttention"}[backend]
            if backend == "cpu":
                orig = be.init_forward_metadata

                def record(fb, orig=orig):
                    seen.append((fb.mode, any(fb.extend_prefix_lens_cpu), fb.num_decode_tail > 0,
                                 fb.prefix_groups is not None))
                    orig(fb)
                be.init_forward_metadata = record
                # group whenever two running requests share >= 64 cached tokens (the default
                # thresholds would group only part of these steps)
                sched = eng.scheduler
                assert sched.prefix_grouper is not None  # the cpu backend supports groups
                sched.prefix_grouper = PrefixGrouper(sched.device, min_shared=64,
                                                     min_saved_fraction=0.0)
            prompts = _prompts(eng.tokenizer)
            ids, _ = _run(eng, prompts, max_new=24)
            again = eng.generate(prompts[3], {"temperature": 0, "max_new_tokens": 24})
            integrity(eng)
        finally:
            eng.shutdown()
        results[backend] = (ids, again["output_ids"])
    assert results["cpu"] == results["torch_native"]
    assert results["cpu"][1] == results["cpu"][0][3]
    assert (ForwardMode.DECODE, False, False, False) in seen  # plain decode steps
    assert (ForwardMode.DECODE, False, False, True) in seen  # decode through prefix groups
    assert any(m == ForwardMode.EXTEND and pre for m, pre, _, _ in seen)  # cached-prefix extend
    assert any(m == ForwardMode.EXTEND and tail for m, _, tail, _ in seen)  # mixed steps
