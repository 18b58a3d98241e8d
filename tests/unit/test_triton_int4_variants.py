"""The int4 GEMV's streaming variants (layers/triton_int4.gemv configs past SPLIT_K: CACHE,
UNROLL, MAXNREG, LEAN; PERSIST: layers/triton_int4_stream.py) on the CPU through Triton's
interpreter, at small shapes: the same bits as the plain config (tests/gpu/
test_int4_gemv_variants.py states why and runs the check compiled), the persistent kernel
against the fp64 reference, and the config's checks. The interpreter ignores cache hints,
register caps and the unroll factor: what those change in the generated code is checked by
tests/unit/test_triton_int4_compile.py."""

from __future__ import annotations

import pytest
import torch

from triton_interpreter import gpu_checks, import_interpreted  # tests/unit is on sys.path

triton_int4, triton_int4_stream = import_interpreted(
    "radixlm.runtime.layers.triton_int4", "radixlm.runtime.layers.triton_int4_stream",
    gpu_tests="tests/gpu/test_int4_gemv_variants.py")
_checks = gpu_checks("tests/gpu/test_int4_gemv_variants.py")


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.mark.parametrize("silu,act,k,base,dtype", [
    (False, False, 160, (8, 128, 4, 1), torch.float32),
    (True, True, 160, (2, 64, 2, 1), torch.float32),
    (False, False, 160, (4, 64, 2, 1), torch.bfloat16),
    (True, False, 128, (2, 64, 2, 1), torch.bfloat16),
    (False, True, 128, (4, 64, 2, 1), torch.float32)])
def test_int4_gemv_variants_bit_identical(silu, act, k, base, dtype):
    """K = 160: 5 blocks, ragged against BLOCK_K 64 (3 steps) and 128 (2); N = 12 ragged
    against BLOCK_N 8; K = 128 and N = 8 / 12 whole tiles (LEAN's unmasked loads); the
    interpreter's 2 "SMs": PERSIST 1 runs 2 programs of several row tiles each (a tile's
    last step mid-loop, the SiLU gate kept across its up steps), PERSIST 3 up to 6 programs
    (capped at the 2 tiles of BLOCK_N 8). bf16 x: LEAN reads x as int32 pairs (XPAIRS; both
    sides store bf16 the interpreter's way)."""
    exts = ((0, 1, 1, 2, 96, 0, 1), (0, 1, 2, 1, 0, 1), (0, 1, 1, 1, 0, 3, 1))
    _checks.check_gemv_variants("cpu", 16 if silu else 12, k, 32, (base,), exts, silu, act,
                                dtype, calls=1)


def test_int4_gemv_lean_misaligned_bf16_x():
    """LEAN with a bf16 x that is not 4-byte aligned (a view one element in) reads x value by
    value (int32 pairs would straddle): the same bits as without LEAN, one-tile and PERSIST."""
    qw, s, z, _ = _checks.random_layer(8, 128, 32, seed=3)
    big = torch.randn(1, 129, generator=torch.Generator().manual_seed(5)).bfloat16()
    x = big[:, 1:]
    assert x.data_ptr() % 4 == 2
    for cfg in ((4, 64, 2, 1), (4, 64, 2, 1, 0, 1, 0, 1, 0, 1)):
        want = triton_int4.gemv(x, qw, s, z, 32, config=cfg)
        lean = triton_int4.gemv(x, qw, s, z, 32, config=cfg + (0, 1, 0, 1, 0, 0, 1)[len(cfg) - 4:])
        assert torch.equal(lean, want), cfg


def test_int4_gemv_stream_against_reference():
    """PERSIST (plain and LEAN) against the fp64 reference: groups 32 / 96 (one group a row,
    K = 96 ragged against BLOCK_K 64), a bias on the second shape, fp16 and fp32 outputs."""
    _checks.check_int4_kernels("cpu", [(13, 128, 32, 1)], dtypes=(torch.float16, torch.float32),
                               gemv_configs=((4, 64, 2, 1, 0, 1, 0, 1, 0, 1),))
    _checks.check_int4_kernels("cpu", [(6, 128, 32, 1), (7, 96, 96, 1)],
                               dtypes=(torch.float16,),
                               gemv_configs=((1, 32, 1, 1, 0, 1, 2, 1, 0, 2, 1),))


def test_int4_gemv_stream_reads_every_nibble():
    """One code differs at a time (column c of row 1 of 3; c over the 8 nibbles, the 4 words
    of a block and the 4 blocks): persistent LEAN programs of 1-row tiles and 4 steps of one
    block (program 0 takes rows 0 and 2) must see it exactly once, in the right row."""
    from radixlm.runtime.layers import int4_linear

    n, k = 3, 128
    x = torch.randn(1, k, dtype=torch.float32)
    for c in (0, 37, 74, 111, 16, 53, 90, 127):  # nibble (c % 32) // 4 = 0..7
        q = torch.full((n, k), 8)
        q[1, c] = 9 + (c % 7)
        s = torch.full((n, k // 32), 0.5, dtype=torch.float16)
        z = torch.full((n, k // 32), 8, dtype=torch.uint8)
        y = triton_int4.gemv(x, int4_linear.pack_rows(q), s, z, 32,
                             config=(1, 32, 1, 1, 0, 1, 0, 1, 0, 1, 1))
        want = torch.zeros(n)
        want[1] = 0.5 * (1 + c % 7) * x[0, c]
        assert torch.allclose(y[0], want, atol=1e-6), c


@pytest.mark.parametrize("cfg", [(4, 64, 2), (4, 64, 2, 1, 3), (4, 64, 2, 1, 0, 1, 3),
                                 (4, 64, 2, 1, 0, 1, 0, 0), (4, 64, 2, 1, 0, 1, 0, 1, 8),
                                 (4, 64, 2, 1, 0, 2, 0, 1, 0, 1), (4, 64, 2, 2, 0, 1, 0, 1, 0, 1),
                                 (4, 64, 2, 1, 2, 1, 0, 1, 0, 1), (4, 64, 2, 1, 0, 1, 0, 2, 0, 1),
                                 (4, 64, 2, 1, 0, 1, 0, 1, 0, 1, 2),
                                 (4, 64, 2, 1, 0, 1, 0, 1, 0, 1, 0, 0)])
def test_gemv_config_refused(cfg):
    """Malformed configs are refused before any launch: too short / long, PREFETCH 3, CACHE 3,
    UNROLL 0, a register cap below 24, PERSIST with split-K, stages, PREFETCH or UNROLL (the
    stream has its own prefetch and no split), LEAN 2."""
    qw, s, z, _ = _checks.random_layer(8, 64, 32)
    with pytest.raises(AssertionError):
        triton_int4.gemv(torch.randn(1, 64), qw, s, z, 32, config=cfg)
