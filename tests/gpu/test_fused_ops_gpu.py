"""The fused Llama-layer ops of layers/triton_ops.py (residual add + RMSNorm, in-place rotary,
SiLU-and-mul) against llama.py's / rotary.py's plain torch ops: compiled on a CUDA GPU here, at the
Llama-3.1-8B layer shapes and at odd small ones (`pytest -m gpu tests/gpu`); `check_ops` also runs
on the CPU through Triton's interpreter (tests/unit/test_triton_ops.py)."""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = pytest.mark.gpu


def check_ops(dtype, device, t=5, hidden=96, hq=4, hkv=2, d=16, inter=80):
    from radixlm.runtime.layers import triton_ops
    from radixlm.runtime.layers.rotary import RotaryEmbedding, apply_rotary
    from radixlm.runtime.models.llama import RMSNorm

    torch.manual_seed(0)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    norm = RMSNorm(hidden, 1e-5).to(device, dtype)
    norm.weight.data.normal_(1.0, 0.1)
    x = torch.randn(t, 2 * hidden, device=device).to(dtype)[:, :hidden]  # strided rows
    r = torch.randn(t, hidden, device=device).to(dtype)
    torch.testing.assert_close(triton_ops.rmsnorm(x, norm.weight, 1e-5), norm._norm(x), **tol)
    out, s = triton_ops.rmsnorm(x, norm.weight, 1e-5, r)
    # the residual stream is exact when compiled; the interpreter's fp32 -> bf16 cast truncates
    exact = dtype == torch.float32 or device == "cuda"
    torch.testing.assert_close(s, x + r, **(dict(atol=0, rtol=0) if exact else tol))
    torch.testing.assert_close(out, norm._norm(x + r), **tol)

    rope = RotaryEmbedding(d, 64, 10000.0, device=device)
    pos = torch.randint(0, 64, (t,), generator=torch.Generator().manual_seed(t)).to(device)
    cos, sin = rope(pos)
    qkv = torch.randn(t, (hq + 2 * hkv) * d, device=device).to(dtype)
    ref_q = apply_rotary(qkv[:, : hq * d].reshape(t, hq, d), cos, sin)
    ref_k = apply_rotary(qkv[:, hq * d:(hq + hkv) * d].reshape(t, hkv, d), cos, sin)
    v_before = qkv[:, (hq + hkv) * d:].clone()
    triton_ops.rotary_inplace(qkv[:, : (hq + hkv) * d].view(t, hq + hkv, d), cos, sin)
    torch.testing.assert_close(qkv[:, : hq * d].reshape(t, hq, d), ref_q, **tol)
    torch.testing.assert_close(qkv[:, hq * d:(hq + hkv) * d].reshape(t, hkv, d), ref_k, **tol)
    assert torch.equal(qkv[:, (hq + hkv) * d:], v_before)  # v untouched

    # rotary + KV-pool store in one launch: q/k rotated as above, k and v written at their slots
    qkv2 = qkv.clone()
    qkv2[:, : (hq + hkv) * d] = torch.randn(t, (hq + hkv) * d, device=device).to(dtype)
    ref3 = qkv2.clone().view(t, hq + 2 * hkv, d)
    triton_ops.rotary_inplace(ref3[:, : hq + hkv], cos, sin)
    slots = 2 * t + 3
    k_buf = torch.zeros(slots, hkv, d, device=device, dtype=dtype)
    v_buf = torch.zeros_like(k_buf)
    loc = torch.randperm(slots, generator=torch.Generator().manual_seed(1))[:t].to(device)
    triton_ops.rotary_store_kv(qkv2.view(t, hq + 2 * hkv, d), cos, sin, hq, hkv, k_buf, v_buf, loc)
    assert torch.equal(qkv2.view(t, hq + 2 * hkv, d), ref3)  # same kernel math as rotary_inplace
    assert torch.equal(k_buf[loc], ref3[:, hq : hq + hkv]) and torch.equal(v_buf[loc], ref3[:, hq + hkv :])
    untouched = torch.ones(slots, dtype=torch.bool)
    untouched[loc.cpu()] = False
    assert not k_buf[untouched.to(device)].any() and not v_buf[untouched.to(device)].any()

    gu = torch.randn(t, 2 * inter, device=device).to(dtype) * 3
    ref = torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]
    torch.testing.assert_close(triton_ops.silu_and_mul(gu), ref, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("shape", [dict(t=1, hidden=4096, hq=32, hkv=8, d=128, inter=14336),
                                   dict(t=300, hidden=96, hq=4, hkv=2, d=16, inter=80)],
                         ids=["8b-bs1", "small"])
def test_fused_ops_match_torch_on_cuda(dtype, shape):
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("compiled kernels only")
    check_ops(dtype, "cuda", **shape)


def check_rope_pairs(dtype, device, t=5, h=3, d=16):
    """DeepSeek's rope kernel against apply_rope's torch math, both pair layouts, strided
    inputs (a split of a wider projection, a single head unsqueezed)."""
    from radixlm.runtime.layers import triton_ops
    from radixlm.runtime.models import deepseek_rope

    torch.manual_seed(1)
    tol = dict(atol=1e-6, rtol=1e-6) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    cos = torch.randn(t, 1, d // 2, device=device)
    sin = torch.randn(t, 1, d // 2, device=device)
    q = torch.randn(t, h, 8 + d, device=device).to(dtype)[:, :, 8:]  # (T, H, d) strided
    kv = torch.randn(t, 24 + d, device=device).to(dtype)[:, 24:]  # (T, d) of a wider row
    for interleaved in (True, False):
        for x in (q, kv.unsqueeze(1)):
            ref = deepseek_rope.apply_rope(x.cpu(), cos.cpu(), sin.cpu(), interleaved)
            got = triton_ops.rope_pairs(x, cos, sin, interleaved)
            assert got.shape == x.shape and got.dtype == dtype and got.is_contiguous()
            torch.testing.assert_close(got.cpu(), ref, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rope_pairs_match_torch(dtype):
    check_rope_pairs(dtype, "cuda")


def check_mla_latent_store(dtype, device, t=5, r=24, dr=16):
    """MLA's latent written straight into its pool (triton_ops.mla_latent_store) against the
    torch path: kv_a_layernorm, rope of k_pe, cat, index_copy at the slots; other slots stay."""
    from radixlm.runtime.layers import triton_ops
    from radixlm.runtime.models import deepseek_rope
    from radixlm.runtime.models.llama import RMSNorm

    torch.manual_seed(2)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    norm = RMSNorm(r, 1e-6).to(device, dtype)
    norm.weight.data.normal_(1.0, 0.1)
    kv = torch.randn(t, 8 + r + dr, device=device).to(dtype)[:, 8:]  # strided rows
    cos = torch.randn(t, 1, dr // 2, device=device)
    sin = torch.randn(t, 1, dr // 2, device=device)
    loc = torch.randperm(2 * t + 1, generator=torch.Generator().manual_seed(3))[:t].to(device)
    for interleaved in (True, False):
        buf = torch.full((2 * t + 1, 1, r + dr), 7.0, device=device, dtype=dtype)
        triton_ops.mla_latent_store(kv, r, norm.weight, norm.eps, cos, sin, interleaved, buf, loc)
        c_kv, k_pe = kv.cpu().split([r, dr], dim=-1)
        k_pe = deepseek_rope.apply_rope(k_pe.unsqueeze(1), cos.cpu(), sin.cpu(), interleaved)[:, 0]
        ref = torch.cat((norm.cpu()._norm(c_kv), k_pe), dim=-1)
        norm.to(device)
        torch.testing.assert_close(buf[loc][:, 0].cpu(), ref, **tol)
        others = torch.ones(2 * t + 1, dtype=torch.bool)
        others[loc.cpu()] = False
        assert torch.all(buf.cpu()[others] == 7.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_mla_latent_store_matches_torch(dtype):
    check_mla_latent_store(dtype, "cuda")
