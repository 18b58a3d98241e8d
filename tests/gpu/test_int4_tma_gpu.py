"""The Hopper batch-1 int4 kernels on CUDA (layers/int4_batch1.py picks them for Int4Linear):
the TMA GEMV (layers/triton_int4_tma.py) and the tensor-core one (layers/triton_int4_tc.py,
RADIXLM_INT4_TMA=tc): against the dequantized fp64 reference with tests/gpu/test_int4.py's
tolerance, the SiLU epilogue against the kernel's own plain output, split-K, act-order and a
bias through the layer, the derived operands refreshed in place after new weights, inside a
CUDA graph; the tensor-core kernel's packed (inline PTX) dequant gives the bits of its fp32
path. The check_* functions also run under Triton's interpreter on the CPU
(tests/unit/test_triton_int4_tma.py). Run with `pytest -m gpu tests/gpu/test_int4_tma_gpu.py`."""

from __future__ import annotations

import contextlib
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from test_int4 import _check_close, check_graph_replay, random_layer  # noqa: E402

pytestmark = pytest.mark.gpu


def _layer(device, n, k, group, dtype, bias=False, act_order=False, seed=0):
    from radixlm.runtime.layers import int4_linear

    qw, s, z, w = random_layer(n, k, group, seed=seed)
    lin = int4_linear.Int4Linear(k, n, group, bias, dtype, device, act_order=act_order)
    lin.qweight.copy_(qw), lin.scales.copy_(s), lin.zeros.copy_(z)
    if bias:
        lin.bias.data.copy_(torch.randn(n, generator=torch.Generator().manual_seed(seed)))
    if act_order:
        lin.perm.copy_(torch.randperm(k, generator=torch.Generator().manual_seed(k)))
    return lin


