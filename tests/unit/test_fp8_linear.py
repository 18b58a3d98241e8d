"""layers/fp8_linear.Fp8Linear on the CPU, through torch's CPU `_scaled_mm` (the same call as on
CUDA, rowwise scales, the weight as a column-major second operand): equal to its emulation
(x quantized per token to e4m3, dequantized operands, fp32 sum) and within the rigorous bound of
the dequantized reference. The GPU runs the same checks in tests/gpu/test_fp8.py."""

from __future__ import annotations

import pytest
import torch

from radixlm.runtime.layers import fp8_linear as F8

E4M3 = torch.float8_e4m3fn


def _layer(n=48, k=64, bias=False, per_channel=True, seed=0):
    torch.manual_seed(seed)
    lin = torch.nn.Linear(k, n, bias=bias)
    return lin, F8.Fp8Linear.from_linear(lin, per_channel)


def test_cpu_scaled_mm_supports_e4m3_rowwise():
    """What the CPU path relies on: torch's CPU _scaled_mm takes e4m3 operands with rowwise
    scales and an fp32 output, and computes (a * sa) @ (b * sb) exactly in fp32."""
    torch.manual_seed(0)
    a = (torch.randn(5, 32) * 4).to(E4M3)
    b = (torch.randn(16, 32) * 4).to(E4M3)
    sa, sb = torch.rand(5, 1) + 0.5, torch.rand(1, 16) + 0.5
    y = torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, out_dtype=torch.float32)
    want = (a.float() * sa) @ (b.float() * sb.t()).t()
    scale = (a.float().abs() * sa) @ (b.float().abs() * sb.t()).t()  # fp32 summation error ~
    assert bool(((y - want).abs() <= 1e-6 * scale).all())


def test_quantize_weight_roundtrip():
    w = torch.randn(32, 64) * torch.logspace(-2, 1, 32)[:, None]
    for per_channel in (True, False):
        q, s = F8.quantize_weight(w, per_channel)
        assert q.dtype == E4M3 and s.shape == ((32,) if per_channel else ())
        deq = F8.dequantize(q, s.expand(32) if not per_channel else s, torch.float32)
        rel = ((deq - w).abs() / w.abs().clamp(min=1e-30))
        big = w.abs() > (w.abs().amax(1, keepdim=True) if per_channel else w.abs().max()) / 64
        assert rel[big].max() <= 2.0 ** -4 + 1e-6  # e4m3: 3 mantissa bits, rounding to nearest
        assert deq.abs().max() <= w.abs().max() * (1 + 2.0 ** -4)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("per_channel", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_linear_is_its_emulation_and_within_bound(bias, per_channel, dtype):
    lin, m = _layer(bias=bias, per_channel=per_channel)
    if dtype != torch.float32:
        m.bias = None if m.bias is None else torch.nn.Parameter(m.bias.to(dtype), False)
    w = m.dequantized_weight()
    b = 0 if m.bias is None else m.bias.float()
    for rows in (1, 3, 40):
        x = (torch.randn(rows, 64) * torch.logspace(-2, 1, rows)[:, None]).to(dtype)
        y = m(x)
        assert y.dtype == dtype and y.shape == (rows, 48)
        xq, sx = F8.quantize_rows_torch(x)
        emu = (xq.float() * sx) @ w.t() + b
        rtol = 1e-5 if dtype == torch.float32 else 2 ** -8
        torch.testing.assert_close(y.float(), emu, rtol=rtol, atol=rtol * emu.abs().max())
        # the dequantized reference: each activation rounded by <= 2^-4 of itself
        ref = x.float() @ w.t() + b
        bound = 2.0 ** -4 * (x.float().abs() @ w.abs().t()) + rtol * ref.abs() + 1e-6
        assert bool(((y.float() - ref).abs() <= bound).all())


def test_fp8_linear_keeps_leading_dims_and_static_scale():
    _, m = _layer()
    x = torch.randn(2, 3, 64)
    assert m(x).shape == (2, 3, 48)
    torch.testing.assert_close(m(x), m(x.reshape(6, 64)).reshape(2, 3, 48))
    # static: every row quantized with the layer's input scale (the max over fused pieces)
    st = F8.Fp8Linear(64, 48, False, torch.float32, "cpu", static_input=True)
    st.weight.data.copy_(m.weight)
    st.weight_scale.data.copy_(m.weight_scale)
    st.input_scale.data[:24] = 0.01
    st.input_scale.data[24:] = 0.02
    st.finish_loading()
    assert st.input_scale_max.item() == pytest.approx(0.02)
    x2 = torch.randn(5, 64)
    xq = (x2 / 0.02).clamp(-448, 448).to(E4M3).float() * 0.02
    torch.testing.assert_close(st(x2), xq @ m.dequantized_weight().t(), rtol=1e-5, atol=1e-5)
    # saturation: values past 448 * scale clip, as the checkpoint's calibration intends
    big = torch.full((1, 64), 100.0)
    torch.testing.assert_close(st(big), torch.full((1, 64), 8.96) @ m.dequantized_weight().t(),
                               rtol=1e-5, atol=1e-4)


def test_fused_per_tensor_pieces_become_exact_row_scales():
    """q/k/v with their own per-tensor scales, fused: per-row scales reproduce each piece's
    dequantized weights exactly (no requantization to a shared scale)."""
    torch.manual_seed(3)
    pieces = [torch.randn(16, 32) * s for s in (0.1, 1.0, 7.0)]
    qs = [F8.quantize_weight(p, per_channel=False) for p in pieces]
    fused = F8.Fp8Linear(32, 48, False, torch.float32, "cpu")
    fused.weight.data.copy_(torch.cat([q for q, _ in qs]))
    fused.weight_scale.data.copy_(torch.cat([s.expand(16) for _, s in qs]))
    want = torch.cat([F8.dequantize(q, s.expand(16), torch.float32) for q, s in qs])
    assert torch.equal(fused.dequantized_weight(), want)


def test_finish_loading_refuses_bad_scales():
    _, m = _layer()
    m.weight_scale.data[3] = 0.0
    with pytest.raises(ValueError, match="weight_scale"):
        m.finish_loading()
    m.weight_scale.data[3] = float("nan")
    with pytest.raises(ValueError, match="weight_scale"):
        m.finish_loading()


def test_check_shapes_refuses_non_multiple_of_16_on_cuda_only():
    model = torch.nn.Module()
    model.layer = F8.Fp8Linear(24, 48, False, torch.float32, "cpu")
    F8.check_shapes(model, torch.device("cpu"))  # the CPU _scaled_mm takes any K
    with pytest.raises(ValueError, match="divisible by 16"):
        F8.check_shapes(model, torch.device("cuda"))
