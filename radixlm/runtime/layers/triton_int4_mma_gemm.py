"""The int4 GEMM for decode batches of 9-64 rows on tensor cores (sm_90): the GEMV's orientation
(layers/triton_int4_mma.py: W the A operand of mma.sync.m16n8k16, 16 weight rows x 16 k,
dequantized in registers into A's fragment from the `mma` layout: layers/int4_mma_layout.py)
with NT = ceil(M / 8) B tiles: x's rows 8 nt .. 8 nt + 7 as the 8 columns of tile nt. A word is
dequantized once and multiplied by every B tile: 11 ALU instructions and NT MMAs a word, and B's
two registers are one 8-byte load of x (x as A would need its 4 registers from two rows, moved
into place: ~27 register moves a word in the sm_90 SASS).

Why: the Triton GEMM (triton_int4_gemm) dequantizes each W tile into shared memory for tl.dot
(~4.5 ALU ops and a 2-byte shared store a value) and reached 0.73-0.90x of cuBLAS bf16 at 64
rows on an H200 (DRAM 12-13% busy).

What a row gets: D = sum over a group's k of (q - z) x on the tensor cores (exact products,
fp32 sums), acc += D * scale per group in fp32: the GEMV's contract (not the Triton GEMM's W
rounded to x's dtype), and each row the same bits as in the GEMV or in any other batch (each
column of an MMA is its own, the same K order).

Work: a program takes WARPS row tiles (one a warp, 16 W rows) and a K range (SPLIT_K programs
a row block, units of one group); its warps walk the same units in step, so x's fragments, read
by every warp, come from L1 after the first. Each warp requests a unit's words, zeros and
scales one unit ahead of its math. Split-K partials are summed in split order by the last
program to arrive (triton_int4_gemm's scheme): deterministic."""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from radixlm.runtime.layers.triton_int4_host import split_counters
from radixlm.runtime.layers.int4_mma_layout import GEMM_DEFAULT, GEMM_MAX_M, GROUPS
from radixlm.runtime.layers.triton_int4_mma import _unit_words, _unit_zs
from radixlm.runtime.layers.triton_ops import pdl

MAX_M = GEMM_MAX_M
DEFAULT = GEMM_DEFAULT  # (WARPS, SPLIT_K cap): sweep in benchmarks/probes/int4_mma_bound.py


@triton.jit
def _dequant(w, zg, zg8, BF16: tl.constexpr):
    # a lane's word -> its 4 registers of (q - z) as bf16 / fp16 pairs (triton_int4_mma._mma's
    # first half): 0 rows g k slots 2c, 2c+1; 1 rows g+8; 2 rows g slots 2c+8, +9; 3 rows g+8
    if BF16:
        return tl.inline_asm_elementwise(
            """{
            .reg .b32 t0, t1, t2;
            shr.u32 t0, $4, 4;
            shr.u32 t1, $4, 8;
            shr.u32 t2, $4, 12;
            lop3.b32 $0, $4, 983055, 1124090624, 234;
            lop3.b32 $1, t0, 983055, 1124090624, 234;
            lop3.b32 $2, t1, 983055, 1124090624, 234;
            lop3.b32 $3, t2, 983055, 1124090624, 234;
            sub.rn.bf16x2 $0, $0, $5;
            sub.rn.bf16x2 $1, $1, $6;
            sub.rn.bf16x2 $2, $2, $5;
            sub.rn.bf16x2 $3, $3, $6;
            }""",
            "=&r,=&r,=&r,=&r,r,r,r", [w, zg, zg8],
            dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True, pack=1)
    else:
        return tl.inline_asm_elementwise(
            """{
            .reg .b32 t0, t1, t2;
            shr.u32 t0, $4, 4;
            shr.u32 t1, $4, 8;
            shr.u32 t2, $4, 12;
            lop3.b32 $0, $4, 983055, 1677747200, 234;
            lop3.b32 $1, t0, 983055, 1677747200, 234;
            lop3.b32 $2, t1, 983055, 1677747200, 234;
            lop3.b32 $3, t2, 983055, 1677747200, 234;
            sub.rn.f16x2 $0, $0, $5;
            sub.rn.f16x2 $1, $1, $6;
            sub.rn.f16x2 $2, $2, $5;
            sub.rn.f16x2 $3, $3, $6;
            }""",
            "=&r,=&r,=&r,=&r,r,r,r", [w, zg, zg8],
            dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True, pack=1)


