"""The batch-1 int4 GEMV with each group's sums on the tensor cores (RADIXLM_INT4_TMA=tc:
layers/int4_batch1.py). Not yet run on a GPU: checked under Triton's interpreter (its fp32
dequant path) and compiled for sm_90 here; tests/gpu/test_int4_tma_gpu.py and
benchmarks/probes/int4_gemv_bound.py are its first GPU runs. triton_int4_tma's walk (TMA
words, persistent grid, one loop over (item, half, step)); a step is one group of the tile's
rows.

Why: the TMA GEMV's loads reach 3.3-3.8 TB/s on an H200 but its math holds it at ~2.0
(~4.9 sm_90 instructions a value: LOP3 + FADD + FFMA for each value's exact fp32 product, and
the rest). Here (q - z) comes exact in x's 16-bit type from one inline-PTX block a word
(lop3 puts nibbles i and i + 4 into two 16-bit mantissas, a packed sub removes c + z: ~1.4
instructions a value), and the products and their sums go to the tensor cores: part
(BLOCK_N, 16) = Wq (BLOCK_N, GROUP) @ x (GROUP, 16) (x's column broadcast 16 times, the dot's
narrowest N; column 0 is read), acc += part * s per row in fp32. The sm_90 loop at the
default tile: ~2.9 instructions a value. The same sums as the GEMV's contract (products
exact, fp32 sums, the scale once a group) in the tensor cores' summation order: the GEMV's
tolerance (tests/gpu/test_int4.py). The dequantized tile's columns are in _k_order's order
(pairs of nibbles i, i + 4 side by side, as the asm leaves them: no byte permutes), x is
read in the same order.

Small N (o, down: 32 tiles of 128 rows for 132 SMs): split-K (split_for), one (tile, split)
item a program, partial sums reduced in split order by the item arriving last (the same bits
whichever); the atomic stays after the K loop (inside it, Triton 3.6 did not pipeline the
loop).

Operands: qweight (R, K/8) int32 by TMA descriptor (box (BLOCK_N, GROUP / 8)); zs (G, R) int32
= zero << 16 | the 16-bit scale's bits (pack_zs; one 4-byte load a row a step, cp.async-
pipelined: a TMA box of one group would be BLOCK_N x 4 bytes, under 128 for BLOCK_N < 32).
fp16 / bf16 x and scales only."""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from radixlm.runtime.layers.triton_int4_dequant import (MAGIC, _gemv_store, _gemv_tile_end,
                                                        _nibble_minus_zero)
from radixlm.runtime.layers.triton_int4_host import split_counters
from radixlm.runtime.layers.triton_int4_stream import _sm_count


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
                      GROUP: tl.constexpr, ASM: tl.constexpr):
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
    return tl.reshape(t, (BLOCK_N, GROUP))


