"""The tensor-core int4 GEMV for 1-8 rows (layers/triton_int4_mma.py) on CUDA: against the
dequantized fp64 reference with tests/gpu/test_int4.py's tolerance (the unrounded weights: the
kernel sums (q - z) x exactly in fp32 a group, then scales), each row of a batch bit for bit its
own 1-row call, the SiLU epilogue against the kernel's own plain output with the unfused
roundings, act-order and a bias, the layer through RADIXLM_INT4_TMA=mma (layers/int4_batch1.py),
inside a CUDA graph. Its inline PTX does not run under Triton's interpreter: the layout's CPU
test is tests/unit/test_int4_mma_layout.py. Run with `pytest -m gpu tests/gpu/test_int4_mma_gpu.py`."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from test_int4 import _check_close, check_graph_replay, random_layer  # noqa: E402
from test_int4_tma_gpu import _layer, batch1_setting, check_int4_tma_layer  # noqa: E402

pytestmark = pytest.mark.gpu


def _need_sm90():
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the mma kernel's sub.bf16x2 needs sm_90 or newer")


def _operands(rows, k, group, seed):
    from radixlm.runtime.layers import int4_linear, int4_mma_layout

    qw, s, z, w = random_layer(rows, k, group, seed=seed)
    words = int4_mma_layout.pack(int4_linear.unpack_rows(qw)).cuda()
    return words, s.cuda(), z.cuda(), w


def check_mma_kernel(cases, dtypes=(torch.bfloat16, torch.float16)) -> None:
    """cases (rows, K, group, config, silu, bias, perm): M = 1, 3 and 8 against the reference;
    the 8-row batch's rows equal to their 1-row calls bit for bit; silu against the plain call."""
    from radixlm.runtime.layers import triton_int4_mma as MM

    for rows, k, group, cfg, silu, bias, perm in cases:
        words, s, z, w = _operands(rows, k, group, seed=rows + k + group)
        gen = torch.Generator().manual_seed(k)
        b = torch.randn(rows, generator=gen) if bias else None
        p = torch.randperm(k, generator=gen) if perm else None
        # x[:, p] @ W_stored^T: the stored columns are x's p-th (int4_linear's act-order)
        w_ref = torch.empty_like(w).index_copy_(1, p, w) if perm else w
        for dt in dtypes:
            x8 = torch.randn(8, k, generator=gen).to(dt)
            args = dict(perm=p.cuda() if perm else None, config=cfg)
            bias_dev = b.to(dt).cuda() if bias else None
            what = (rows, k, group, cfg, silu, bias, perm, dt)
            ys = {}
            for m in (1, 3, 8):
                y = MM.gemv(x8[:m].cuda(), words, s, z, group, bias_dev, **args)
                _check_close(y, x8[:m].float(), w_ref, b.to(dt).float() if bias else None, dt,
                             what + (m,), exact_w=True)
                ys[m] = y
            for i in range(8):  # batch invariance: row i alone gives the same bits
                yi = MM.gemv(x8[i:i + 1].cuda(), words, s, z, group, bias_dev, **args)
                assert torch.equal(yi[0], ys[8][i]), what + ("row", i)
            if silu:
                half = rows // 2
                for m in (1, 8):
                    y = MM.gemv(x8[:m].cuda(), words, s, z, group, silu=True, **args)
                    plain = ys[8][:m].float()
                    g, u = plain[:, :half], plain[:, half:]
                    ref = ((g / (1 + torch.exp(-g))).to(dt).float() * u).to(dt)
                    ulp = 2 ** -7 if dt == torch.bfloat16 else 2 ** -10
                    torch.testing.assert_close(y.float(), ref.float(), atol=1e-3, rtol=2 * ulp)


def test_int4_mma_kernel_cuda():
    _need_sm90()
    check_mma_kernel([
        (64, 1024, 128, (1, 4), False, False, False),
        (96, 512, 32, (1, 8), True, False, False),  # 3 tiles a half; 1 unit a warp or none
        (128, 768, 64, (2, 4), False, True, False),  # a bias, R 2; 12 units on 4 warps
        (64, 2048, 128, (1, 16), False, False, True),  # act-order
        (256, 4096, 32, (2, 8), True, False, False),  # SiLU at group 32
        (256, 4096, 64, (2, 8), False, True, False),
        (6144, 4096, 128, (1, 8), False, False, False),  # the 8B's shapes
        (28672, 4096, 128, (2, 8), True, False, False),
        (4096, 14336, 128, (1, 16), False, False, False),
        # two units of words in flight a warp (AHEAD 2): units past K on some warps
        (96, 512, 32, (1, 8, 2), True, False, False),
        (128, 768, 64, (2, 4, 2), False, True, False),
        (64, 2048, 128, (1, 4, 2), False, False, True),
        (28672, 4096, 128, (2, 4, 2), True, False, False),
        (4096, 14336, 128, (1, 8, 2), False, False, False),
    ])