def check_int4_tma_kernel(device, cases, dtypes=(torch.bfloat16, torch.float16)) -> None:
    """triton_int4_tma.gemv at explicit configs: cases (rows, K, group, config, silu). Plain:
    against the reference; silu ([gate | up]): against the same kernel's plain output then
    SiLU-and-mul with the unfused path's roundings (test_int4.check_int4_gate_up_silu's)."""
    from radixlm.runtime.layers import triton_int4_tma as T

    for rows, k, group, cfg, silu in cases:
        assert T.supported(rows, k, group, cfg[0], cfg[1]), (rows, k, group, cfg)
        qw, s, z, w = random_layer(rows, k, group, seed=rows + k)
        qw, s, z = qw.to(device), s.to(device), z.to(device)
        st, zt = s.t().contiguous(), z.t().contiguous()
        descs = T.descriptors(qw, st, zt, group, cfg[0], cfg[1])
        for dt in dtypes:
            x = torch.randn(1, k, generator=torch.Generator().manual_seed(k)).to(dt)
            plain = T.gemv(x.to(device), descs, rows, k, group, config=cfg)
            _check_close(plain, x.float(), w, None, dt, (rows, k, group, cfg, dt))
            if silu:
                y = T.gemv(x.to(device), descs, rows // 2, k, group, silu=True, config=cfg)
                g, u = plain.float()[:, : rows // 2], plain.float()[:, rows // 2:]
                ref = ((g / (1 + torch.exp(-g))).to(dt).float() * u).to(dt)
                ulp = 2 ** -7 if dt == torch.bfloat16 else 2 ** -10
                torch.testing.assert_close(y.float(), ref.float(), atol=1e-3, rtol=2 * ulp)


@contextlib.contextmanager
def batch1_setting(value: str):
    """RADIXLM_INT4_TMA set to `value` for the block (layers/int4_batch1.py)."""
    from radixlm.runtime.layers import int4_batch1

    old = os.environ.get(int4_batch1.ENV_VAR)
    os.environ[int4_batch1.ENV_VAR] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(int4_batch1.ENV_VAR)
        else:
            os.environ[int4_batch1.ENV_VAR] = old


def check_int4_tc_kernel(device, cases, dtypes=(torch.bfloat16, torch.float16)) -> None:
    """triton_int4_tc.matmul (one row of x) at explicit configs, cases (rows, K, group, config,
    silu, act):
    against the reference (plain), the plain output then SiLU-and-mul (silu); on CUDA the
    packed dequant (asm) equal to the fp32 path bit for bit (the same exact (q - z) values)."""
    from radixlm.runtime.layers import triton_int4_tc as TC

    for rows, k, group, cfg, silu, act in cases:
        qw, s, z, w = random_layer(rows, k, group, seed=rows + k)
        qd = TC.descriptor(qw.to(device), group, cfg[0])
        zs = TC.pack_zs(s, z).to(device)
        perm = torch.randperm(k, generator=torch.Generator().manual_seed(k)) if act else None
        for dt in dtypes:
            x = torch.randn(1, k, generator=torch.Generator().manual_seed(k)).to(dt)
            # stored column c multiplies x[perm[c]] (triton_int4's act-order contract)
            xs = x[:, perm] if perm is not None else x
            pd = perm.to(device) if perm is not None else None
            plain = TC.matmul(x.to(device), qd, zs, rows, k, group, s.dtype, perm=pd, config=cfg)
            _check_close(plain, xs.float(), w, None, dt, (rows, k, group, cfg, dt))
            if device == "cuda":
                fp32_path = TC.matmul(x.to(device), qd, zs, rows, k, group, s.dtype, perm=pd,
                                    config=cfg, asm=False)
                assert torch.equal(plain, fp32_path), (rows, k, group, cfg, dt)
            if silu:
                y = TC.matmul(x.to(device), qd, zs, rows // 2, k, group, s.dtype, perm=pd,
                            silu=True, config=cfg)
                g, u = plain.float()[:, : rows // 2], plain.float()[:, rows // 2:]
                ref = ((g / (1 + torch.exp(-g))).to(dt).float() * u).to(dt)
                ulp = 2 ** -7 if dt == torch.bfloat16 else 2 ** -10
                torch.testing.assert_close(y.float(), ref.float(), atol=1e-3, rtol=2 * ulp)


def check_int4_tc_rows(device, cases, dtypes=(torch.bfloat16, torch.float16)) -> None:
    """triton_int4_tc.matmul over M rows, cases (rows, K, group, config, M, bias, act): against
    the reference with the GEMV's unrounded W, and each row's bits those of that row alone
    (a column of the dot is summed the same way whatever the others: batch invariance)."""
    from radixlm.runtime.layers import triton_int4_tc as TC

    for n, k, group, cfg, m, bias, act in cases:
        qw, s, z, w = random_layer(n, k, group, seed=n + k + m)
        qd = TC.descriptor(qw.to(device), group, cfg[0])
        zs = TC.pack_zs(s, z).to(device)
        perm = torch.randperm(k, generator=torch.Generator().manual_seed(k)) if act else None
        pd = perm.to(device) if perm is not None else None
        for dt in dtypes:
            gen = torch.Generator().manual_seed(m)
            x = torch.randn(m, k, generator=gen).to(dt)
            b = torch.randn(n, generator=gen).to(dt) if bias else None
            bd = b.to(device) if b is not None else None
            y = TC.matmul(x.to(device), qd, zs, n, k, group, s.dtype, bd, perm=pd, config=cfg)
            xs = x[:, perm] if perm is not None else x
            _check_close(y, xs.float(), w, b, dt, (n, k, group, cfg, m, dt), exact_w=True)
            for i in (0, m - 1):
                yi = TC.matmul(x[i:i + 1].to(device), qd, zs, n, k, group, s.dtype, bd,
                               perm=pd, config=cfg)
                assert torch.equal(yi, y[i:i + 1]), (n, k, group, cfg, m, dt, i)


def check_int4_tma_layer(device, dtype, n=64, k=1024, group=128, kind="1") -> None:
    """Int4Linear.use_tma under RADIXLM_INT4_TMA=kind: batch 1 on the kernel (act-order, a
    bias), batches of 3 and 64 on the GEMM (tma) or the same kernel (tc), gate_up_silu through
    it; new weights then use_tma again: the derived operands follow, in place."""
    with batch1_setting(kind):
        _check_layer(device, dtype, n, k, group)


def _check_layer(device, dtype, n, k, group) -> None:
    from radixlm.runtime.layers import triton_int4_tma as T

    lin = _layer(device, n, k, group, dtype, bias=True, act_order=True, seed=1)
    assert lin.use_tma() and lin.tma is not None
    st_ptr = lin.tma.derived[0].data_ptr()
    for m in (1, 3, 64):  # (the tensor-core kernel takes all three: the GEMV's sums)
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
        _check_close(lin(x.to(device)), x.float(), lin.dequantized_weight().cpu(),
                     lin.bias.cpu(), dtype, ("layer", m), exact_w=m == 1 or lin.tma.kind == "tc")
    other = _layer(device, n, k, group, dtype, seed=7)
    lin.qweight.copy_(other.qweight), lin.scales.copy_(other.scales)
    lin.zeros.copy_(other.zeros)
    assert lin.use_tma() and lin.tma.derived[0].data_ptr() == st_ptr
    x = torch.randn(1, k).to(dtype)
    _check_close(lin(x.to(device)), x.float(), lin.dequantized_weight().cpu(), lin.bias.cpu(),
                 dtype, "after new weights")
    gu = _layer(device, 2 * n, k, group, dtype, seed=3)
    assert gu.use_tma()
    y = gu.gate_up_silu(x.to(device))
    ref_parts = gu(x.to(device)).float()
    g, u = ref_parts[:, :n], ref_parts[:, n:]
    ref = ((g / (1 + torch.exp(-g))).to(dtype).float() * u).to(dtype)
    torch.testing.assert_close(y.float(), ref.float(), atol=1e-3, rtol=2 * 2 ** -7)
    # a shape no config fits (K = 96) stays on the register GEMV
    small = _layer(device, 32, 96, 32, dtype)
    assert not small.use_tma() and small.tma is None
    assert T.config_for(32, 96, 32) is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_int4_tma_layer_cuda(dtype):
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("TMA needs a Hopper or newer GPU")
    check_int4_tma_layer("cuda", dtype)
    check_int4_tma_layer("cuda", dtype, n=4096, k=14336, group=128)
    check_int4_tma_layer("cuda", dtype, n=256, k=1024, kind="tc")
    check_int4_tma_layer("cuda", dtype, n=4096, k=14336, group=128, kind="tc")


def test_int4_tc_kernel_cuda():
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("TMA needs a Hopper or newer GPU")
    # the default (128-row tiles, split-K picked), split-K 1 / 2 / 4 / 8 (o, down, gate_up),
    # groups 32 / 64, act-order, 64-row tiles
    check_int4_tc_kernel("cuda", [
        (6144, 4096, 128, (128, 4, 4, 2, 0), False, False),
        (4096, 14336, 128, (128, 4, 4, 2, 4), False, False),
        (28672, 4096, 128, (128, 4, 4, 2, 1), True, False),
        (28672, 4096, 128, (128, 4, 6, 2, 2), True, True),
        (4096, 4096, 32, (128, 8, 4, 2, 8), False, False),
        (1024, 2048, 64, (64, 4, 6, 3, 0), True, True)])


def test_int4_tma_kernel_cuda():
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("TMA needs a Hopper or newer GPU")
    # the default and fallbacks at the 8B's shapes, group 32 (4 groups a step), group 64 under
    # the SiLU epilogue; a box of each size (128-byte zero boxes: supported())
    check_int4_tma_kernel("cuda", [
        (6144, 4096, 128, (16, 1024, 4, 4, 2), False), (4096, 14336, 128, (32, 512, 4, 4, 2), False),
        (28672, 4096, 128, (16, 1024, 4, 4, 2), True), (4096, 4096, 32, (32, 128, 4, 3, 4), False),
        (1024, 2048, 64, (64, 128, 4, 3, 1), True), (4096, 4096, 128, (64, 256, 4, 6, 3), False)])


def test_int4_tc_rows_cuda():
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("TMA needs a Hopper or newer GPU")
    # decode batches of 2 / 16 / 17 / 64 rows (BLOCK_M 16 / 32 / 64), split-K, act-order, bias
    check_int4_tc_rows("cuda", [
        (4096, 4096, 128, (128, 4, 4, 2, 0), 64, True, False),
        (6144, 4096, 128, (128, 4, 4, 2, 0), 17, False, True),
        (28672, 4096, 128, (128, 8, 4, 2, 1), 16, False, False),
        (4096, 14336, 128, (128, 4, 6, 2, 4), 2, True, False)])


@pytest.mark.parametrize("kind", ["1", "tc"])
def test_int4_tma_in_cuda_graph(kind):
    """Descriptors are kernel parameters: a captured call replays on new inputs exactly (the
    tensor-core kernel with split-K: its counters reset by each call)."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("TMA needs a Hopper or newer GPU")
    with batch1_setting(kind):
        lin = _layer("cuda", 512, 4096, 128, torch.bfloat16)
        assert lin.use_tma() and lin.tma.kind == ("tc" if kind == "tc" else "tma")
        check_graph_replay(lin, torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16))
