"""The batch-1 int4 GEMV's products in packed fp16 (layers/triton_int4_tma.py, MATH 2): about
2 sm_90 instructions a weight value instead of ~4.9, for 16-bit activations.

Why: the TMA GEMV's exact path (triton_int4_dequant._gemv_block_sums: (q - z) to fp32 by the
magic number, an fp32 FMA a value) is bound by its math on an H200 (31 us for the 8B's
gate_up where the same walk without the math takes 16). Here one inline-PTX block a word
(8 values of one row) does:
  - (q - z) as fp16 pairs, exact: lop3 puts two nibbles into the mantissas of two fp16 whose
    exponent gives the mantissa's bit 0 weight 1 (0x6400 = 1024); nibbles 0/4 and, after one
    shift by 8, 2/6 land at bit 0 (1024 + q), nibbles 1/5 and 3/7 at bit 4 (1024 + 16 q);
    one packed subtraction of (1024 + z) or (1024 + 16 z) leaves q - z or 16 (q - z),
    exactly (integers below 2048);
  - the 8 products on 4 packed fp16 FMAs (mul, fma, fma, fma: two lanes of 4 products each),
    the x of the 16 (q - z) pairs pre-divided by 16 (exact: a power of 2);
  - the two lanes to fp32 and their sum.
So per word: 4 lop3 + 1 shift + 4 sub + 4 fma + 2 cvt + 1 add. The 8 products and 3 sums
of a lane round to fp16 (11 significant bits); everything after is fp32: a word's sum is
within ~4 * 2^-11 of its magnitude. x is scaled into fp16's range first: a power of 2 a step
(2^e, from the largest |x| of the step's BLOCK_K values, exact) puts that largest value in
[64, 128), so a lane's partial sums stay below 4 * 15 * 128 = 7680 (fp16's largest finite
value: 65504) whatever the activations' magnitude; the step's fp32 sums are multiplied by
2^-e with the group's scale. The reference tolerance (tests/gpu/test_int4.py) holds with
room: the output's own rounding to bf16 (2^-9) is coarser.

Under Triton's interpreter (no PTX) the same operations run as fp32 ops rounded to fp16 at
each step (products exact in fp32, then the fp16 rounding the packed instruction makes: the
same values, up to a rare double rounding of an fma)."""

from __future__ import annotations

import triton
import triton.language as tl

from radixlm.runtime.layers.triton_int4_dequant import _nibble_minus_zero

# $0: fp32 out; $1: the word; $2 / $3: (1024 + z) / (1024 + 16 z) in both halves; $4..$7: the x
# pairs (nibbles 0/4, 1/5, 2/6, 3/7; the odd ones pre-divided by 16); $8: 2^-e (fp32). lop3 0xea:
# (a & b) | c.
ASM_WORD = tl.constexpr("""{
.reg .b32 a, b, c, d, s;
.reg .b16 l, h;
.reg .f32 f;
lop3.b32 a, $1, 0x000F000F, 0x64006400, 0xea;
lop3.b32 b, $1, 0x00F000F0, 0x64006400, 0xea;
shr.u32 c, $1, 8;
lop3.b32 d, c, 0x00F000F0, 0x64006400, 0xea;
lop3.b32 c, c, 0x000F000F, 0x64006400, 0xea;
sub.rn.f16x2 a, a, $2;
sub.rn.f16x2 b, b, $3;
sub.rn.f16x2 c, c, $2;
sub.rn.f16x2 d, d, $3;
mul.rn.f16x2 s, a, $4;
fma.rn.f16x2 s, b, $5, s;
fma.rn.f16x2 s, c, $6, s;
fma.rn.f16x2 s, d, $7, s;
mov.b32 {l, h}, s;
add.rn.f16 l, l, h;
cvt.f32.f16 f, l;
mul.f32 $0, f, $8;
}""")
# two fp32 -> one fp16 pair (lo in bits 0-15), rounded to nearest: one F2FP
ASM_PAIR = tl.constexpr("cvt.rn.f16x2.f32 $0, $2, $1;")


@triton.jit
def _x_at(X, P, cols, HAS_PERM: tl.constexpr):
    # x at stored columns `cols` as fp32 (act-order: through perm)
    if HAS_PERM:
        cols = tl.load(P + cols)
    return tl.load(X + cols).to(tl.float32)


@triton.jit
def _pair(lo, hi, scale, ASM: tl.constexpr):
    # fp32 lo * scale, hi * scale -> fp16 pairs as int32 (lo in bits 0-15)
    if ASM:
        return tl.inline_asm_elementwise(ASM_PAIR, "=r,f,f", [lo * scale, hi * scale],
                                         dtype=tl.int32, is_pure=True, pack=1)
    lb = (lo * scale).to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    hb = (hi * scale).to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32)
    return lb | (hb << 16)