@triton.jit
def _k_order(GROUP: tl.constexpr):
    # (GROUP,) the K column (within the group) of each column of _group_minus_zero's tile:
    # column c = (((4b + j) * 2 + t) * 2 + u) * 2 + v holds nibble t + 2u + 4v of word j of
    # block b, K column 32b + 4(t + 2u + 4v) + j
    c = tl.arange(0, GROUP)
    v, u, t, j, b = c % 2, (c // 2) % 2, (c // 4) % 2, (c // 8) % 4, c // 32
    return 32 * b + 4 * (t + 2 * u + 4 * v) + j


@triton.jit
def _split_reduce(tile, WS, CNT, B, Y, rows, row_ok, N_OUT, HAS_BIAS: tl.constexpr,
                  SILU: tl.constexpr, SPLIT: tl.constexpr):
    # after a work item's partials are in WS (SPLIT, HALVES x N_OUT): the item arriving last
    # at its tile's counter sums the partials in split order (the same bits whichever arrives
    # last), stores y and resets the counter. Outside the K loop: an atomic inside it keeps
    # Triton 3.6's pipeliner off the loop (one buffer, no load in flight: seen in the TTGIR)
    tl.debug_barrier()  # every thread's partial stored before the release below
    if tl.atomic_add(CNT + tile, 1, sem="acq_rel") == SPLIT - 1:
        a = tl.zeros(rows.shape, tl.float32)
        u = tl.zeros(rows.shape, tl.float32)
        for k in tl.static_range(SPLIT):
            base = WS + k * (N_OUT * (2 if SILU else 1)) + rows
            a += tl.load(base, mask=row_ok, other=0.0, cache_modifier=".cg")
            if SILU:
                u += tl.load(base + N_OUT, mask=row_ok, other=0.0, cache_modifier=".cg")
        _gemv_store(a, u, B, Y, rows, row_ok, HAS_BIAS, SILU)
        tl.atomic_xchg(CNT + tile, 0)


@triton.jit
def _int4_gemv_tc_kernel(X, qd, ZS, P, B, Y, WS, CNT, N_OUT, magic,
                         K: tl.constexpr, GROUP: tl.constexpr, HAS_PERM: tl.constexpr,
                         HAS_BIAS: tl.constexpr, SILU: tl.constexpr, BLOCK_N: tl.constexpr,
                         NUM_STAGES: tl.constexpr, SCALE_DT: tl.constexpr,
                         SPLIT: tl.constexpr, ASM: tl.constexpr):
    # work items: (row tile, split) pairs, item = tile * SPLIT + sk, each SPI = STEPS / SPLIT
    # groups of K; program p walks items p, p + P, ..., each item's halves, each half's steps,
    # as one loop (the pipeliner keeps it full across items). SPLIT > 1: one item a program
    # (the grid is the items), its partials reduced after the loop
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    STEPS: tl.constexpr = K // GROUP
    SPI: tl.constexpr = STEPS // SPLIT
    HALVES: tl.constexpr = 2 if SILU else 1
    NB: tl.constexpr = GROUP // 32
    rows_all = N_OUT * HALVES  # zs's row stride
    items = tl.cdiv(N_OUT, BLOCK_N) * SPLIT
    total = tl.cdiv(items - pid, n_prog) * (HALVES * SPI)
    acc = tl.zeros([BLOCK_N, 16], tl.float32)
    g = tl.zeros([BLOCK_N], tl.float32)
    on = tl.arange(0, BLOCK_N)
    kcols = _k_order(GROUP)  # (GROUP,) the K order of the dequantized tile's columns
    c16 = tl.arange(0, 16)
    DT: tl.constexpr = X.dtype.element_ty
    for i in tl.range(0, total, num_stages=NUM_STAGES):
        sl = i % SPI  # the step within the item
        r = i // SPI
        h = r % HALVES
        item = pid + (r // HALVES) * n_prog
        tile = item // SPLIT
        sk = item % SPLIT
        st = sk * SPI + sl  # the group of K
        row0 = tile * BLOCK_N + h * N_OUT
        w = qd.load([row0, st * (GROUP // 8)])  # (BLOCK_N, GROUP / 8) int32
        zs = tl.load(ZS + st * rows_all + row0 + on)  # (BLOCK_N,) int32
        zf = (zs >> 16).to(tl.float32)
        s = (zs & 0xFFFF).to(tl.int16).to(SCALE_DT, bitcast=True).to(tl.float32)
        wq = _group_minus_zero(tl.reshape(w, (BLOCK_N, NB, 4)), zf[:, None, None], magic, DT,
                               BLOCK_N, GROUP, ASM)
        cols = st * GROUP + kcols
        if HAS_PERM:
            cols = tl.load(P + cols)
        xg = tl.load(X + cols)  # (GROUP,)
        part = tl.dot(wq, tl.broadcast_to(xg[:, None], (GROUP, 16)))  # (BLOCK_N, 16) fp32
        acc += part * s[:, None]
        if sl == SPI - 1:  # the item's half done
            y = tl.sum(tl.where(c16[None, :] == 0, acc, 0.0), axis=1)  # (all 16 columns equal)
            acc = tl.zeros([BLOCK_N, 16], tl.float32)
            rows = tile * BLOCK_N + on
            if SPLIT == 1:
                g = _gemv_tile_end(y, g, h, B, Y, rows, rows < N_OUT, HAS_BIAS, SILU)
            else:  # this item's partial sums of this half
                tl.store(WS + sk * rows_all + h * N_OUT + rows, y, mask=rows < N_OUT)
    if SPLIT > 1:
        tile = pid // SPLIT
        rows = tile * BLOCK_N + on
        _split_reduce(tile, WS, CNT, B, Y, rows, rows < N_OUT, N_OUT, HAS_BIAS, SILU, SPLIT)


# (BLOCK_N, num_warps, NUM_STAGES, programs an SM, SPLIT): untimed; 128-row tiles (the sm_90
# loop at 128 values a thread: ~2.9 instructions a value) split along K to reach the SMs
DEFAULT = (128, 4, 4, 2, 0)  # SPLIT 0: split_for's


def split_for(n_out: int, k: int, group: int, block_n: int, sms: int) -> int:
    """K cut in 1, 2, 4 or 8 (whole groups each, >= 8 groups a split) until the work items
    (row tiles x splits) reach the SM count."""
    tiles, steps, split = -(-n_out // block_n), k // group, 1
    while tiles * split < sms and split < 8 and steps % (2 * split) == 0 \
            and steps // (2 * split) >= 8:
        split *= 2
    return split


def supported(rows: int, k: int, group: int, block_n: int, scale_dtype: torch.dtype,
              dtype: torch.dtype) -> bool:
    """Whole row tiles and groups, a group of >= 32 values (the dot's K >= 16), 16-bit x and
    scales (zs packs a scale in 16 bits; fp32 x would need the dot in IEEE fp32)."""
    return (k % group == 0 and group % 32 == 0 and rows % block_n == 0 and block_n >= 16
            and scale_dtype in (torch.float16, torch.bfloat16)
            and dtype in (torch.float16, torch.bfloat16))


def pack_zs(scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """(N, G) 16-bit scales and uint8 zeros -> (G, N) int32: zero << 16 | the scale's bits."""
    bits = scales.contiguous().view(torch.int16).to(torch.int32) & 0xFFFF
    return ((zeros.to(torch.int32) << 16) | bits).t().contiguous()


def descriptor(qweight: torch.Tensor, group: int, block_n: int):
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor.from_tensor(qweight, [block_n, group // 8])


_COUNTERS: dict = {}  # device -> split-K arrival counters, one a row tile (self-resetting)


def gemv(x: torch.Tensor, qd, zs: torch.Tensor, n_out: int, k: int, group: int,
         scale_dtype: torch.dtype, bias: Optional[torch.Tensor] = None,
         perm: Optional[torch.Tensor] = None, silu: bool = False,
         config: Optional[tuple] = None, asm: Optional[bool] = None) -> torch.Tensor:
    """x (1, K) -> y (1, n_out): triton_int4.gemv's contract (silu: [gate | up], n_out = I).
    asm: the packed dequant (default: on a GPU). Split-K assumes one stream at a time per
    device (the counters are shared)."""
    block_n, warps, stages, per_sm, split = config or DEFAULT
    assert x.shape == (1, k) and x.stride(1) == 1 and not (silu and bias is not None)
    assert k % group == 0 and n_out % block_n == 0, (k, group, n_out, block_n)
    y = torch.empty((1, n_out), dtype=x.dtype, device=x.device)
    sms = _sm_count(x.device)
    split = split or split_for(n_out, k, group, block_n, sms)
    assert (k // group) % split == 0, (k, group, split)
    tiles = n_out // block_n
    cnt = split_counters(_COUNTERS, x.device, tiles, 4096) if split > 1 else None
    if cnt is None:  # (first allocated inside a capture: no split-K this call)
        split = 1
    ws = torch.empty((split, n_out * (2 if silu else 1)), dtype=torch.float32,
                     device=x.device) if split > 1 else y
    grid = min(tiles * split, per_sm * sms) if split == 1 else tiles * split
    _int4_gemv_tc_kernel[(grid,)](
        x, qd, zs, perm if perm is not None else x, bias if bias is not None else x, y, ws,
        cnt if cnt is not None else zs, n_out, MAGIC, K=k, GROUP=group,
        HAS_PERM=perm is not None, HAS_BIAS=bias is not None, SILU=silu, BLOCK_N=block_n,
        NUM_STAGES=stages, SCALE_DT=tl.float16 if scale_dtype == torch.float16 else tl.bfloat16,
        SPLIT=split, ASM=x.is_cuda if asm is None else asm, num_warps=warps)
    return y
