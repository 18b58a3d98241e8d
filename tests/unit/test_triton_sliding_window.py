"""Sliding windows and logit soft-capping in the Triton attention kernels and backend, on the CPU
through Triton's interpreter (TRITON_INTERPRET=1), against the dense fp32 reference of
window_ref.py: the decode kernel's window start with key splits and kv_start, the extend kernel's
three key regions (window edge, interior, diagonal) with small tiles, and the backend on the
batches the model runner builds. The GPU run of the compiled kernels is the lead's
(tests/gpu/test_triton_attention_gpu.py covers the unwindowed ones)."""

from __future__ import annotations

import pytest
import torch

from triton_interpreter import import_interpreted  # tests/unit is on sys.path
from window_ref import (CASE_IDS, CASES, CTX, HQ, SCALE, D, decode_batch, dense,
                        extend_batch, make_pool, run_and_check)

import_interpreted("radixlm.runtime.attention.triton_backend",
                   gpu_tests="tests/gpu/test_triton_attention_gpu.py")
from radixlm.runtime.attention.triton_backend import TritonAttention  # noqa: E402
from radixlm.runtime.attention.triton_decode import decode_attention  # noqa: E402
from radixlm.runtime.attention.triton_extend import extend_attention  # noqa: E402

TOL = 1e-4


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.mark.parametrize("window, softcap", [(33, None), (5, 2.0), (None, 2.0)])
@pytest.mark.parametrize("splits", [1, 4])
def test_decode_kernel_window_splits_and_kv_start(window, softcap, splits):
    gen = torch.Generator().manual_seed(splits)
    lens = [1, 20, 130, 77]
    pool, r2t, rows = make_pool(lens, 0, gen, n_layers=1)
    k, v = pool.k_buffers[0], pool.v_buffers[0]
    q = torch.randn(len(lens), HQ, D, generator=gen)
    for start in (None, torch.tensor([0, 3, 100, 70])):
        out = torch.empty_like(q)
        decode_attention(q, k, v, r2t, rows, start, torch.tensor(lens), SCALE, out,
                         num_splits=splits, window=window or 0, softcap=softcap or 0.0)
        for b, n in enumerate(lens):
            lo = 0 if start is None else int(start[b])
            slots = r2t[rows[b], lo:n]  # positions lo..n-1; the query at n - 1
            ref = dense(q[b:b + 1], k[slots], v[slots], torch.tensor([n - 1 - lo]),
                        window, softcap)
            torch.testing.assert_close(out[b:b + 1], ref, atol=TOL, rtol=TOL)


@pytest.mark.parametrize("window, softcap", [(40, None), (3, None), (17, 2.0), (None, 2.0)])
def test_extend_kernel_window_regions(window, softcap):
    """16 x 16 tiles: with a 40-key window a tile of 4 queries x 4 heads has blocks below the
    window (skipped), at its edge (masked), inside (unmasked) and on the diagonal (masked)."""
    gen = torch.Generator().manual_seed(3)
    spec = [(37, 37), (20, 150), (1, 90), (9, 9)]  # (new queries, keys)
    pool, r2t, rows = make_pool([kv for _, kv in spec], 0, gen, n_layers=1)
    k, v = pool.k_buffers[0], pool.v_buffers[0]
    n_q = [a for a, _ in spec]
    indptr = torch.tensor([0] + torch.tensor(n_q).cumsum(0).tolist())
    q = torch.randn(int(indptr[-1]), HQ, D, generator=gen)
    out = torch.empty_like(q)
    extend_attention(q, k, v, r2t, rows, indptr, torch.zeros(len(spec), dtype=torch.int64),
                     torch.tensor([kv for _, kv in spec]), True, SCALE, out,
                     max_q_len=max(n_q), config=(16, 16, 4, 1), window=window or 0,
                     softcap=softcap or 0.0)
    for s, (nq, kv) in enumerate(spec):
        slots = r2t[rows[s], :kv]
        ref = dense(q[indptr[s]:indptr[s + 1]], k[slots], v[slots], torch.arange(kv - nq, kv),
                    window, softcap)
        torch.testing.assert_close(out[indptr[s]:indptr[s + 1]], ref, atol=TOL, rtol=TOL)


def test_extend_kernel_refuses_a_window_without_causality():
    pool, r2t, rows = make_pool([10], 0, torch.Generator().manual_seed(0), n_layers=1)
    q = torch.randn(4, HQ, D)
    with pytest.raises(AssertionError, match="sliding window needs causal"):
        extend_attention(q, pool.k_buffers[0], pool.v_buffers[0], r2t, rows,
                         torch.tensor([0, 4]), torch.zeros(1, dtype=torch.int64),
                         torch.tensor([10]), False, SCALE, torch.empty_like(q), max_q_len=4,
                         window=3)


@pytest.mark.parametrize("window, softcap", CASES, ids=CASE_IDS)
def test_backend_extend_and_decode(window, softcap):
    gen = torch.Generator().manual_seed(7)
    prefix, ext = [0, 45, 45, 70, 30], [17, 9, 30, 1, 1]
    pool, r2t, rows = make_pool([p + e for p, e in zip(prefix, ext)], 40, gen)
    windows = [window, None]
    backend = TritonAttention(pool, r2t, SCALE, max_batch_size=8, max_context_len=CTX,
                              windows=windows, logit_softcap=softcap)
    assert backend.supports_shared_prefix == (window is None)
    fb = extend_batch(r2t, rows, prefix, ext, n_decode_tail=2)
    run_and_check(backend, pool, r2t, rows, prefix, ext, fb, windows, softcap, gen, TOL)
    lens = [p + e for p, e in zip(prefix, ext)]
    fb = decode_batch(r2t, rows, lens)
    run_and_check(backend, pool, r2t, rows, [n - 1 for n in lens], [1] * len(lens), fb, windows,
                  softcap, gen, TOL)


def test_engine_gemma2_on_triton_matches_hf(tmp_path):
    """The plumbing end to end: a Gemma 2 checkpoint (windowed layers between global ones,
    attention and final soft-caps) on the triton backend gives HF's greedy tokens, fresh and
    on a radix-cache hit of a prefix longer than the window."""
    import transformers as tf

    import arch_parity as ap

    model = ap.save_tiny(tf.Gemma2ForCausalLM, tf.Gemma2Config(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24,
        max_position_embeddings=256, sliding_window=6, attn_logit_softcapping=3.0,
        final_logit_softcapping=8.0, bos_token_id=None, eos_token_id=None), tmp_path)
    gen = torch.Generator().manual_seed(4)
    shared = torch.randint(0, 256, (20,), generator=gen).tolist()
    prompts = [shared + torch.randint(0, 256, (n,), generator=gen).tolist() for n in (3, 11)]
    ref = ap.hf_greedy(model, prompts, max_new=6)
    eng = ap.make_engine(str(tmp_path), attention_backend="triton")
    try:
        assert eng.runner.attn_backend.windows == (6, 0)
        for _ in range(2):  # the second round hits the cached prefix
            outs = ap.generate(eng, prompts, max_new=6)
            assert [o["output_ids"] for o in outs] == ref
        eng.wait_idle()
        eng.check_integrity()
    finally:
        eng.shutdown()
