"""The batch-1 Triton GEMV of layers/triton_gemv.py against a float64 reference: compiled on a CUDA
GPU here at the Llama-3.1-8B shapes (`pytest -m gpu tests/gpu`); `check_gemv` also runs on the CPU
through Triton's interpreter at small odd shapes (tests/unit/test_triton_gemv.py)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


def check_gemv(device, shapes, dtypes=(torch.bfloat16, torch.float16), configs=(None,)):
    from radixlm.runtime.layers.triton_gemv import gemv

    gen = torch.Generator().manual_seed(0)
    for n, k in shapes:
        for dtype in dtypes:
            x = torch.randn(1, k, generator=gen).to(device, dtype)
            w = (torch.randn(n, k, generator=gen) / k ** 0.5).to(device, dtype)
            b = torch.randn(n, generator=gen).to(device, dtype)
            for bias in (None, b):
                ref = x.double() @ w.double().T + (0 if bias is None else bias.double())
                for cfg in configs:
                    y = gemv(x, w, bias, config=cfg)
                    assert y.shape == (1, n) and y.dtype == dtype
                    # fp32 sum, one rounding: within a couple of output ulps of the exact value
                    err = (y.double() - ref).abs()
                    tol = 2 * ref.abs() * (2 ** -7 if dtype == torch.bfloat16 else 2 ** -10) + 1e-3
                    assert bool((err <= tol).all()), (n, k, dtype, cfg, float(err.max()))


def check_gate_up_silu(device, shapes, dtypes=(torch.bfloat16, torch.float16), configs=(None,)):
    """The fused gate_up + SiLU-and-mul GEMV against the plain GEMV followed by SiLU-and-mul in
    torch with the same roundings: equal up to the GEMV's summation order (the tile layouts
    differ), i.e. within an output ulp or two."""
    from radixlm.runtime.layers import triton_gemv

    gen = torch.Generator().manual_seed(1)
    for n2, k in shapes:
        for dtype in dtypes:
            x = torch.randn(1, k, generator=gen).to(device, dtype)
            w = (torch.randn(n2, k, generator=gen) / k ** 0.5 * 3).to(device, dtype)
            for cfg in configs:
                if cfg is None:  # the dispatch: taken on CUDA for tuned shapes, never on the CPU
                    y = triton_gemv.gate_up_silu(x, w)
                    if device == "cpu":
                        assert y is None
                        continue
                else:
                    y = triton_gemv.gemv_silu(x, w, cfg)
                plain = None if cfg is None else (cfg[0] * 2, *cfg[1:])
                gu = triton_gemv.gemv(x, w, config=plain).float()
                g, u = gu[:, : n2 // 2], gu[:, n2 // 2:]
                ref = ((g / (1 + torch.exp(-g))).to(dtype).float() * u).to(dtype)
                assert y.shape == (1, n2 // 2) and y.dtype == dtype
                ulp = 2 ** -7 if dtype == torch.bfloat16 else 2 ** -10
                torch.testing.assert_close(y.float(), ref.float(), atol=1e-3, rtol=2 * ulp)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gate_up_silu_cuda():
    check_gate_up_silu("cuda", [(28672, 4096), (2 * 2000, 4096)],
                       configs=(None, (2, 1024, 8, 3), (8, 256, 4, 3)))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gemv_llama_shapes_cuda():
    check_gemv("cuda", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (1000, 4100)],
               configs=(None, (16, 256, 4, 3), (4, 1024, 4, 2)))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_every_per_gpu_config_cuda():
    # each GPU's measured configs at their own shapes (on whichever GPU this runs), bf16 and fp16
    from radixlm.runtime.layers import triton_gemv

    for shapes in triton_gemv.TUNED_BY_GPU.values():
        for shape, cfg in shapes.items():
            check_gemv("cuda", [shape], configs=(cfg,))
    for shapes in triton_gemv.SILU_BY_GPU.values():
        for shape, cfg in shapes.items():
            check_gate_up_silu("cuda", [shape], configs=(cfg,))
    # and the dispatch picks this GPU's entries (the lm_head shape: listed for the H200)
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    name = torch.cuda.get_device_name()
    want = triton_gemv.TUNED_BY_GPU.get(name, {}).get((128256, 4096))
    got = triton_gemv.tuned_config(128256, 4096, x.device)
    assert got == (want or triton_gemv.tuned_config(128256, 4096))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gemv_used_by_linear_only_for_one_row():
    from radixlm.runtime.layers import triton_gemv

    w = torch.randn(64, 32, device="cuda", dtype=torch.bfloat16)
    assert triton_gemv.supports(torch.randn(1, 32, device="cuda", dtype=torch.bfloat16), w)
    assert not triton_gemv.supports(torch.randn(2, 32, device="cuda", dtype=torch.bfloat16), w)
    assert not triton_gemv.supports(torch.randn(1, 32, device="cuda"), w.float())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_linear_dispatch():
    import torch.nn.functional as F

    from radixlm.runtime.layers import triton_gemv

    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    w_o = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16) / 64
    w_qkv = torch.randn(6144, 4096, device="cuda", dtype=torch.bfloat16) / 64
    w_small = torch.randn(1024, 2048, device="cuda", dtype=torch.bfloat16) / 64
    assert triton_gemv.tuned_config(4096, 4096) is not None
    assert triton_gemv.tuned_config(6144, 4096) is not None  # faster inside a CUDA graph
    assert triton_gemv.tuned_config(1024, 2048) is None  # never measured: cuBLAS
    torch.testing.assert_close(triton_gemv.linear(x, w_o), F.linear(x, w_o), atol=3e-2, rtol=2e-2)
    torch.testing.assert_close(triton_gemv.linear(x, w_qkv), F.linear(x, w_qkv), atol=3e-2, rtol=2e-2)
    xs = torch.randn(1, 2048, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(triton_gemv.linear(xs, w_small), F.linear(xs, w_small))
    x2 = torch.randn(2, 4096, device="cuda", dtype=torch.bfloat16)  # two rows: triton_skinny
    torch.testing.assert_close(triton_gemv.linear(x2, w_o), F.linear(x2, w_o), atol=3e-2,
                               rtol=2e-2)
    x17 = torch.randn(17, 4096, device="cuda", dtype=torch.bfloat16)  # 17 rows: cuBLAS
    assert torch.equal(triton_gemv.linear(x17, w_o), F.linear(x17, w_o))


def check_skinny(device, shapes, rows=(2, 5, 9, 16), dtypes=(torch.bfloat16, torch.float16),
                 configs=(None,)):
    """layers/triton_skinny against a float64 reference (fp32 sums, one rounding), its fused
    SiLU-and-mul against the same roundings in torch, and each row's value the same whatever
    rows share the call (no split-K, rows independent in the dot)."""
    from radixlm.runtime.layers import triton_skinny

    gen = torch.Generator().manual_seed(2)
    for n, k in shapes:
        for dtype in dtypes:
            ulp = 2 ** -7 if dtype == torch.bfloat16 else 2 ** -10
            w = (torch.randn(n, k, generator=gen) / k ** 0.5).to(device, dtype)
            b = torch.randn(n, generator=gen).to(device, dtype)
            for m in rows:
                x = torch.randn(m, k, generator=gen).to(device, dtype)
                for cfg in configs:
                    for bias in (None, b):
                        y = triton_skinny.matmul(x, w, bias, config=cfg)
                        ref = x.double() @ w.double().T + (0 if bias is None else bias.double())
                        assert y.shape == (m, n) and y.dtype == dtype
                        tol = 2 * ref.abs() * ulp + 1e-3
                        err = (y.double() - ref).abs()
                        assert bool((err <= tol).all()), (n, k, m, dtype, cfg, float(err.max()))
                        one = triton_skinny.matmul(x[-1:].contiguous(), w, bias, config=cfg)
                        assert torch.equal(one[0], y[-1]), (n, k, m, cfg)
                    if n % 2 == 0:
                        y = triton_skinny.matmul(x, w, config=cfg, silu=True)
                        gu = (x.double() @ w.double().T)
                        g = gu[:, : n // 2].to(dtype).double()
                        u = gu[:, n // 2:].to(dtype).double()
                        ref = ((g / (1 + torch.exp(-g))).to(dtype).double() * u).to(dtype)
                        assert y.shape == (m, n // 2)
                        torch.testing.assert_close(y.double(), ref.double(), atol=2e-3,
                                                   rtol=4 * ulp)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_skinny_llama_shapes_cuda():
    check_skinny("cuda", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336),
                          (1000, 4100), (2 * 5000, 4096)],
                 configs=(None, (16, 256, 4, 3), (32, 128, 8, 4)))
    from radixlm.runtime.layers import triton_skinny

    # the shipped configs fit the shared memory with the SiLU kernel's two weight tiles
    for n, k in [(6144, 4096), (2 * 5000, 4096), (28672, 4096), (128256, 4096)]:
        x = torch.randn(3, k, device="cuda", dtype=torch.bfloat16)
        w = torch.zeros(n, k, device="cuda", dtype=torch.bfloat16)
        triton_skinny.matmul(x, w, config=triton_skinny.tuned_config(n, k, silu=True), silu=True)
