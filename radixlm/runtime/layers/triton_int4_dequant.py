"""Device helpers of the int4 GEMV (layers/triton_int4.py's one-tile kernel and
triton_int4_stream.py's persistent one; layout and dequant: triton_int4's docstring): the exact
nibble -> fp32 step (also triton_int4_gemm's), the word / zero / scale loads, a step's block
sums and the epilogue's store."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _nibble_minus_zero(w, whi, zf, magic, I: tl.constexpr, HI: tl.constexpr = 20):
    # (q_I - z) in fp32, exact: w / whi = words / words >> HI (any shape), zf = z as fp32
    # broadcastable to it. The magic float 2^(23-4j) has exponent field 150 - 4j, mantissa 0;
    # nibble I < 5 is read in place (j = I), nibbles 5..7 from whi (j = I - HI / 4). `magic` is
    # the RUNTIME int32 MAGIC (bits of 2^23): were it a literal, ptxas would emit the & and the
    # | as two LOP3s (one immediate each, seen in the sm_90 SASS); from a register it is one.
    # HI 20 puts nibble 5 at whi's bits 0-3, which LLVM turns into a bit-field extract of w
    # (sm_90: SHF + SGXT + LOP3, 3 instructions for that value); HI 16 (j = 1..3) keeps
    # nibbles 5..7 one LOP3 each on whi (the GEMV's LEAN knob; the same values).
    J: tl.constexpr = I if I < 5 else I - HI // 4
    if I < 5:
        f = ((w & (0xF << (4 * J))) | (magic - ((4 * J) << 23))).to(tl.float32, bitcast=True)
    else:
        f = ((whi & (0xF << (4 * J))) | (magic - ((4 * J) << 23))).to(tl.float32, bitcast=True)
    return f - (zf + (1 << (23 - 4 * J)))


MAGIC = 0x4B000000  # bits of the float 2^23, passed to the kernels as a runtime argument


@triton.jit
def _gemv_zs(Z, S, s_row, kb, ob, row_ok, n_blocks, GROUP: tl.constexpr,
             FULL: tl.constexpr = False):
    # (BLOCK_N, NB) zeros, scales (as stored) of the blocks from kb on; 0 past K (FULL: no
    # row or block is past N or K: unmasked)
    g = ((kb + ob) * 32) // GROUP  # (NB,) each block's group
    if FULL:
        return tl.load(Z + s_row + g[None, :]), tl.load(S + s_row + g[None, :])
    ok = row_ok[:, None] & (kb + ob < n_blocks)[None, :]
    return (tl.load(Z + s_row + g[None, :], mask=ok, other=0),
            tl.load(S + s_row + g[None, :], mask=ok, other=0.0))


@triton.jit
def _load_words(ptrs, ok, CACHE: tl.constexpr, FULL: tl.constexpr = False):
    # CACHE 1: .cg (L2 only: a weight byte is read once, L1 keeps x, scales and zeros);
    # 2: evict_first (L1::evict_first + an L2 evict_first policy: weight lines leave first;
    # ptxas refuses it together with .cg). FULL: unmasked (ok ignored)
    if FULL:
        if CACHE == 2:
            w = tl.load(ptrs, eviction_policy="evict_first")
        elif CACHE == 1:
            w = tl.load(ptrs, cache_modifier=".cg")
        else:
            w = tl.load(ptrs)
    elif CACHE == 2:
        w = tl.load(ptrs, mask=ok, other=0, eviction_policy="evict_first")
    elif CACHE == 1:
        w = tl.load(ptrs, mask=ok, other=0, cache_modifier=".cg")
    else:
        w = tl.load(ptrs, mask=ok, other=0)
    return w


@triton.jit
def _gemv_words(w_ptrs, kb, kb_hi, ob, row_ok, CACHE: tl.constexpr):
    # (BLOCK_N, NB, 4) words of the step from block kb on, 0 from kb_hi on
    ok = row_ok[:, None, None] & (kb + ob < kb_hi)[None, :, None]
    return _load_words(w_ptrs + kb * 4, ok, CACHE)


@triton.jit
def _gemv_block_sums(X, P, words, zf, magic, kb, blk_ok, HAS_PERM: tl.constexpr,
                     LEAN: tl.constexpr, XPAIRS: tl.constexpr, EVEN_K: tl.constexpr):
    # (BLOCK_N, NB, 4) sum over the 8 nibbles of (q - z) x for the NB blocks from block kb
    # on. LEAN: nibbles 5..7 from words >> 16 (one LOP3 each, see _nibble_minus_zero; the
    # same values); XPAIRS (LEAN with bf16 x, no perm, x 4-byte aligned): x read as int32
    # pairs of bf16, each to fp32 by one shift or one mask (cvt.f32.bf16 took PRMT + SHF).
    # EVEN_K: x unmasked (K a multiple of BLOCK_K: every block is in K). sm_90 loop body
    # at 4 rows x 2048 on 2 warps (128 values a thread a step): 649 -> 613 instructions with
    # the first, 597 with both; see _gemv_rows for the rest.
    NB: tl.constexpr = words.shape[1]
    ob = tl.arange(0, NB)
    cols0 = kb * 32 + ob[:, None] * 32 + tl.arange(0, 4)[None, :]  # (NB, 4) nibble 0's
    pairs0 = kb * 16 + ob[:, None] * 16 + tl.arange(0, 2)[None, :]  # (NB, 2) as int32 pairs
    whi = words >> (16 if LEAN else 20)
    p = tl.zeros(words.shape, tl.float32)
    for i in tl.static_range(8):
        if XPAIRS:  # columns 4i + (0, 1) and 4i + (2, 3) of each block: 2 int32
            xp = X.to(tl.pointer_type(tl.int32), bitcast=True) + pairs0 + 2 * i
            if EVEN_K:
                xw = tl.load(xp)
            else:
                xw = tl.load(xp, mask=blk_ok[:, None], other=0)
            x = tl.reshape(tl.join(xw << 16, xw & -65536), (NB, 4)).to(tl.float32,
                                                                         bitcast=True)
        else:
            cols = cols0 + 4 * i  # (NB, 4) stored columns of nibble i
            if EVEN_K:
                if HAS_PERM:
                    cols = tl.load(P + cols)
                x = tl.load(X + cols).to(tl.float32)
            else:
                if HAS_PERM:
                    cols = tl.load(P + cols, mask=blk_ok[:, None], other=0)
                x = tl.load(X + cols, mask=blk_ok[:, None], other=0.0).to(tl.float32)
        p += _nibble_minus_zero(words, whi, zf, magic, i, 16 if LEAN else 20) * x[None, :, :]
    return p


@triton.jit
def _gemv_tile_end(y, g, h, B, Y, rows, row_ok, HAS_BIAS: tl.constexpr, SILU: tl.constexpr):
    # the persistent kernels' row tile (half h) done, its sums y: stored, or under SILU kept as
    # the gate g till the up half's; returns g
    if SILU:
        if h == 0:
            g = y
        else:
            _gemv_store(g, y, B, Y, rows, row_ok, HAS_BIAS, SILU)
    else:
        _gemv_store(y, y, B, Y, rows, row_ok, HAS_BIAS, SILU)
    return g


@triton.jit
def _gemv_store(y, u, B, Y, rows, row_ok, HAS_BIAS: tl.constexpr, SILU: tl.constexpr):
    if SILU:
        # the roundings of the unfused path (gate_up stored in Y's dtype, F.silu rounded, the
        # product rounded: layers/triton_ops' silu_and_mul)
        g = y.to(Y.dtype.element_ty).to(tl.float32)
        u = u.to(Y.dtype.element_ty).to(tl.float32)
        y = (g / (1.0 + tl.exp(-g))).to(Y.dtype.element_ty).to(tl.float32) * u
    elif HAS_BIAS:
        y += tl.load(B + rows, mask=row_ok, other=0.0).to(tl.float32)
    tl.store(Y + rows, y.to(Y.dtype.element_ty), mask=row_ok)
