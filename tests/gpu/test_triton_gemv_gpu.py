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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gemv_llama_shapes_cuda():
    check_gemv("cuda", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (1000, 4100)],
               configs=(None, (16, 256, 4, 3), (4, 1024, 4, 2)))


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
    x2 = torch.randn(2, 4096, device="cuda", dtype=torch.bfloat16)  # two rows: cuBLAS
    assert torch.equal(triton_gemv.linear(x2, w_o), F.linear(x2, w_o))
