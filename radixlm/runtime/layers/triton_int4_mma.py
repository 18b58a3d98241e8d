"""The int4 GEMV for decode batches of 1-8 rows on tensor cores (sm_90: its packed bf16
subtraction): W is the A operand of
mma.sync.m16n8k16 (16 weight rows x 16 k), dequantized in registers straight into the A
fragment; x is B (16 k x 8 columns: batch row n in column n, unused columns zero).

Why: the fp32 GEMVs (triton_int4, triton_int4_tma) spend ~3.6 sm_90 instructions a weight value
in their loop (LOP3 + FADD + FFMA each, plus the rest) and are issue-bound (Nsight on an H200:
the gate_up GEMV 61% issue busy at 8 warps an SM, 1.6x the time of its loads alone). Here one
32-bit word holds exactly one lane's A fragment (8 values), so a word costs 3 SHF + 4 LOP3 +
4 packed subtractions + 1 MMA (~2.5 sm_90 instructions a value in the loop with the loads and
their addresses, ~40-130 registers), and the products and their sums run on the tensor cores.
Measured (H200, benchmarks/probes/int4_mma_bound.py): 1.05-1.21x faster than the TMA GEMV at
the 8B's shapes, 2.1-3.0x faster than cuBLAS bf16.

The words' layout, its packing and the configs: layers/int4_mma_layout.py (read it first).

What a row gets: D = sum over a group's k of (q - z) x on the tensor cores (exact products, fp32
sums), then acc += D * scale per group in fp32: triton_int4.gemv's contract (fp32 products and
sums, the scale applied per block) with another blocking (a group, not 32 values) and the tensor
cores' fp32 sums: the same reference tolerance. A row's result does not depend on the other
rows of the batch (each column of the MMA is its own).

Work: a program takes R row tiles (R = 2 under SILU: the gate tile and its up tile, so the
epilogue has both) and all of K; its WARPS warps take the K units (a unit: one group) u = warp,
warp + WARPS, ...; their sums are added across warps in a fixed order (tl.sum over the warp
axis: deterministic). Each warp requests a unit's words, zeros, scales and x ahead of its math
(loaded in the unit that used them, the kernel was latency-bound: no faster than the TMA GEMV).
Under programmatic dependent launch (triton_ops.pdl) the first unit's weights are requested
before griddepcontrol.wait, x after it.

The per-lane arithmetic is inline PTX over 1-D tensors of 32 * WARPS elements, element t on
thread t (Triton's layout for such a tensor; the GPU tests would catch another): the mma.sync is
warp-wide, every thread of the program runs it with its own fragment."""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from radixlm.runtime.layers.int4_mma_layout import DEFAULT, MAX_M, dequant_ptx, supported
from radixlm.runtime.layers.triton_ops import pdl

def _dequant_mma_asm(kind: str, magic: int) -> str:
    # one lane's step (operands: $0-$3 D, $4-$7 C, $8 the word, $9 / $10 the packed (magic + z)
    # of rows g / g + 8, $11 / $12 B): 4 A registers of (q - z) pairs, then the MMA
    mma = f"mma.sync.aligned.m16n8k16.row.col.f32.{kind}.{kind}.f32"
    return dequant_ptx(kind, magic, f"""    {mma} {{$0, $1, $2, $3}},
        {{a0, a1, a2, a3}}, {{$11, $12}}, {{$4, $5, $6, $7}};""")


# (lop3 0xEA = (a & b) | c: a register's two nibbles into 128.0 bf16 / 1024.0 fp16 pairs)
_ASM_BF16 = tl.constexpr(_dequant_mma_asm("bf16", 0x43004300))
_ASM_F16 = tl.constexpr(_dequant_mma_asm("f16", 0x64006400))


@triton.jit
def _mma(w, zg, zg8, xb, d0, d1, d2, d3, BF16: tl.constexpr):
    # one m16n8k16 a lane: w its A word, zg / zg8 the packed (magic + z) of rows g / g + 8,
    # xb its B registers as one int64 (low word: k slots 2c, 2c+1; high: 2c+8, 2c+9), d its
    # accumulators -> the new accumulators
    b0 = xb.to(tl.int32)
    b1 = (xb >> 32).to(tl.int32)
    return tl.inline_asm_elementwise(
        _ASM_BF16 if BF16 else _ASM_F16,
        "=f,=f,=f,=f,f,f,f,f,r,r,r,r,r", [d0, d1, d2, d3, w, zg, zg8, b0, b1],
        dtype=(tl.float32, tl.float32, tl.float32, tl.float32), is_pure=True, pack=1)