@triton.jit
def _h16(v):
    # fp32 -> rounded to fp16 -> fp32 (the interpreter's emulation of a packed op's rounding)
    return v.to(tl.float16).to(tl.float32)


@triton.jit
def _half2_block_sums(X, P, words, zi, magic, kb, HAS_PERM: tl.constexpr, ASM: tl.constexpr):
    # words (BLOCK_N, NB, 4) int32 (the NB 32-value blocks from block kb on; nibble i of word j
    # of block b is column 32b + 4i + j), zi (BLOCK_N, NB) int32 each block's zero ->
    # (BLOCK_N, NB, 4) fp32: each word's sum of (q - z) x (summed over the words at the tile's
    # end: a sum over the 4 words here crossed lanes every step).
    # Everything at the words' full shape (x broadcast over the rows): x's values then sit in
    # the threads that hold their words (no layout change through shared memory), and the
    # copies of a row-independent value are one register after LLVM's common subexpressions.
    # The scale is a word position's (its 8 x values, the same for every row): no reduction.
    NB: tl.constexpr = words.shape[1]
    c0 = kb * 32 + tl.arange(0, NB)[None, :, None] * 32 + tl.arange(0, 4)[None, None, :]
    x0 = _x_at(X, P, c0, HAS_PERM)
    x1 = _x_at(X, P, c0 + 4, HAS_PERM)
    x2 = _x_at(X, P, c0 + 8, HAS_PERM)
    x3 = _x_at(X, P, c0 + 12, HAS_PERM)
    x4 = _x_at(X, P, c0 + 16, HAS_PERM)
    x5 = _x_at(X, P, c0 + 20, HAS_PERM)
    x6 = _x_at(X, P, c0 + 24, HAS_PERM)
    x7 = _x_at(X, P, c0 + 28, HAS_PERM)
    a = tl.maximum(tl.maximum(tl.maximum(tl.abs(x0), tl.abs(x1)),
                              tl.maximum(tl.abs(x2), tl.abs(x3))),
                   tl.maximum(tl.maximum(tl.abs(x4), tl.abs(x5)),
                              tl.maximum(tl.abs(x6), tl.abs(x7))))
    # the word's largest |x| in [2^(E-127), 2^(E-126)) -> scale 2^(133-E) puts it in [64, 128);
    # E clamped to [7, 254]: both powers normal floats (an inf or nan x stays one)
    e = tl.minimum(tl.maximum(a.to(tl.int32, bitcast=True) >> 23, 7), 254)
    scale = ((260 - e) << 23).to(tl.float32, bitcast=True)
    inv = ((e - 6) << 23).to(tl.float32, bitcast=True)
    if ASM:
        z3 = zi[:, :, None]
        zz0 = tl.broadcast_to((0x6400 + z3) * 0x10001, words.shape)  # (1024 + z) x 2
        zz1 = tl.broadcast_to((0x6400 + 16 * z3) * 0x10001, words.shape)  # (1024 + 16 z) x 2
        p = tl.inline_asm_elementwise(
            ASM_WORD, "=f,r,r,r,r,r,r,r,f",
            [words, zz0, zz1, tl.broadcast_to(_pair(x0, x4, scale, ASM), words.shape),
             tl.broadcast_to(_pair(x1, x5, scale * 0.0625, ASM), words.shape),
             tl.broadcast_to(_pair(x2, x6, scale, ASM), words.shape),
             tl.broadcast_to(_pair(x3, x7, scale * 0.0625, ASM), words.shape),
             tl.broadcast_to(inv, words.shape)],
            dtype=tl.float32, is_pure=True, pack=1)
    else:
        whi = words >> 16
        zf = zi.to(tl.float32)[:, :, None]
        lo = _h16(_nibble_minus_zero(words, whi, zf, magic, 0, 16) * _h16(x0 * scale))
        lo = _h16(_nibble_minus_zero(words, whi, zf, magic, 1, 16) * _h16(x1 * scale) + lo)
        lo = _h16(_nibble_minus_zero(words, whi, zf, magic, 2, 16) * _h16(x2 * scale) + lo)
        lo = _h16(_nibble_minus_zero(words, whi, zf, magic, 3, 16) * _h16(x3 * scale) + lo)
        hi = _h16(_nibble_minus_zero(words, whi, zf, magic, 4, 16) * _h16(x4 * scale))
        hi = _h16(_nibble_minus_zero(words, whi, zf, magic, 5, 16) * _h16(x5 * scale) + hi)
        hi = _h16(_nibble_minus_zero(words, whi, zf, magic, 6, 16) * _h16(x6 * scale) + hi)
        hi = _h16(_nibble_minus_zero(words, whi, zf, magic, 7, 16) * _h16(x7 * scale) + hi)
        p = _h16(lo + hi) * inv
    return p
