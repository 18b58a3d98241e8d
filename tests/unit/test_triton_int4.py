"""The int4 Triton kernels (layers/triton_int4.py: the batch-1 GEMV and the batched GEMM) and the
Int4Linear layer on the CPU through Triton's interpreter, at small shapes, against the
dequantized fp64 reference with the tolerance stated in tests/gpu/test_int4.py (which runs the
same checks compiled on a GPU). fp16 / fp32 outputs only: the interpreter's fp32 -> bf16 store
truncates instead of rounding."""

from __future__ import annotations

import os

import pytest
import torch

from triton_interpreter import gpu_checks, import_interpreted  # tests/unit is on sys.path

triton_int4, triton_int4_gemm = import_interpreted("radixlm.runtime.layers.triton_int4",
                                                  "radixlm.runtime.layers.triton_int4_gemm",
                                                  gpu_tests="tests/gpu/test_int4.py")
_checks = gpu_checks("tests/gpu/test_int4.py")


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def test_int4_gemv_interpreted():
    # N not a multiple of BLOCK_N, group 32 / 64 / 128 and one group per row (K = 96: ragged
    # against BLOCK_K, a group that is not a power of two); steps over several groups
    _checks.check_int4_kernels("cpu", [(37, 256, 32, 1), (16, 512, 128, 1), (20, 96, 96, 1),
                                       (9, 256, 64, 1)], dtypes=(torch.float16,))
    _checks.check_int4_kernels("cpu", [(9, 128, 32, 1), (7, 256, 128, 1), (5, 352, 32, 1)],
                               dtypes=(torch.float32,),
                               gemv_configs=((4, 64, 4, 2), (2, 32, 2, 1), (16, 256, 4, 3),
                                             (4, 64, 4, 2, 1), (8, 32, 1, 3, 1)))


def test_int4_gemm_interpreted():
    # one group a step (group 256 / 128 >= BLOCK_K), several groups a step (32, 64 against
    # BLOCK_K 128), K ragged against BLOCK_K (96, 352; 192 at BLOCK_K 128), M and N ragged
    # against the tile (odd M, 33 > BLOCK_M 32); split-K (2 and 3 splits, a ragged last split;
    # the counters reset: every shape calls it more than once); BLOCK_K 32 / 64 / 128 (1, 2, 4
    # blocks a step); every second shape with a bias
    _checks.check_int4_kernels("cpu", [(37, 256, 32, 5), (16, 256, 128, 17), (20, 96, 96, 3),
                                       (24, 512, 256, 2), (11, 352, 32, 4), (40, 640, 128, 3),
                                       (13, 192, 64, 33)],
                               dtypes=(torch.float16, torch.float32),
                               gemm_configs=(None, (16, 32, 128, 4, 2), (16, 32, 128, 4, 2, 2),
                                             (16, 16, 128, 4, 2, 3), (32, 64, 64, 4, 2),
                                             (16, 32, 32, 4, 2, 2)))


@pytest.mark.parametrize("n,k,group,config,act", [
    (40, 96, 32, (16, 32, 64, 4, 2), False),  # K ragged against BLOCK_K, 2 groups a step
    (24, 256, 64, (32, 64, 128, 4, 2, 2), True),  # split-K, act-order
    (17, 384, 128, (16, 16, 128, 4, 2), True),  # one group a step, N ragged
    (8, 128, 32, None, False)])
def test_int4_gemm_tile_is_the_dequantized_weight(n, k, group, config, act):
    """Bit-exact: x = the identity (K rows) makes y = W^T, each value one product by 1 in
    fp32, so y must equal the dequantized weight in x's dtype (Int4Linear.dequantized_weight,
    checkpoint column order) exactly: every nibble at its row of the tile, the scale and zero
    of its group, the perm, one rounding to x's dtype. fp16 (the interpreter truncates bf16)."""
    from radixlm.runtime.layers import int4_linear

    qw, s, z, _ = _checks.random_layer(n, k, group, seed=n + k)
    lin = int4_linear.Int4Linear(k, n, group, False, torch.float16, "cpu", act_order=act)
    lin.qweight.copy_(qw), lin.scales.copy_(s), lin.zeros.copy_(z)
    perm = None
    if act:
        perm = torch.randperm(k, generator=torch.Generator().manual_seed(k))
        lin.perm.copy_(perm)
    x = torch.eye(k, dtype=torch.float16)
    y = triton_int4_gemm.gemm(x, qw, s, z, group, config=config, perm=perm)
    assert torch.equal(y, lin.dequantized_weight(torch.float16).t())