@triton.jit
def _split(v):
    # (T, 2) or (T, 4) -> its columns as (T,) tensors, padded to 4 (each thread holds its row:
    # register renaming, no data movement)
    if v.shape[1] == 2:
        a, b = tl.split(v)
        return a, b, a, b
    else:
        ev, od = tl.split(tl.reshape(v, (v.shape[0], 2, 2)))  # (0, 2), (1, 3)
        a, c = tl.split(ev)
        b, d = tl.split(od)
        return a, b, c, d


@triton.jit
def _unit_words(wp, u, ok, S: tl.constexpr):
    # a lane's S words of unit u (group u: k steps S u .. S u + S - 1) of a row tile; wp (T,)
    # the lane's word 0 of the tile's chunk 0 -> 8 (T,) (padded), one 8- or 16-byte load a
    # chunk ((T, 2) / (T, 4) tensors: a thread's row, never split across threads)
    W: tl.constexpr = 2 if S == 2 else 4
    ks0 = u * S  # (T,) the unit's first k step: a multiple of S, within one chunk for S <= 4
    base = (ks0 // 4) * 128 + ks0 % 4
    lo = tl.load(wp[:, None] + base[:, None] + tl.arange(0, W)[None, :], mask=ok[:, None],
                 other=0, eviction_policy="evict_first")
    w0, w1, w2, w3 = _split(lo)
    if S == 8:  # the unit's second chunk
        hi = tl.load(wp[:, None] + (base + 128)[:, None] + tl.arange(0, 4)[None, :],
                     mask=ok[:, None], other=0, eviction_policy="evict_first")
        w4, w5, w6, w7 = _split(hi)
        return w0, w1, w2, w3, w4, w5, w6, w7
    return w0, w1, w2, w3, w0, w1, w2, w3


@triton.jit
def _unit_zs(Z, S, zrow, u, ok, stride_s, MAGIC16: tl.constexpr):
    # the packed (magic + z) of a lane's rows g and g + 8 (zrow: row g's offset in Z and S) at
    # group u, and their scales in fp32
    z0 = tl.load(Z + zrow + u, mask=ok, other=0).to(tl.int32)
    z1 = tl.load(Z + zrow + 8 * stride_s + u, mask=ok, other=0).to(tl.int32)
    return ((z0 | MAGIC16) * 65537, (z1 | MAGIC16) * 65537,
            tl.load(S + zrow + u, mask=ok, other=0.0).to(tl.float32),
            tl.load(S + zrow + 8 * stride_s + u, mask=ok, other=0.0).to(tl.float32))


@triton.jit
def _unit_weights(wp_a, wp_b, Z, S, zrow_a, zrow_b, u, ok, stride_s, SG: tl.constexpr,
                  R: tl.constexpr, MAGIC16: tl.constexpr):
    # what unit u reads of the program's tiles but x: a tuple of 24 (T,) tensors, tile a's 8
    # words (padded), packed zeros of rows g / g + 8 and their scales, then tile b's (tile a's
    # again when R == 1)
    wa = _unit_words(wp_a, u, ok, SG)
    za = _unit_zs(Z, S, zrow_a, u, ok, stride_s, MAGIC16)
    if R == 2:
        return wa + za + _unit_words(wp_b, u, ok, SG) + _unit_zs(Z, S, zrow_b, u, ok, stride_s,
                                                                  MAGIC16)
    return wa + za + wa + za


@triton.jit
def _step_x(xp, P, xrow, ks, c, ok, HAS_PERM: tl.constexpr):
    # a lane's B registers at k step ks: x[g, 16 ks + 4c + 0..3] as 2 bf16 / fp16 pairs in one
    # int64 (column g = batch row g; 0 where not ok). xp: (T,) int64 pointers at x[g, 4c] (no
    # perm); xrow: (T,) pointers at x[g, 0] (perm)
    if HAS_PERM:  # act-order: x's columns gathered through perm (stored order)
        kk = tl.load(P + (ks * 16 + 4 * c)[:, None] + tl.arange(0, 4)[None, :],
                     mask=ok[:, None], other=0)
        v = tl.load(xrow[:, None] + kk, mask=ok[:, None], other=0.0)
        bits = v.to(tl.int16, bitcast=True).to(tl.int64) & 0xFFFF  # (T, 4)
        sh = tl.arange(0, 4)[None, :].to(tl.int64) * 16
        return tl.sum(bits << sh, axis=1)
    else:
        return tl.load(xp + ks * 4, mask=ok, other=0)


@triton.jit
def _unit_x(xp, P, xrow, u, c, ok, S: tl.constexpr, HAS_PERM: tl.constexpr):
    # the B registers of unit u's S k steps: 8 (T,) int64 (padded)
    x0 = _step_x(xp, P, xrow, u * S, c, ok, HAS_PERM)
    x1 = _step_x(xp, P, xrow, u * S + 1, c, ok, HAS_PERM)
    if S == 2:
        return x0, x1, x0, x1, x0, x1, x0, x1
    x2 = _step_x(xp, P, xrow, u * S + 2, c, ok, HAS_PERM)
    x3 = _step_x(xp, P, xrow, u * S + 3, c, ok, HAS_PERM)
    if S == 4:
        return x0, x1, x2, x3, x0, x1, x2, x3
    x4 = _step_x(xp, P, xrow, u * S + 4, c, ok, HAS_PERM)
    x5 = _step_x(xp, P, xrow, u * S + 5, c, ok, HAS_PERM)
    x6 = _step_x(xp, P, xrow, u * S + 6, c, ok, HAS_PERM)
    x7 = _step_x(xp, P, xrow, u * S + 7, c, ok, HAS_PERM)
    return x0, x1, x2, x3, x4, x5, x6, x7


@triton.jit
def _int4_gemv_mma_kernel(X, WD, S, Z, P, B, Y, M, N_OUT, stride_xm, stride_ym, stride_s,
                          K: tl.constexpr, GROUP: tl.constexpr, R: tl.constexpr,
                          WARPS: tl.constexpr, SILU: tl.constexpr, HAS_BIAS: tl.constexpr,
                          HAS_PERM: tl.constexpr, BF16: tl.constexpr, AHEAD: tl.constexpr,
                          PDL: tl.constexpr):
    # A warp walks units u = warp, warp + WARPS, ... (a unit: one group, SG = GROUP / 16 k
    # steps); everything a unit reads is requested ahead of its math (words, zeros and scales
    # AHEAD units, x one unit), so that a warp's math never waits on a load issued in the
    # same unit and a warp keeps AHEAD units of words in flight.
    T: tl.constexpr = 32 * WARPS
    SG: tl.constexpr = GROUP // 16  # k steps a unit (2, 4 or 8)
    UNITS: tl.constexpr = K // GROUP
    ITERS: tl.constexpr = (UNITS + WARPS - 1) // WARPS
    KC: tl.constexpr = K // 64
    MAGIC16: tl.constexpr = 0x4300 if BF16 else 0x6400  # 128.0 bf16 / 1024.0 fp16
    pid = tl.program_id(0)
    if PDL:  # (programmatic dependent launch: the next kernel's programs may start now)
        gdc_launch_dependents()
    t = tl.arange(0, T)
    lane = t % 32
    warp = t // 32
    g = lane // 4
    c = lane % 4
    x_ok = g < M
    rt_a = pid if SILU else pid * R  # the program's tiles: a, and b (R == 2)
    rt_b = pid + N_OUT // 16 if SILU else pid * R + 1
    # per-lane bases: word 0 at chunk 0 of each tile, Z / S rows g, x at (g, 4c) or (g, 0)
    wp_a = WD + (rt_a * KC * 32 + lane) * 4
    wp_b = WD + (rt_b * KC * 32 + lane) * 4
    zrow_a = (rt_a * 16 + g) * stride_s
    zrow_b = (rt_b * 16 + g) * stride_s
    xrow = X + g * stride_xm
    xp = X.to(tl.pointer_type(tl.int64), bitcast=True) + g * (stride_xm // 4) + c
    zero = tl.zeros([T], tl.float32)
    acc_a0, acc_a1, acc_a2, acc_a3 = zero, zero, zero, zero
    acc_b0, acc_b1, acc_b2, acc_b3 = zero, zero, zero, zero
    # the first AHEAD units (u = warp, warp + WARPS) requested before the loop: words, zeros
    # and scales AHEAD units ahead of the math, x one unit ahead; a unit's weights are one
    # tuple, _unit_weights' (tile a's 8 words, zeros, scales; tile b's)
    ok = warp < UNITS
    nw = _unit_weights(wp_a, wp_b, Z, S, zrow_a, zrow_b, warp, ok, stride_s, SG, R, MAGIC16)
    mw = nw  # (the second unit ahead: AHEAD == 2 only)
    if AHEAD == 2:
        mw = _unit_weights(wp_a, wp_b, Z, S, zrow_a, zrow_b, warp + WARPS,
                           warp + WARPS < UNITS, stride_s, SG, R, MAGIC16)
    if PDL:  # the weights above are requested; x is the previous kernel's output
        gdc_wait()
    nx = _unit_x(xp, P, xrow, warp, c, x_ok & ok, SG, HAS_PERM)
    for it in range(ITERS):
        u = warp + it * WARPS  # (T,): the warp's unit
        cw, xs = nw, nx
        # the loads of the unit AHEAD units on, in flight during this unit's math
        far = u + AHEAD * WARPS
        fw = _unit_weights(wp_a, wp_b, Z, S, zrow_a, zrow_b, far, far < UNITS, stride_s, SG, R,
                           MAGIC16)
        if AHEAD == 2:
            nw, mw = mw, fw
        else:
            nw = fw
        nxt = u + WARPS
        nx = _unit_x(xp, P, xrow, nxt, c, x_ok & (nxt < UNITS), SG, HAS_PERM)
        z_a0, z_a1, s_a0, s_a1 = cw[8], cw[9], cw[10], cw[11]
        z_b0, z_b1, s_b0, s_b1 = cw[20], cw[21], cw[22], cw[23]
        da0, da1, da2, da3 = zero, zero, zero, zero
        db0, db1, db2, db3 = zero, zero, zero, zero
        for s in tl.static_range(SG):
            da0, da1, da2, da3 = _mma(cw[s], z_a0, z_a1, xs[s], da0, da1, da2, da3, BF16)
            if R == 2:
                db0, db1, db2, db3 = _mma(cw[12 + s], z_b0, z_b1, xs[s], db0, db1, db2, db3,
                                          BF16)
        # the group's sums, scaled, into the row's (x of a unit past K is 0: D is 0)
        acc_a0 += da0 * s_a0
        acc_a1 += da1 * s_a0
        acc_a2 += da2 * s_a1
        acc_a3 += da3 * s_a1
        if R == 2:
            acc_b0 += db0 * s_b0
            acc_b1 += db1 * s_b0
            acc_b2 += db2 * s_b1
            acc_b3 += db3 * s_b1
    _mma_epilogue(acc_a0, acc_a1, acc_a2, acc_a3, acc_b0, acc_b1, acc_b2, acc_b3, B, Y, M,
                  stride_ym, rt_a, rt_b, R, WARPS, SILU, HAS_BIAS)


@triton.jit
def _warp_sum(v, WARPS: tl.constexpr):
    # (32 * WARPS,) -> (32,): lane l's sum over the warps, in a fixed order
    return tl.sum(tl.reshape(v, (WARPS, 32)), axis=0)


@triton.jit
def _mma_epilogue(a0, a1, a2, a3, b0, b1, b2, b3, B, Y, M, stride_ym, rt_a, rt_b,
                  R: tl.constexpr, WARPS: tl.constexpr, SILU: tl.constexpr,
                  HAS_BIAS: tl.constexpr):
    # D's c0, c1 at (row g, column 2c + i), c2, c3 at (row g + 8, column 2c + i - 2): batch row
    # n = 2c + (0 or 1) of rows 16 rt + g and + 8
    l = tl.arange(0, 32)
    g = l // 4
    c = l % 4
    n0 = 2 * c
    n1 = n0 + 1
    a0, a1 = _warp_sum(a0, WARPS), _warp_sum(a1, WARPS)
    a2, a3 = _warp_sum(a2, WARPS), _warp_sum(a3, WARPS)
    if R == 2:
        b0, b1 = _warp_sum(b0, WARPS), _warp_sum(b1, WARPS)
        b2, b3 = _warp_sum(b2, WARPS), _warp_sum(b3, WARPS)
    if SILU:  # rows of the gate tile a; up tile b's same rows: the output's rows 16 rt_a + ..
        _mma_store(a0, b0, B, Y, rt_a * 16 + g, n0, M, stride_ym, HAS_BIAS, SILU)
        _mma_store(a1, b1, B, Y, rt_a * 16 + g, n1, M, stride_ym, HAS_BIAS, SILU)
        _mma_store(a2, b2, B, Y, rt_a * 16 + g + 8, n0, M, stride_ym, HAS_BIAS, SILU)
        _mma_store(a3, b3, B, Y, rt_a * 16 + g + 8, n1, M, stride_ym, HAS_BIAS, SILU)
    else:
        _mma_store(a0, a0, B, Y, rt_a * 16 + g, n0, M, stride_ym, HAS_BIAS, SILU)
        _mma_store(a1, a1, B, Y, rt_a * 16 + g, n1, M, stride_ym, HAS_BIAS, SILU)
        _mma_store(a2, a2, B, Y, rt_a * 16 + g + 8, n0, M, stride_ym, HAS_BIAS, SILU)
        _mma_store(a3, a3, B, Y, rt_a * 16 + g + 8, n1, M, stride_ym, HAS_BIAS, SILU)
        if R == 2:
            _mma_store(b0, b0, B, Y, rt_b * 16 + g, n0, M, stride_ym, HAS_BIAS, SILU)
            _mma_store(b1, b1, B, Y, rt_b * 16 + g, n1, M, stride_ym, HAS_BIAS, SILU)
            _mma_store(b2, b2, B, Y, rt_b * 16 + g + 8, n0, M, stride_ym, HAS_BIAS, SILU)
            _mma_store(b3, b3, B, Y, rt_b * 16 + g + 8, n1, M, stride_ym, HAS_BIAS, SILU)


@triton.jit
def _mma_store(y, u, B, Y, rows, n, M, stride_ym, HAS_BIAS: tl.constexpr, SILU: tl.constexpr):
    ok = n < M
    if SILU:
        # the roundings of the unfused path (triton_int4_dequant._gemv_store)
        gt = y.to(Y.dtype.element_ty).to(tl.float32)
        up = u.to(Y.dtype.element_ty).to(tl.float32)
        y = (gt / (1.0 + tl.exp(-gt))).to(Y.dtype.element_ty).to(tl.float32) * up
    elif HAS_BIAS:
        y += tl.load(B + rows).to(tl.float32)
    tl.store(Y + n.to(tl.int64) * stride_ym + rows, y.to(Y.dtype.element_ty), mask=ok)


def gemv(x: torch.Tensor, words: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
         group: int, bias: Optional[torch.Tensor] = None, perm: Optional[torch.Tensor] = None,
         silu: bool = False, config: Optional[tuple] = None) -> torch.Tensor:
    """x (M <= 8, K) bf16 / fp16 -> y (M, n_out) in x's dtype, W as pack()'s words of the layer's
    (N, K) weights with its (N, G) scales and zeros (int4_linear's buffers); silu: W is
    [gate | up] (N = 2 n_out), y = silu(x W_gate^T) * (x W_up^T) with the unfused roundings."""
    r, warps, *rest = config or DEFAULT
    ahead = rest[0] if rest else 1
    m, k = x.shape
    n = words.shape[0] * 16
    n_out = n // 2 if silu else n
    if silu:
        r = 2
    if not (1 <= m <= MAX_M and supported(n, k, group, x.dtype, silu, r)
            and x.stride(1) == 1 and x.stride(0) % 4 == 0 and x.data_ptr() % 8 == 0):
        raise ValueError(f"int4 MMA GEMV: x {tuple(x.shape)} {x.dtype} (stride {x.stride()}), "
                         f"N {n}, group {group}, silu {silu}, R {r}: not supported()")
    assert not (silu and bias is not None)
    y = torch.empty((m, n_out), dtype=x.dtype, device=x.device)
    grid = (n_out // 16 if silu else n_out // (16 * r),)
    _int4_gemv_mma_kernel[grid](
        x, words, scales, zeros, perm if perm is not None else words,
        bias if bias is not None else x, y, m, n_out, x.stride(0), y.stride(0),
        scales.stride(0), K=k, GROUP=group, R=r, WARPS=warps, SILU=silu,
        HAS_BIAS=bias is not None, HAS_PERM=perm is not None, BF16=x.dtype == torch.bfloat16,
        AHEAD=ahead, PDL=pdl(x.device), launch_pdl=pdl(x.device), num_warps=warps)
    return y
