"""The int4 wgmma GEMM for 9-64 rows (layers/gluon_int4_gemm.py) on a Hopper GPU: against the
dequantized fp64 reference with the GEMV's tolerance (its sums: (q - z) x exactly in fp32 a
group, then the scale), each row bit for bit the same whatever the rows beside it in its batch
tile, split-K, act-order, a bias, fp16, and inside a CUDA graph. Gluon does not run under
Triton's interpreter; its layouts are checked at compile time (the conversion of the dequantized
words into wgmma's A registers is asserted trivial). Run with `pytest -m gpu
tests/gpu/test_int4_wgmma_gemm_gpu.py`."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from test_int4 import _check_close, check_graph_replay  # noqa: E402
from test_int4_mma_gpu import _need_sm90, _operands  # noqa: E402
from test_int4_tma_gpu import _layer, batch1_setting  # noqa: E402

pytestmark = pytest.mark.gpu


def check_wgmma_gemm(cases, ms=(9, 16, 17, 40, 64), dtypes=(torch.bfloat16, torch.float16)):
    """cases (rows, K, group, config, bias, perm): each M against the reference; the 64-row
    batch's first 9 rows equal to the 9-row call's (both BM 16 / 64 tiles: a column of the MMA
    is its own)."""
    from radixlm.runtime.layers import gluon_int4_gemm as GG

    for rows, k, group, cfg, bias, perm in cases:
        words, s, z, w = _operands(rows, k, group, seed=rows + k + group)
        gen = torch.Generator().manual_seed(k + 1)
        b = torch.randn(rows, generator=gen) if bias else None
        p = torch.randperm(k, generator=gen) if perm else None
        w_ref = torch.empty_like(w).index_copy_(1, p, w) if perm else w
        for dt in dtypes:
            x = torch.randn(max(ms), k, generator=gen).to(dt)
            args = dict(perm=p.cuda() if perm else None, config=cfg)
            bias_dev = b.to(dt).cuda() if bias else None
            ys = {}
            for m in ms:
                what = (rows, k, group, cfg, bias, perm, dt, m)
                y = GG.gemm(x[:m].cuda(), words, s, z, group, bias_dev, **args)
                assert y.shape == (m, rows) and y.dtype == dt
                _check_close(y, x[:m].float(), w_ref, b.to(dt).float() if bias else None, dt,
                             what, exact_w=True)
                ys[m] = y
            if 9 in ys and 64 in ys:
                assert torch.equal(ys[9], ys[64][:9]), (rows, k, group, cfg, dt)


def test_int4_wgmma_gemm_kernel():
    """configs: (WARPS, RREP, STEP, SPLIT_K, MAXNREG, ASYNC)."""
    _need_sm90()
    check_wgmma_gemm([
        (64, 1024, 128, (4, 1), False, False),  # STEP 64: two MMAs a group
        (128, 512, 32, (4, 2), True, False),  # RREP 2; a group of 32 (STEP 32)
        (256, 768, 64, (8, 1), False, False),
        (128, 2048, 128, (4, 1, 128, 4), True, True),  # one MMA a group, split-K 4, act-order
        (256, 4096, 32, (8, 1, 32, 2), False, False),
        (512, 2048, 128, (8, 1, 64, 2, 128), False, False),  # a register cap
        # a group's MMAs in flight (ASYNC): 4 steps of 32 k, 2 of 64, act-order, split-K
        (256, 2048, 128, (8, 1, 32, None, None, 1), True, False),
        (128, 1024, 64, (4, 1, 32, 2, None, 1), False, True),
        (512, 2048, 128, (8, 1, 64, 4, 128, 1), False, False),
        (6144, 4096, 128, None, False, False),  # the 8B's shapes at the default config
        (4096, 14336, 128, None, False, False),
    ], ms=(9, 16, 17, 40, 64))


def test_int4_wgmma_gemm_batch_tiles():
    """Past 64 rows: tiles of 64 (a grid axis), the last one partial; split-K counters a tile."""
    _need_sm90()
    check_wgmma_gemm([(256, 2048, 128, None, True, False),
                      (512, 1024, 64, (8, 1, 64, 2, 128, 1), False, True)],
                     ms=(65, 100, 192), dtypes=(torch.bfloat16,))


def test_int4_wgmma_gemm_odd_splits():
    """A split count that does not divide the groups (the last split is short)."""
    _need_sm90()
    check_wgmma_gemm([(64, 1792, 128, (4, 1, 64, 4), False, False)], ms=(12, 64),
                     dtypes=(torch.bfloat16,))


def test_int4_wgmma_gemm_refuses_what_it_cannot_run():
    from radixlm.runtime.layers import gluon_int4_gemm as GG

    words, s, z, _ = _operands(64, 1024, 128, seed=0)
    x = torch.randn(65, 1024, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="int4 wgmma GEMM"):
        GG.gemm(x[:16].float(), words, s, z, 128)  # fp32 activations
    with pytest.raises(ValueError, match="int4 wgmma GEMM"):
        GG.gemm(x[:16], words, s, z, 128, config=(8, 1))  # 64 rows: not a 128-row program
    with pytest.raises(ValueError, match="int4 wgmma GEMM"):
        GG.gemm(x[:16], words, s, z, 64, config=(4, 1, 128))  # a step past the group


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_int4_wgmma_gemm_layer(dtype):
    """Int4Linear under the Hopper defaults: 9-64 rows through the wgmma GEMM (act-order, a
    bias) against the reference, RADIXLM_INT4_WGMMA=0 sending them to the Triton GEMM, and the
    layer inside a CUDA graph (split-K counters allocated before the capture)."""
    _need_sm90()
    from radixlm.runtime.layers import int4_batch1

    with batch1_setting("mma"):
        lin = _layer("cuda", 256, 2048, 128, dtype, bias=True, act_order=True, seed=2)
        assert lin.use_tma() and lin.tma.kind == "mma"
        w = lin.dequantized_weight()
        for m in (9, 24, 64):
            x = torch.randn(m, 2048, device="cuda", dtype=dtype)
            assert lin.tma.takes_gemm(lin, x)
            _check_close(lin(x), x.float().cpu(), w.cpu(), lin.bias.float().cpu(), dtype,
                         ("layer", m, dtype), exact_w=True)
        old = os.environ.get(int4_batch1.WGMMA_ENV)
        os.environ[int4_batch1.WGMMA_ENV] = "0"
        try:
            assert not lin.tma.takes_gemm(lin, x)
        finally:
            if old is None:
                os.environ.pop(int4_batch1.WGMMA_ENV)
            else:
                os.environ[int4_batch1.WGMMA_ENV] = old
        check_graph_replay(lin, torch.randn(33, 2048, device="cuda", dtype=dtype))
