"""The fused CPU elementwise ops (csrc/cpu_elementwise.cpp, layers/cpu_fused.py) against the torch
code they replace in models/llama.py and layers/rotary.py: RMSNorm with and without the residual
add, SiLU-and-mul, in-place rotary on a strided view of the fused qkv rows; fp32 / bf16 / fp16;
the model picks them on the CPU and `RADIXLM_CPU_FUSED_OPS=off` turns them off. The sampler's
argmax against torch.argmax exactly.

Tolerance: fp32 results within a few fp32 ulps (only the sum-of-squares order, the exp polynomial
and FMA contraction differ); bf16 / fp16 results equal torch's except for rare single roundings
(at most 1 in 1000 elements, each within one unit of the storage type's last place).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cpu_attention_ref import OPS, kernels_built  # noqa: F401 - autouse: needs the kernels
from radixlm.runtime.layers import cpu_fused
from radixlm.runtime.layers.rotary import RotaryEmbedding, apply_rotary

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
IDS = ["fp32", "bf16", "fp16"]


def _ref_norm(x, w, eps, res=None):  # models/llama.py RMSNorm's torch path
    if res is not None:
        x = x + res
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(x.dtype), x


def _assert_near(out, ref):
    assert out.dtype == ref.dtype and out.shape == ref.shape
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=4e-6, atol=1e-6)
        return
    eps = torch.finfo(out.dtype).eps
    diff = (out.float() - ref.float()).abs()
    assert int((diff > 0).sum()) <= max(1, out.numel() // 1000)
    assert bool((diff <= eps * ref.float().abs().clamp_min(1.0) * 2).all())


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("rows, n", [(1, 576), (37, 576), (300, 96), (5, 17)])
def test_rmsnorm_matches_torch(dtype, rows, n):
    g = torch.Generator().manual_seed(rows * 7 + n)
    x = torch.randn(rows, n, generator=g).to(dtype)
    res = torch.randn(rows, n, generator=g).to(dtype)
    w = (1 + 0.1 * torch.randn(n, generator=g)).to(dtype)
    _assert_near(cpu_fused.rmsnorm(x, w, 1e-5), _ref_norm(x, w, 1e-5)[0])
    out, s = cpu_fused.rmsnorm(x, w, 1e-5, res)
    ref, ref_s = _ref_norm(x, w, 1e-5, res)
    assert torch.equal(s, ref_s)  # the residual sum is one rounding of an exact fp32 sum
    _assert_near(out, ref)
    # a strided input (a column slice) and a 3-D input (Qwen3's per-head q/k norm)
    wide = torch.randn(rows, n + 8, generator=g).to(dtype)
    _assert_near(cpu_fused.rmsnorm(wide[:, 4:n + 4], w, 1e-6), _ref_norm(wide[:, 4:n + 4], w, 1e-6)[0])
    x3 = x.view(rows, 1, n)
    _assert_near(cpu_fused.rmsnorm(x3, w, 1e-5), _ref_norm(x3, w, 1e-5)[0])


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("rows, inter", [(1, 1536), (64, 1536), (3, 37)])
def test_silu_and_mul_matches_torch(dtype, rows, inter):
    g = torch.Generator().manual_seed(rows + inter)
    x = (3 * torch.randn(rows, 2 * inter, generator=g)).to(dtype)
    ref = F.silu(x[:, :inter]) * x[:, inter:]
    _assert_near(cpu_fused.silu_and_mul(x), ref)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("hq, hkv, d", [(9, 3, 64), (4, 2, 20)])
def test_rotary_inplace_on_the_qkv_view(dtype, hq, hkv, d):
    t = 33
    g = torch.Generator().manual_seed(hq * d)
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g).to(dtype)
    v_before = qkv[:, (hq + hkv) * d:].clone()
    cos, sin = RotaryEmbedding(d, 4096, 10000.0)(torch.randint(0, 4096, (t,), generator=g))
    qk = qkv[:, : (hq + hkv) * d].view(t, hq + hkv, d)  # row stride (hq + 2 hkv) d
    ref = apply_rotary(qk.clone(), cos, sin)
    assert cpu_fused.rotary_inplace(qk, cos, sin) is qk
    _assert_near(qk, ref)
    if dtype == torch.bfloat16 and d % 32 == 0 and torch.ops.radixlm_cpu.gemm_bf16_available():
        assert torch.equal(qk, ref)  # the AVX512-BF16 path: torch's steps, no FMA contraction
    assert torch.equal(qkv[:, (hq + hkv) * d:], v_before)  # v heads untouched


@pytest.mark.parametrize("rows, vocab", [(32, 49152), (1, 17), (5, 1000), (3, 16)])
def test_argmax_rows_matches_torch(rows, vocab):
    """The first maximum, ties and -inf rows included; a NaN row gives its first NaN as torch's
    argmax does; a strided view and a non-fp32 input (torch's path) too."""
    g = torch.Generator().manual_seed(rows * vocab)
    x = torch.randn(rows, vocab, generator=g)
    x[0, vocab // 2] = x[0, vocab - 1] = x[0].max() + 1  # a tie: the first one wins
    if rows > 2:
        x[1] = float("-inf")
        x[2, 3] = float("nan")
        x[2, vocab - 2] = float("nan")
        x[2, 1] = float("inf")
    assert torch.equal(cpu_fused.argmax_rows(x), x.argmax(dim=-1))
    wide = torch.randn(rows, 2 * vocab, generator=g)[:, ::2]  # stride 2: torch's path
    assert torch.equal(cpu_fused.argmax_rows(wide), wide.argmax(dim=-1))
    rowview = torch.randn(rows, vocab + 5, generator=g)[:, :vocab]  # row stride != vocab
    assert torch.equal(cpu_fused.argmax_rows(rowview), rowview.argmax(dim=-1))
    half = x.bfloat16()
    assert torch.equal(cpu_fused.argmax_rows(half), half.argmax(dim=-1))


def test_bad_input_is_refused_with_a_message():
    x = torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="weight must be"):
        cpu_fused.rmsnorm(x, torch.ones(7), 1e-5)
    with pytest.raises(ValueError, match="weight dtype"):
        cpu_fused.rmsnorm(x, torch.ones(8, dtype=torch.bfloat16), 1e-5)
    with pytest.raises(RuntimeError, match="head dim must be even"):
        cpu_fused.rotary_inplace(torch.randn(2, 1, 5), torch.zeros(2, 5), torch.zeros(2, 5))
    with pytest.raises(RuntimeError, match="unsupported dtype"):
        cpu_fused.silu_and_mul(torch.ones(2, 4, dtype=torch.float64))


def test_the_model_uses_them_on_the_cpu_and_the_switch_turns_them_off(monkeypatch):
    from radixlm.runtime.models import llama

    x = torch.randn(2, 8, dtype=torch.bfloat16)
    assert llama._fused_ops(x) is cpu_fused
    assert llama._fused_ops(x.double()) is None  # a dtype the kernels do not take: torch ops
    cpu_fused._kernels.cache_clear()
    monkeypatch.setenv(cpu_fused.ENV_VAR, "off")
    try:
        assert llama._fused_ops(x) is None
        monkeypatch.setenv(cpu_fused.ENV_VAR, "fast")
        cpu_fused._kernels.cache_clear()
        with pytest.raises(ValueError, match=cpu_fused.ENV_VAR):
            llama._fused_ops(x)
    finally:
        cpu_fused._kernels.cache_clear()