def test_int4_gemm_split_k_default_and_counters():
    """The default config splits K where tiles are few (N = 4096-like at small scale is not
    reachable here, so force it) and leaves every counter at zero after the call."""
    m, n, k = 4, 128, 2048
    cfg = triton_int4_gemm.gemm_config(m, 4096, 4096, 128)
    assert cfg[5] > 1 and cfg[1] == 64, cfg  # N = 4096 decode: split-K on
    assert triton_int4_gemm.gemm_config(m, 28672, 4096, 128)[5] == 1  # programs enough already
    _checks.check_int4_kernels("cpu", [(n, k, 128, m)], dtypes=(torch.float32,),
                               gemm_configs=((16, 32, 128, 4, 2, 4),))
    assert int(triton_int4_gemm._COUNTERS[torch.device("cpu")].abs().sum()) == 0


def test_int4_gemv_reads_every_nibble():
    """One code at a time: a 1 at column c of an otherwise all-8 (zero) layer must move y by
    exactly s * x[c]. Catches a nibble or block read from the wrong column (a layout error a
    random test could still pass within tolerance only by luck, never for all columns)."""
    from radixlm.runtime.layers import int4_linear

    n, k = 4, 64
    x = torch.randn(1, k, dtype=torch.float32)
    for c in range(k):
        q = torch.full((n, k), 8)
        q[1, c] = 9 + (c % 7)
        qw = int4_linear.pack_rows(q)
        s = torch.full((n, k // 32), 0.5, dtype=torch.float16)
        z = torch.full((n, k // 32), 8, dtype=torch.uint8)
        for fn, arg in ((triton_int4.gemv, x), (triton_int4_gemm.gemm, x.repeat(2, 1))):
            y = fn(arg, qw, s, z, 32)
            want = torch.zeros(n)
            want[1] = 0.5 * (1 + c % 7) * x[0, c]
            assert torch.allclose(y[0], want, atol=1e-6), (fn.__name__, c)


def test_pack_rows_layout():
    from radixlm.runtime.layers import int4_linear

    q = torch.randint(0, 16, (3, 96))
    w = int4_linear.pack_rows(q)
    assert w.shape == (3, 12) and w.dtype == torch.int32
    assert torch.equal(int4_linear.unpack_rows(w), q.to(torch.uint8))
    # nibble i of word 4b + j is column 32b + 4i + j (the layout triton_int4 reads)
    b, i, j = 2, 7, 3
    assert int((w[1, 4 * b + j] >> (4 * i)) & 0xF) == int(q[1, 32 * b + 4 * i + j])


def test_int4_gate_up_silu_interpreted():
    """The GEMV's SiLU-and-mul epilogue (the MLP's batch-1 int4 gate_up), act-order too."""
    _checks.check_int4_gate_up_silu("cpu", [(2 * 37, 256, 64), (2 * 8, 96, 96)],
                                    dtypes=(torch.float16,))
    _checks.check_int4_gate_up_silu("cpu", [(2 * 24, 128, 32)], dtypes=(torch.float16,),
                                    act_order=True)


def test_int4_layer_interpreted():
    """Act-order permutation of x (read by the kernels through perm), bias, GEMV and GEMM
    through Int4Linear.forward."""
    _checks.check_int4_layer("cpu", torch.float32, ms=(1, 4))
    _checks.check_int4_layer("cpu", torch.float16, ms=(1, 4))


@pytest.mark.parametrize("fmt", ["awq-g128", "gptq-v1-asym-act-g64", "gptq-v2-sym-act-g128",
                                 "ct-asym-g32"])
def test_int4_formats_repacked_interpreted(fmt):
    """Each checkpoint format (tests/unit/int4_ckpt.py) read and repacked by from_weights, then
    the kernels (GEMV and GEMM) against the format's own dequantized weight."""
    import int4_ckpt as ic

    from radixlm.runtime.layers import int4_linear
    from radixlm.runtime.models import int4_config, int4_formats

    c = ic.CASES[fmt]
    k, n = 256, 40
    g_idx = ic.act_g_idx(k, c.group, seed=3) if c.act else None
    q, z, s = ic.quantize(torch.randn(n, k) * 0.05, c, g_idx, torch.float16)
    t = ic.pack(c, q, z, s, g_idx, torch.float16)
    scheme = int4_config.parse({"quantization_config": ic.quantization_config(c)})
    piece = int4_formats.read(scheme, "l", lambda sfx: t.get(sfx))
    lin = int4_linear.Int4Linear.from_weights([piece], False, torch.float32, "cpu")
    w = piece.dequantize(torch.float32)
    for m in (1, 3):
        x = torch.randn(m, k)
        _checks._check_close(lin(x), x, w, None, torch.float32, (fmt, m))


def test_llama_mlp_takes_the_int4_silu_gemv(monkeypatch):
    """llama's MLP at batch 1 runs an int4 gate_up through gate_up_silu (one launch) and gives
    the unfused result (the plain int4 GEMV, then SiLU-and-mul with the same roundings)."""
    from torch import nn

    from radixlm.runtime.layers import int4_linear
    from radixlm.runtime.models import llama

    torch.manual_seed(0)
    mlp = llama.MLP.__new__(llama.MLP)
    nn.Module.__init__(mlp)
    mlp.inter = 64
    mlp.gate_up_proj = int4_linear.Int4Linear.quantize(torch.randn(128, 96) * 0.2, 32)
    mlp.down_proj = int4_linear.Int4Linear.quantize(torch.randn(96, 64) * 0.2, 32)
    calls = []
    real = int4_linear.Int4Linear.gate_up_silu
    monkeypatch.setattr(int4_linear.Int4Linear, "gate_up_silu",
                        lambda self, x: calls.append(x.shape) or real(self, x))
    x = torch.randn(1, 96).half()
    y = mlp(x)
    assert calls == [(1, 96)]
    gu = mlp.gate_up_proj(x).float()
    g, u = gu[:, :64], gu[:, 64:]
    ref = mlp.down_proj(((g / (1 + torch.exp(-g))).half().float() * u).half())
    torch.testing.assert_close(y.float(), ref.float(), atol=1e-3, rtol=2 ** -9)


def test_gemm_sweep_covers_the_defaults():
    """benchmarks/int4_decode.py --kernels times gemm_sweep's configs against the default: the
    default must be one of them at each batch bucket and projection shape (else the "best" the
    sweep reports could never be the default), and the grid spans every tile dimension."""
    import sys

    root = os.path.join(os.path.dirname(__file__), "..", "..")
    sys.path.insert(0, root)
    try:
        from benchmarks.int4_gemm_sweep import GEMM_TILES, gemm_sweep
    finally:
        sys.path.remove(root)
    for m in (2, 16, 17, 33, 64, 128, 512):
        for n, k in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)):
            cfg = triton_int4_gemm.gemm_config(m, n, k, 128)
            assert cfg in gemm_sweep(m, n, k), (m, n, k, cfg)
    for i, want in enumerate(({16, 32, 64}, {64, 128, 256}, {64, 128}, {4, 8}, {2, 3, 4})):
        assert {t[i] for t in GEMM_TILES} == want


@pytest.mark.parametrize("silu,act", [(False, False), (False, True), (True, True)])
def test_int4_gemv_prefetch_is_bit_identical(silu, act):
    """PREFETCH (a step's scales and zeros loaded one step ahead; 2: the words too) only moves
    loads: the GEMV's result must be the same bits at 0, 1 and 2 (ragged K: 352 = 2.75 steps
    of 128; several groups a step; act-order; the SiLU epilogue's two row sets)."""
    n, k, group = 24, 352, 32
    qw, s, z, _ = _checks.random_layer(n, k, group, seed=11)
    perm = torch.randperm(k, generator=torch.Generator().manual_seed(1)) if act else None
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(2))
    b = None if silu else torch.randn(n)
    for base in ((4, 128, 4, 2), (8, 64, 1, 3)):
        ys = [triton_int4.gemv(x, qw, s, z, group, b, config=base + pf, perm=perm, silu=silu)
              for pf in ((), (1,), (2,))]
        assert torch.equal(ys[0], ys[1]) and torch.equal(ys[0], ys[2]), base


# split-K GEMV configs (BLOCK_N, BLOCK_K, warps, stages, PREFETCH, SPLIT_K): splits of one
# and of several steps, a ragged last split, splits that cannot all get a step (5 steps in
# 4: 3 splits of 2), prefetch across a split's end (scales and zeros; the words too, PREFETCH
# 2), one-shot (stages 1) and pipelined
GEMV_SPLIT_CONFIGS = ((4, 64, 4, 2, 0, 2), (2, 32, 1, 1, 2, 3), (8, 64, 2, 1, 1, 4),
                      (16, 128, 4, 3, 0, 2), (1, 32, 1, 1, 0, 16))


def test_int4_gemv_split_k_interpreted():
    """Split-K against the fp64 reference: N ragged against BLOCK_N, K ragged against BLOCK_K
    (352 = 11 blocks, 160 = 5, 96 = one group a row), groups 32 / 64 / 128, a bias on every
    second shape; and every counter back at zero after the calls."""
    for shapes, cfgs in (([(37, 256, 32, 1), (20, 96, 96, 1)], GEMV_SPLIT_CONFIGS[:1]),
                         ([(5, 352, 32, 1), (6, 160, 32, 1)], GEMV_SPLIT_CONFIGS[1:3]),
                         ([(9, 512, 128, 1), (7, 384, 64, 1)], GEMV_SPLIT_CONFIGS[2:4]),
                         ([(3, 512, 128, 1)], GEMV_SPLIT_CONFIGS[4:])):
        _checks.check_int4_kernels("cpu", shapes, dtypes=(torch.float32,), gemv_configs=cfgs)
    _checks.check_int4_kernels("cpu", [(11, 352, 32, 1)], dtypes=(torch.float16,),
                               gemv_configs=GEMV_SPLIT_CONFIGS[1:2])
    assert int(triton_int4._COUNTERS[torch.device("cpu")].abs().sum()) == 0


@pytest.mark.parametrize("silu", [False, True])
def test_int4_gemv_split_k_act_order(silu):
    """Split-K with act-order (x read through perm) against the reference, and with the SiLU
    epilogue (each split's gate and up partials) against the plain GEMV + SiLU-and-mul with
    the same roundings; a split-K call twice gives the same bits (the sum in split order)."""
    n, k, group = 12, 160, 32  # 5 blocks: 3 splits of (2, 2, 1) at the second config
    qw, s, z, w = _checks.random_layer(n, k, group, seed=5)
    perm = torch.randperm(k, generator=torch.Generator().manual_seed(3))
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(4)).half()
    for cfg in ((4, 64, 4, 2, 0, 2), (2, 32, 1, 1, 2, 2)):
        y = triton_int4.gemv(x, qw, s, z, group, config=cfg, perm=perm, silu=silu)
        assert torch.equal(y, triton_int4.gemv(x, qw, s, z, group, config=cfg, perm=perm,
                                               silu=silu)), cfg
        if not silu:
            _checks._check_close(y, x.float()[:, perm], w, None, torch.float16, cfg)
            continue
        gu = triton_int4.gemv(x, qw, s, z, group, config=cfg, perm=perm).float()
        g, u = gu[:, : n // 2], gu[:, n // 2:]
        ref = ((g / (1 + torch.exp(-g))).half().float() * u).half()
        torch.testing.assert_close(y.float(), ref.float(), atol=1e-3, rtol=2 * 2 ** -10)


def test_int4_gemv_split_k_reads_every_nibble():
    """The one-code-at-a-time check of test_int4_gemv_reads_every_nibble through split-K
    programs of one block each (a block read by the wrong split would be missed or doubled)."""
    from radixlm.runtime.layers import int4_linear

    n, k = 2, 128
    x = torch.randn(1, k, dtype=torch.float32)
    for c in range(0, k, 5):
        q = torch.full((n, k), 8)
        q[1, c] = 9 + (c % 7)
        s = torch.full((n, k // 32), 0.5, dtype=torch.float16)
        z = torch.full((n, k // 32), 8, dtype=torch.uint8)
        y = triton_int4.gemv(x, int4_linear.pack_rows(q), s, z, 32, config=(2, 32, 1, 1, 0, 4))
        want = torch.zeros(n)
        want[1] = 0.5 * (1 + c % 7) * x[0, c]
        assert torch.allclose(y[0], want, atol=1e-6), c


def test_gemv_sweep_covers_the_defaults():
    """benchmarks/int4_gemv_sweep.py times the default first at each projection shape (its
    "best" can be the default), keeps warps = BLOCK_K / 1024 (gemv_config's layout rule) and
    spans every knob: stages 1 / 2 / 4, prefetch 0 / 1 / 2, split-K off and on, and the
    streaming knobs (cache hints, unroll, register caps, persistent programs, LEAN)."""
    import sys

    root = os.path.join(os.path.dirname(__file__), "..", "..")
    sys.path.insert(0, root)
    try:
        from benchmarks.int4_gemv_sweep import SHAPES, gemv_sweep
    finally:
        sys.path.remove(root)
    for n, k, _ in SHAPES.values():
        cfgs = gemv_sweep(n, k)
        assert cfgs[0] == triton_int4.gemv_config(n, k) and len(set(cfgs)) == len(cfgs)
        assert all(c[2] == c[1] // 1024 for c in cfgs), (n, k)
        assert {c[3] for c in cfgs} >= {1, 2, 4} and {c[4] for c in cfgs} == {0, 1, 2}
        assert {c[5] > 1 for c in cfgs} == {False, True} and len(cfgs) <= 200
        knobs = [triton_int4._gemv_knobs(c)[6:] for c in cfgs]  # (all well formed)
        assert {kn[0] for kn in knobs} == {0, 1, 2} and {kn[1] for kn in knobs} == {1, 2}
        assert {kn[2] > 0 for kn in knobs} == {kn[3] > 0 for kn in knobs} == {False, True}
        assert {kn[4] for kn in knobs} == {False, True}
