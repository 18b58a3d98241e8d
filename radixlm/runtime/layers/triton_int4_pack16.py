"""(q - z) of an int4 group in 16-bit floats, exact (layers/triton_int4_tc.py's dequant): one
inline-PTX block a word on a GPU, the fp32 path under Triton's interpreter (the same values),
and the K order its tile's columns come in."""

from __future__ import annotations

import triton
import triton.language as tl

from radixlm.runtime.layers.triton_int4_dequant import _nibble_minus_zero

# (q - z) for the 8 nibbles of a word in one asm block, 16-bit pairs: lop3 puts nibbles i and
# i + 4 (bits 4i and 16 + 4i after a shift) into the mantissas of two 16-bit floats whose
# exponent gives the mantissa's last bit weight 1 (c + q: bf16 c = 128, 0x4300; fp16 c = 1024,
# 0x6400), one packed subtraction of (c + z, c + z) leaves q - z, exact (|q - z| <= 16).
# ~1.4 instructions a value against LOP3 + FADD + half an F2FP through fp32.
_ASM = """{
.reg .b32 t0, t1, t2, t3;
lop3.b32 t0, $8, 0x000F000F, MAGIC, 0xea;
shr.u32 t1, $8, 4;
lop3.b32 t1, t1, 0x000F000F, MAGIC, 0xea;
shr.u32 t2, $8, 8;
lop3.b32 t2, t2, 0x000F000F, MAGIC, 0xea;
shr.u32 t3, $8, 12;
lop3.b32 t3, t3, 0x000F000F, MAGIC, 0xea;
sub.rn.TYPE t0, t0, $9;
sub.rn.TYPE t1, t1, $9;
sub.rn.TYPE t2, t2, $9;
sub.rn.TYPE t3, t3, $9;
mov.b32 {$0, $4}, t0;
mov.b32 {$1, $5}, t1;
mov.b32 {$2, $6}, t2;
mov.b32 {$3, $7}, t3;
}"""
ASM_BF16 = tl.constexpr(_ASM.replace("MAGIC", "0x43004300").replace("TYPE", "bf16x2"))
ASM_FP16 = tl.constexpr(_ASM.replace("MAGIC", "0x64006400").replace("TYPE", "f16x2"))


@triton.jit
def _group_minus_zero(words, zf, magic, DT: tl.constexpr, BLOCK_N: tl.constexpr,
                      GROUP: tl.constexpr, ASM: tl.constexpr, K_ORDER: tl.constexpr = False):
    # words (BLOCK_N, NB, 4) int32 (a group's blocks), zf (BLOCK_N, 1, 1) fp32 -> (q - z) in DT
    # (BLOCK_N, GROUP), exact, its columns in _k_order's K order. ASM: the
    # packed 16-bit path (a GPU; Triton's interpreter runs no PTX), else through fp32
    if ASM:
        c = 128.0 if DT == tl.bfloat16 else 1024.0
        zc = (zf + c).to(DT).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        zz = tl.broadcast_to(zc | (zc << 16), words.shape)  # (c + z, c + z) as 16-bit pairs
        if DT == tl.bfloat16:
            d0, d1, d2, d3, d4, d5, d6, d7 = tl.inline_asm_elementwise(
                ASM_BF16, "=h,=h,=h,=h,=h,=h,=h,=h,r,r", [words, zz],
                dtype=(tl.bfloat16,) * 8, is_pure=True, pack=1)
        else:
            d0, d1, d2, d3, d4, d5, d6, d7 = tl.inline_asm_elementwise(
                ASM_FP16, "=h,=h,=h,=h,=h,=h,=h,=h,r,r", [words, zz],
                dtype=(tl.float16,) * 8, is_pure=True, pack=1)
    else:
        whi = words >> 16
        d0 = _nibble_minus_zero(words, whi, zf, magic, 0, 16).to(DT)
        d1 = _nibble_minus_zero(words, whi, zf, magic, 1, 16).to(DT)
        d2 = _nibble_minus_zero(words, whi, zf, magic, 2, 16).to(DT)
        d3 = _nibble_minus_zero(words, whi, zf, magic, 3, 16).to(DT)
        d4 = _nibble_minus_zero(words, whi, zf, magic, 4, 16).to(DT)
        d5 = _nibble_minus_zero(words, whi, zf, magic, 5, 16).to(DT)
        d6 = _nibble_minus_zero(words, whi, zf, magic, 6, 16).to(DT)
        d7 = _nibble_minus_zero(words, whi, zf, magic, 7, 16).to(DT)
    # (BLOCK_N, NB, 4, t, u, v), nibble i = t + 2u + 4v: v (nibbles i and i + 4, one 32-bit
    # register of the asm) innermost, so the reshape keeps them paired (no byte permutes on
    # the way to the dot's shared-memory operand); the columns come out in _k_order's order
    t = tl.join(tl.join(tl.join(d0, d1), tl.join(d2, d3)),
                tl.join(tl.join(d4, d5), tl.join(d6, d7)))
    if K_ORDER:  # the columns in K's own order instead (byte permutes in registers)
        t = tl.permute(t, (0, 1, 5, 4, 3, 2))  # (BLOCK_N, NB, v, u, t, 4): 32b + 4i + j
    return tl.reshape(t, (BLOCK_N, GROUP))


@triton.jit
def _k_order(GROUP: tl.constexpr):
    # (GROUP,) the K column (within the group) of each column of _group_minus_zero's tile:
    # column c = (((4b + j) * 2 + t) * 2 + u) * 2 + v holds nibble t + 2u + 4v of word j of
    # block b, K column 32b + 4(t + 2u + 4v) + j
    c = tl.arange(0, GROUP)
    v, u, t, j, b = c % 2, (c // 2) % 2, (c // 4) % 2, (c // 8) % 4, c // 32
    return 32 * b + 4 * (t + 2 * u + 4 * v) + j
