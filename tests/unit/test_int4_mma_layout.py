"""The `mma` int4 layout (layers/int4_mma_layout.py) on the CPU: pack / unpack, and a lane-level
emulation of the kernel (each lane's bit extraction as its inline PTX does it, each MMA by the
PTX ISA's m16n8k16 fragment map, the epilogue's row / column map) against x @ W^T. The kernel
itself needs a GPU (tests/gpu/test_int4_mma_gpu.py): its inline PTX does not run under Triton's
interpreter."""

from __future__ import annotations

import pytest
import torch

from radixlm.runtime.layers import int4_mma_layout as MM


def _q(n, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)


def test_pack_unpack_round_trip():
    q = _q(48, 192)
    words = MM.pack(q)
    assert words.shape == (3, 3, 32, 4) and words.dtype == torch.int32
    assert torch.equal(MM.unpack(words), q)


def test_pack_bit_positions():
    # one value set at a time: its word and bits are the docstring's
    n, k = 32, 128
    for row, col in [(0, 0), (9, 1), (3, 66), (8 + 5, 64 + 16 * 2 + 4 * 3 + 3), (31, 127)]:
        q = torch.zeros(n, k, dtype=torch.uint8)
        q[row, col] = 5
        words = MM.pack(q)
        rt, h, g = row // 16, (row % 16) // 8, row % 8
        ch, j, c, e = col // 64, (col % 64) // 16, (col % 16) // 4, col % 4
        shift = 16 * (e % 2) + 4 * h + 8 * (e // 2)
        expect = torch.zeros_like(words)
        expect[rt, ch, 4 * g + c, j] = 5 << shift
        assert torch.equal(words, expect), (row, col)


def _lane_mma(word, xpair4, zg, zg8):
    """One lane group's m16n8k16 as the kernel's PTX computes it: word (32,) int64 a lane's A
    word, xpair4 (32, 4) the 4 x values a lane loads (k 4c + 0..3 of column g), zg / zg8 (32,)
    the zeros of rows g / g + 8 -> D (16, 8) float64, by the PTX ISA fragment map."""
    a = torch.zeros(16, 16, dtype=torch.float64)
    b = torch.zeros(16, 8, dtype=torch.float64)
    for lane in range(32):
        g, c = lane // 4, lane % 4
        w = int(word[lane]) & 0xFFFFFFFF
        regs = [((w >> (4 * i)) & 0x000F000F) for i in range(4)]  # the lop3 / shr
        vals = [(r & 0xF, (r >> 16) & 0xF) for r in regs]  # (low half, high half)
        z = (int(zg[lane]), int(zg8[lane]))
        # A: reg 0 (g, 2c / 2c+1), reg 1 (g+8, ..), reg 2 (g, 2c+8 / +9), reg 3 (g+8, ..)
        for i, (lo, hi) in enumerate(vals):
            row = g + 8 * (i % 2)
            col = 2 * c + 8 * (i // 2)
            a[row, col] = lo - z[i % 2]
            a[row, col + 1] = hi - z[i % 2]
        # B: b0, b1 at k 2c, 2c+1; b2, b3 at 2c+8, 2c+9; column g; loaded as x[4c + 0..3]
        b[2 * c, g], b[2 * c + 1, g] = xpair4[lane, 0], xpair4[lane, 1]
        b[2 * c + 8, g], b[2 * c + 9, g] = xpair4[lane, 2], xpair4[lane, 3]
    return a @ b


def _emulate(x, words, scales, zeros, group):
    """y (M, N) float64 the kernel's way: per row tile, per group, the MMAs of its k steps then
    the scale, D's c0..c3 to (row g / g+8, column 2c / 2c+1)."""
    m, k = x.shape
    nt, kc = words.shape[:2]
    y = torch.zeros(m, nt * 16, dtype=torch.float64)
    xp = torch.zeros(8, k, dtype=torch.float64)
    xp[:m] = x.double()
    lanes = torch.arange(32)
    g, c = lanes // 4, lanes % 4
    for rt in range(nt):
        acc = torch.zeros(16, 8, dtype=torch.float64)
        for grp in range(k // group):
            d = torch.zeros(16, 8, dtype=torch.float64)
            for kstep in range(grp * group // 16, (grp + 1) * group // 16):
                ch, j = kstep // 4, kstep % 4
                cols = kstep * 16 + 4 * c[:, None] + torch.arange(4)[None, :]  # (32, 4)
                xpair4 = xp[g[:, None], cols]
                zg = zeros[rt * 16 + g, grp]
                zg8 = zeros[rt * 16 + g + 8, grp]
                d += _lane_mma(words[rt, ch, :, j].to(torch.int64), xpair4, zg, zg8)
            s = scales[rt * 16:(rt + 1) * 16, grp].double()[:, None]
            acc += d * s
        for lane in range(32):  # the epilogue: lane (g, c)'s c0..c3
            gg, cc = lane // 4, lane % 4
            for n, row in ((2 * cc, gg), (2 * cc + 1, gg), (2 * cc, gg + 8), (2 * cc + 1, gg + 8)):
                if n < m:
                    y[n, rt * 16 + row] = acc[row, n]
    return y


@pytest.mark.parametrize("group,m", [(32, 1), (64, 3), (128, 8)])
def test_lane_emulation_matches_matmul(group, m):
    n, k = 32, 256
    q = _q(n, k, seed=group)
    gen = torch.Generator().manual_seed(1)
    zeros = torch.randint(0, 16, (n, k // group), generator=gen)
    scales = torch.rand(n, k // group, generator=gen) + 0.5
    x = torch.randn(m, k, generator=gen)
    w = (q.double() - zeros.double().repeat_interleave(group, 1)) \
        * scales.double().repeat_interleave(group, 1)
    ref = x.double() @ w.T
    got = _emulate(x, MM.pack(q), scales, zeros, group)
    assert torch.allclose(got, ref, rtol=1e-9, atol=1e-9)


def test_supported_shapes():
    bf = torch.bfloat16
    assert MM.supported(4096, 4096, 128, bf)
    assert MM.supported(28672, 4096, 128, bf, silu=True)
    assert not MM.supported(4096, 4096, 128, torch.float32)  # the MMA's operand types
    assert not MM.supported(4096, 4096, 256, bf)  # a unit's words in registers: <= 128
    assert not MM.supported(4104, 4096, 128, bf)  # whole 16-row tiles
    assert not MM.supported(4096, 4000, 32, bf)  # whole 64-value chunks
    assert not MM.supported(4112, 4096, 128, bf, r=2)  # R tiles a program
