"""The `cpu` attention backend (the C++ kernels are tested on their own in test_cpu_attention.py).

Backend level: `CpuAttention` against `TorchNativeAttention` on the batches the model runner
builds (decode; extend with cached prefixes shared in the pool; extend with a decode tail; decode
through shared-prefix groups). Engine level: SmolLM2 gives the same greedy tokens with
attention_backend "cpu" and "torch_native". Plus the fallback: one warning, torch_native, never
silent. Like test_cpu_attention.py, the module skips only when the kernels' build tools are
missing.
"""

from __future__ import annotations

import logging

import pytest
import torch

from cpu_attention_ref import DTYPES, close, close_lse, kernels_built, make_pool  # noqa: F401 - autouse
from radixlm.runtime.attention import cpu_kernels, registry
from radixlm.runtime.attention.cpu_backend import CpuAttention
from radixlm.runtime.attention.torch_native import TorchNativeAttention
from radixlm.runtime.executor.forward_batch import ForwardBatch, ForwardMode
from radixlm.runtime.mem_cache.kv_pool import KVPool


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
def test_forward_rows_equals_forward_at_those_rows(dtype):
    """forward_rows (models/llama.py's last layer: the logits rows only, as decode queries) gives
    forward()'s rows: requests with and without cached prefixes, a decode tail, rows at the ends
    and inside the new tokens, none at all; every new token's K/V still stored."""
    gen = torch.Generator().manual_seed(5)
    hq, hkv, d = 9, 3, 64
    prefix = [70, 0, 129, 4]
    ext = [9, 17, 1, 1]
    lens = [p + e for p, e in zip(prefix, ext)]
    k0, v0, r2t, rows = make_pool(lens, hkv, d, dtype, gen, shared=70)
    pools = []
    for _ in range(2):
        pool = KVPool(k0.shape[0] - 1, 1, hkv, d, dtype, "cpu")
        pool.k_buffers[0].copy_(k0)
        pool.v_buffers[0].copy_(v0)
        pools.append(pool)
    fb, t = _extend_batch(r2t, rows, prefix, ext, n_decode_tail=2)
    qkv = [torch.randn(t, h, d, generator=gen).to(dtype) for h in (hq, hkv, hkv)]
    full_be, rows_be = CpuAttention(pools[0], r2t, 0.125), CpuAttention(pools[1], r2t, 0.125)
    full = _run_backend(full_be, pools[0], fb, qkv, 0)
    for sel in ([8, 25, 26], [0, 3, 9, 12, 25, 26], []):
        idx = torch.tensor(sel, dtype=torch.int64)
        f = fb()
        rows_be.init_forward_metadata(f)
        out = rows_be.forward_rows(qkv[0][idx], qkv[1], qkv[2], 0, f, idx)
        assert out.shape == (len(sel), hq, d)
        close(out, full[idx], dtype)
        assert torch.equal(pools[0].k_buffers[0], pools[1].k_buffers[0])
        assert torch.equal(pools[0].v_buffers[0], pools[1].v_buffers[0])


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
