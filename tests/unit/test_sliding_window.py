"""Sliding-window attention and logit soft-capping in the torch_native and cpu backends, against a
dense fp32 reference with HF's masks: extend with cached (radix-shared) prefixes and a decode tail,
decode, windows of 1 key up to longer than every request, GQA, odd lengths; the C++ kernels' key
splits under a window; shared-prefix (cascade) decode with a soft-cap stays exact, and a model
with a windowed layer plans no prefix groups. Triton: test_triton_sliding_window.py."""

from __future__ import annotations

import pytest
import torch

from test_shared_prefix import make_batch  # tests/unit is on sys.path
from window_ref import (CASE_IDS, CASES, CTX, HQ, SCALE, D, decode_batch, dense,
                        extend_batch, make_pool, run_and_check)
from radixlm.runtime.attention import cpu_kernels
from radixlm.runtime.attention.cpu_backend import CpuAttention, CpuKernelsUnavailable
from radixlm.runtime.attention.torch_native import TorchNativeAttention

BACKENDS = {"torch_native": TorchNativeAttention, "cpu": CpuAttention}
TOL = 2e-5


def make_backend(name, pool, r2t, windows, softcap, ctx=CTX, scale=SCALE):
    try:
        return BACKENDS[name](pool, r2t, scale, max_batch_size=16, max_context_len=ctx,
                              windows=windows, logit_softcap=softcap)
    except CpuKernelsUnavailable as e:
        pytest.skip(f"CPU kernels unavailable: {e}")