def test_int4_mma_refuses_what_it_cannot_run():
    from radixlm.runtime.layers import triton_int4_mma as MM

    words, s, z, _ = _operands(64, 1024, 128, seed=0)
    x = torch.randn(9, 1024, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="int4 MMA GEMV"):
        MM.gemv(x, words, s, z, 128)  # 9 rows: B has 8 columns
    with pytest.raises(ValueError, match="int4 MMA GEMV"):
        MM.gemv(x[:1].float(), words, s, z, 128)  # fp32 activations


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_int4_mma_layer_cuda(dtype):
    _need_sm90()
    check_int4_tma_layer("cuda", dtype, kind="mma")
    check_int4_tma_layer("cuda", dtype, n=4096, k=14336, group=128, kind="mma")
    with batch1_setting("mma"):  # gate_up_silu for 4 rows (the register GEMV's is 1 row only)
        gu = _layer("cuda", 512, 1024, 128, dtype, seed=5)
        assert gu.use_tma() and gu.tma.kind == "mma"
        x = torch.randn(4, 1024, device="cuda", dtype=dtype)
        parts = gu(x).float()
        g, u = parts[:, :256], parts[:, 256:]
        ref = ((g / (1 + torch.exp(-g))).to(dtype).float() * u).to(dtype)
        torch.testing.assert_close(gu.gate_up_silu(x).float(), ref.float(), atol=1e-3,
                                   rtol=2 * 2 ** -7)


def test_int4_mma_in_cuda_graph():
    _need_sm90()
    with batch1_setting("mma"):
        lin = _layer("cuda", 512, 4096, 128, torch.bfloat16)
        assert lin.use_tma() and lin.tma.kind == "mma"
        check_graph_replay(lin, torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16))
        check_graph_replay(lin, torch.randn(5, 4096, device="cuda", dtype=torch.bfloat16))


def test_int4_mma_pdl_in_cuda_graph():
    """RADIXLM_PDL=1: RMSNorm -> GEMV -> GEMV (and 16 rows: the Triton GEMMs between) with
    programmatic dependent launch inside a CUDA graph gives the bits of the chain without it."""
    _need_sm90()
    from radixlm.runtime.layers import triton_ops

    with batch1_setting("mma"):
        a = _layer("cuda", 1024, 2048, 128, torch.bfloat16, seed=3)
        b = _layer("cuda", 2048, 1024, 64, torch.bfloat16, seed=4)
        assert a.use_tma() and b.use_tma()
        w = torch.rand(2048, device="cuda", dtype=torch.bfloat16) + 0.5

        def chain(x):  # batch 1 through the GEMVs, 16 rows through the Triton GEMMs
            h = triton_ops.rmsnorm(x, w, 1e-6)
            return b(a(h[:1])), b(a(h))

        x = torch.randn(16, 2048, device="cuda", dtype=torch.bfloat16)
        want = chain(x)
        old = os.environ.get(triton_ops.PDL_ENV)
        os.environ[triton_ops.PDL_ENV] = "1"
        try:
            chain(x)  # (compiled outside the capture)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                got = chain(x)
            for _ in range(3):
                g.replay()
            torch.cuda.synchronize()
        finally:
            if old is None:
                os.environ.pop(triton_ops.PDL_ENV)
            else:
                os.environ[triton_ops.PDL_ENV] = old
        assert all(torch.equal(p, q) for p, q in zip(want, got))


def test_int4_mma_pdl_engine_tokens(tmp_path):
    """A tiny int4 Llama in the Engine (CUDA graphs, decode on the mma GEMV) gives the same
    greedy tokens with RADIXLM_PDL=1 (every decode kernel launched with programmatic
    dependent launch) as without."""
    _need_sm90()
    import arch_parity as ap
    import int4_ckpt as ic

    from radixlm.runtime.layers import triton_ops

    model = ic.tiny_llama(hidden_size=256, intermediate_size=512, head_dim=64)
    ic.write_int4(model, str(tmp_path / "q"), ic.CASES["awq-g128"],
                  plain_path=str(tmp_path / "p"))
    prompts = ap.prompts(model[0]["vocab_size"])
    outs = {}
    old = os.environ.get(triton_ops.PDL_ENV)
    try:
        with batch1_setting("mma"):
            for flag in ("0", "1"):
                os.environ[triton_ops.PDL_ENV] = flag
                eng = ap.make_engine(str(tmp_path / "q"), device="cuda", dtype="bfloat16")
                try:
                    outs[flag] = [o["output_ids"] for o in ap.generate(eng, prompts)]
                    eng.wait_idle()
                    eng.check_integrity()
                finally:
                    eng.shutdown()
    finally:
        if old is None:
            os.environ.pop(triton_ops.PDL_ENV, None)
        else:
            os.environ[triton_ops.PDL_ENV] = old
    assert outs["0"] == outs["1"]