@triton.jit
def _mma(a0, a1, a2, a3, b0, b1, d, BF16: tl.constexpr):
    # D (a tuple of 4) += A (a0..a3) B (b0, b1): one m16n8k16 a lane
    if BF16:
        return tl.inline_asm_elementwise(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {$0, $1, $2, $3}, "
            "{$8, $9, $10, $11}, {$12, $13}, {$4, $5, $6, $7};",
            "=f,=f,=f,=f,0,1,2,3,r,r,r,r,r,r", [d[0], d[1], d[2], d[3], a0, a1, a2, a3, b0, b1],
            dtype=(tl.float32, tl.float32, tl.float32, tl.float32), is_pure=True, pack=1)
    else:
        return tl.inline_asm_elementwise(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {$0, $1, $2, $3}, "
            "{$8, $9, $10, $11}, {$12, $13}, {$4, $5, $6, $7};",
            "=f,=f,=f,=f,0,1,2,3,r,r,r,r,r,r", [d[0], d[1], d[2], d[3], a0, a1, a2, a3, b0, b1],
            dtype=(tl.float32, tl.float32, tl.float32, tl.float32), is_pure=True, pack=1)


@triton.jit
def _int4_gemm_mma_kernel(X, WD, S, Z, B, Y, WS, CNT, M, N, stride_xm, stride_ym, stride_s,
                          units_per_split, K: tl.constexpr, GROUP: tl.constexpr,
                          NT: tl.constexpr, WARPS: tl.constexpr, SPLIT_K: tl.constexpr,
                          HAS_BIAS: tl.constexpr, BF16: tl.constexpr, PDL: tl.constexpr):
    T: tl.constexpr = 32 * WARPS
    SG: tl.constexpr = GROUP // 16  # k steps a unit (one group)
    UNITS: tl.constexpr = K // GROUP
    KC: tl.constexpr = K // 64
    MAGIC16: tl.constexpr = 0x4300 if BF16 else 0x6400
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    if PDL:  # (triton_ops.pdl)
        gdc_launch_dependents()
    t = tl.arange(0, T)
    lane = t % 32
    g = lane // 4
    c = lane % 4
    rt = pid_n * WARPS + t // 32  # (T,) the warp's row tile
    wp = WD + (rt * KC * 32 + lane) * 4
    zrow = (rt * 16 + g) * stride_s
    # B tile nt: x row 8 nt + g at (16 k + 4c), int64 pointers; rows past M read row M - 1
    # (their columns are never stored: no masked loads, whose zero-fills cost an instruction)
    x64 = X.to(tl.pointer_type(tl.int64), bitcast=True) + c
    u_lo = pid_k * units_per_split
    u_hi = tl.minimum(u_lo + units_per_split, UNITS)
    zero = tl.zeros([T], tl.float32)
    acc = ()
    for i in tl.static_range(NT * 4):  # (B tile, register)
        acc = acc + (zero,)
    dz = acc
    u0 = u_lo + t * 0
    ok = u0 < u_hi
    nw = _unit_words(wp, u0, ok, SG)
    nzg, nzg8, ns0, ns1 = _unit_zs(Z, S, zrow, u0, ok, stride_s, MAGIC16)
    if PDL:  # the first unit's weights are requested; x is the previous kernel's output
        gdc_wait()
    for u in range(u_lo, u_hi):
        w, zg, zg8, s0, s1 = nw, nzg, nzg8, ns0, ns1
        n_ok = u0 + (u + 1 - u_lo) < u_hi  # the next unit's, in flight during this one's math
        nw = _unit_words(wp, u0 + (u + 1 - u_lo), n_ok, SG)
        nzg, nzg8, ns0, ns1 = _unit_zs(Z, S, zrow, u0 + (u + 1 - u_lo), n_ok, stride_s,
                                       MAGIC16)
        d = dz
        for s in tl.static_range(SG):
            a0, a1, a2, a3 = _dequant(w[s], zg, zg8, BF16)
            nd = ()
            for nt in tl.static_range(NT):
                row = tl.minimum(nt * 8 + g, M - 1)
                xb = tl.load(x64 + row * (stride_xm // 4) + (u * SG + s) * 4)
                # (indices written out: a name set in a runtime loop is not a constexpr)
                nd = nd + _mma(a0, a1, a2, a3, xb.to(tl.int32), (xb >> 32).to(tl.int32),
                               (d[nt * 4], d[nt * 4 + 1], d[nt * 4 + 2], d[nt * 4 + 3]), BF16)
            d = nd
        na = ()  # the group's sums, scaled by their W rows' scales, into the row's
        for nt in tl.static_range(NT):
            na = na + (acc[nt * 4] + d[nt * 4] * s0, acc[nt * 4 + 1] + d[nt * 4 + 1] * s0,
                       acc[nt * 4 + 2] + d[nt * 4 + 2] * s1, acc[nt * 4 + 3] + d[nt * 4 + 3] * s1)
        acc = na
    _gemm_mma_epilogue(acc, B, Y, WS, CNT, M, N, stride_ym, pid_n, pid_k, rt, g, c, NT,
                       SPLIT_K, HAS_BIAS)


@triton.jit
def _gemm_mma_epilogue(acc, B, Y, WS, CNT, M, N, stride_ym, pid_n, pid_k, rt, g, c,
                       NT: tl.constexpr, SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr):
    # D's c0, c1 at (row g, column 2c + i), c2, c3 at (g + 8, 2c + i - 2): W row 16 rt + g
    # (+ 8), x row 8 nt + 2c (+ 1)
    if SPLIT_K > 1:
        for nt in tl.static_range(NT):
            for i in tl.static_range(4):
                m = nt * 8 + 2 * c + i % 2
                n = rt * 16 + g + 8 * (i // 2)
                tl.store(WS + (pid_k * M + m).to(tl.int64) * N + n, acc[nt * 4 + i], mask=m < M)
        tl.debug_barrier()  # every thread's partials stored before the release below
        if tl.atomic_add(CNT + pid_n, 1, sem="acq_rel") == SPLIT_K - 1:
            for nt in tl.static_range(NT):
                for i in tl.static_range(4):
                    m = nt * 8 + 2 * c + i % 2
                    n = rt * 16 + g + 8 * (i // 2)
                    y = tl.zeros(m.shape, tl.float32)
                    for sk in tl.static_range(SPLIT_K):
                        y += tl.load(WS + (sk * M + m).to(tl.int64) * N + n, mask=m < M,
                                     other=0.0, cache_modifier=".cg")
                    _store_y(y, B, Y, m, n, M, stride_ym, HAS_BIAS)
            tl.atomic_xchg(CNT + pid_n, 0)
    else:
        for nt in tl.static_range(NT):
            for i in tl.static_range(4):
                m = nt * 8 + 2 * c + i % 2
                n = rt * 16 + g + 8 * (i // 2)
                _store_y(acc[nt * 4 + i], B, Y, m, n, M, stride_ym, HAS_BIAS)


@triton.jit
def _store_y(y, B, Y, m, n, M, stride_ym, HAS_BIAS: tl.constexpr):
    if HAS_BIAS:
        y += tl.load(B + n).to(tl.float32)
    tl.store(Y + m.to(tl.int64) * stride_ym + n, y.to(Y.dtype.element_ty), mask=m < M)


SMS = 132
_COUNTERS: dict = {}


def supported(n: int, k: int, group: int, x_dtype: torch.dtype, warps: int = DEFAULT[0]) -> bool:
    """Whole blocks of WARPS 16-row tiles, whole 64-value chunks, a group of 32, 64 or 128,
    bf16 or fp16 activations (act-order layers keep the Triton GEMM)."""
    return (n % (16 * warps) == 0 and k % 64 == 0 and group in GROUPS
            and k % group == 0 and x_dtype in (torch.bfloat16, torch.float16))


def gemm(x: torch.Tensor, words: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
         group: int, bias: Optional[torch.Tensor] = None,
         config: Optional[tuple] = None) -> torch.Tensor:
    """x (M <= 64, K) bf16 / fp16 -> y (M, N) in x's dtype, W as triton_int4_mma.pack()'s words
    with the layer's (N, G) scales and zeros. config (WARPS, SPLIT_K cap): split-K doubles
    while the programs stay within ~2 an SM, each split >= 2 units."""
    warps, split_cap = config or DEFAULT
    m, k = x.shape
    n = words.shape[0] * 16
    if not (1 <= m <= MAX_M and supported(n, k, group, x.dtype, warps) and x.stride(1) == 1
            and x.stride(0) % 4 == 0 and x.data_ptr() % 8 == 0):
        raise ValueError(f"int4 MMA GEMM: x {tuple(x.shape)} {x.dtype} (stride {x.stride()}), "
                         f"N {n}, group {group}, WARPS {warps}: not supported()")
    nt = triton.next_power_of_2(triton.cdiv(m, 8))  # (1, 2, 4, 8: fewer compiled variants)
    units = k // group
    blocks = n // (16 * warps)
    split = 1
    while split < split_cap and blocks * split * 2 <= 2 * SMS and units // (split * 2) >= 2:
        split *= 2
    per_split = triton.cdiv(units, split)
    split = triton.cdiv(units, per_split)
    cnt = split_counters(_COUNTERS, x.device, blocks, 4096) if split > 1 else None
    if cnt is None:
        split, per_split = 1, units
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    ws = torch.empty((split, m, n), dtype=torch.float32, device=x.device) if split > 1 else y
    _int4_gemm_mma_kernel[(blocks, split)](
        x, words, scales, zeros, bias if bias is not None else x, y, ws,
        cnt if cnt is not None else words, m, n, x.stride(0), y.stride(0), scales.stride(0),
        per_split, K=k, GROUP=group, NT=nt, WARPS=warps, SPLIT_K=split,
        HAS_BIAS=bias is not None, BF16=x.dtype == torch.bfloat16, PDL=pdl(), launch_pdl=pdl(),
        num_warps=warps)
    return y