@pytest.mark.parametrize("window, softcap", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("name", list(BACKENDS))
def test_extend_with_cached_prefix_and_decode_tail(name, window, softcap):
    gen = torch.Generator().manual_seed(5)
    # a fresh prefill, two requests on one 40-token cached prefix, a long chunk after a short
    # prefix, and three decode rows mixed in at the end
    prefix = [0, 45, 45, 13, 100, 30, 64]
    ext = [17, 9, 30, 70, 1, 1, 1]
    pool, r2t, rows = make_pool([p + e for p, e in zip(prefix, ext)], 40, gen)
    windows = [window, None]
    backend = make_backend(name, pool, r2t, windows, softcap)
    fb = extend_batch(r2t, rows, prefix, ext, n_decode_tail=3)
    run_and_check(backend, pool, r2t, rows, prefix, ext, fb, windows, softcap, gen, TOL)


@pytest.mark.parametrize("window, softcap", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("name", list(BACKENDS))
def test_decode(name, window, softcap):
    gen = torch.Generator().manual_seed(6)
    lens = [1, 50, 51, 130, 9, 200]
    pool, r2t, rows = make_pool(lens, 40, gen)
    windows = [window, None]
    backend = make_backend(name, pool, r2t, windows, softcap)
    fb = decode_batch(r2t, rows, lens)
    run_and_check(backend, pool, r2t, rows, [n - 1 for n in lens], [1] * len(lens), fb, windows,
                  softcap, gen, TOL)


@pytest.mark.parametrize("threads", [1, 2, 4])
def test_cpu_kernels_window_with_key_splits(threads):
    """Few long sequences: the kernels split key ranges (fewer tasks than threads) and the window
    cut happens before the split; the window edge falls inside query blocks of the extend."""
    try:
        cpu_kernels.load()
    except CpuKernelsUnavailable as e:
        pytest.skip(str(e))
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        gen = torch.Generator().manual_seed(threads)
        pool, r2t, rows = make_pool([1500, 2100], 0, gen, n_layers=1)
        k, v = pool.k_buffers[0], pool.v_buffers[0]
        for window, cap in ((300, None), (1000, 3.0), (64, None)):
            q = torch.randn(1, HQ, D, generator=gen)
            out = cpu_kernels.decode(q, k, v, r2t, rows[:1], torch.tensor([1500]), SCALE,
                                     window=window, softcap=cap or 0.0)
            slots = r2t[rows[0], :1500]
            torch.testing.assert_close(out, dense(q, k[slots], v[slots], torch.tensor([1499]),
                                                  window, cap), atol=TOL, rtol=TOL)
            n_q = 150  # the last 150 of 2100 positions: 7 query blocks of 24 queries (G = 4)
            q = torch.randn(n_q, HQ, D, generator=gen)
            out = cpu_kernels.extend(q, k, v, r2t, rows[1:], torch.tensor([0, n_q]),
                                     torch.tensor([2100]), SCALE, window=window,
                                     softcap=cap or 0.0)
            slots = r2t[rows[1], :2100]
            ref = dense(q, k[slots], v[slots], torch.arange(2100 - n_q, 2100), window, cap)
            torch.testing.assert_close(out, ref, atol=TOL, rtol=TOL)
    finally:
        torch.set_num_threads(prev)


def test_cpu_kernels_refuse_a_window_without_causality():
    try:
        cpu_kernels.load()
    except CpuKernelsUnavailable as e:
        pytest.skip(str(e))
    pool, r2t, rows = make_pool([10], 0, torch.Generator().manual_seed(0), n_layers=1)
    q = torch.randn(4, HQ, D)
    with pytest.raises(RuntimeError, match="sliding window needs causal"):
        cpu_kernels.extend(q, pool.k_buffers[0], pool.v_buffers[0], r2t, rows,
                           torch.tensor([0, 4]), torch.tensor([10]), SCALE, causal=False,
                           window=3)


@pytest.mark.parametrize("name", list(BACKENDS))
def test_softcap_shared_prefix_cascade_equals_plain_decode(name):
    """The lse merge of the shared-prefix path stays exact with soft-capped scores."""
    gen = torch.Generator().manual_seed(0)
    pool, r2t, fb, qkv, groups = make_batch(torch.float32, gen)
    ref = TorchNativeAttention(pool, r2t, 0.125, logit_softcap=1.5)
    ref.init_forward_metadata(fb)
    plain = ref.forward(*qkv, 0, fb)
    backend = make_backend(name, pool, r2t, None, 1.5, ctx=512, scale=0.125)
    fb.prefix_groups = groups
    backend.init_forward_metadata(fb)
    torch.testing.assert_close(backend.forward(*qkv, 0, fb), plain, atol=TOL, rtol=TOL)
    # and the soft-cap changed the result (the test is not vacuous)
    nocap = TorchNativeAttention(pool, r2t, 0.125)
    fb.prefix_groups = None
    nocap.init_forward_metadata(fb)
    assert (nocap.forward(*qkv, 0, fb) - plain).abs().max() > 1e-2


@pytest.mark.parametrize("name", list(BACKENDS))
def test_windowed_model_plans_no_prefix_groups_and_a_windowed_layer_ignores_them(name):
    gen = torch.Generator().manual_seed(1)
    pool, r2t, fb, qkv, groups = make_batch(torch.float32, gen)
    windowed = make_backend(name, pool, r2t, [20], None, ctx=512, scale=0.125)
    assert not windowed.supports_shared_prefix  # the scheduler's switch
    full = make_backend(name, pool, r2t, None, None, ctx=512)
    assert full.supports_shared_prefix == (name == "cpu")
    windowed.init_forward_metadata(fb)
    plain = windowed.forward(*qkv, 0, fb)
    fb.prefix_groups = groups  # handed groups anyway: the windowed layer runs plain decode
    windowed.init_forward_metadata(fb)
    torch.testing.assert_close(windowed.forward(*qkv, 0, fb), plain, atol=0, rtol=0)


def test_backend_checks_and_normalizes_windows():
    pool, r2t, _ = make_pool([10], 0, torch.Generator().manual_seed(0), n_layers=2)
    with pytest.raises(ValueError, match="1 sliding windows for 2 layers"):
        TorchNativeAttention(pool, r2t, SCALE, windows=[4])
    with pytest.raises(ValueError, match="positive int"):
        TorchNativeAttention(pool, r2t, SCALE, windows=[0, None])
    with pytest.raises(ValueError, match="logit_softcap"):
        TorchNativeAttention(pool, r2t, SCALE, logit_softcap=-1.0)
    # a window covering every position a request can reach is full attention
    be = TorchNativeAttention(pool, r2t, SCALE, max_context_len=64, windows=[64, 8])
    assert be.windows == (0, 8) and be.has_window
    assert TorchNativeAttention(pool, r2t, SCALE).windows == (0, 0)
