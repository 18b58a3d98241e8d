"""The int4 GEMM for 9-64 rows on Hopper's warpgroup MMA, over the `mma` words of the
tensor-core GEMV (layers/int4_mma_layout.py: read it first), written in Gluon (Triton's
explicit-layout dialect) because plain Triton cannot put a dequantized tile into wgmma's A
registers without a trip through shared memory.

Why: the Triton GEMM (triton_int4_gemm) makes W the B operand, so every dequantized value is
stored to shared memory one by one before the MMA reads it back; at 64 rows it ran at 0.85x of
cuBLAS bf16 end to end. Here the product is computed transposed, Y^T (N, M) = W (N, K) x^T:
  - W is wgmma's A operand in registers: a lane's `mma` word is exactly its A fragment of one
    16 x 16 tile (rows g, g + 8; k slots 2c, 2c + 1, 2c + 8, 2c + 9), so a word becomes 8 exact
    (q - z) values by the GEMV's PTX (3 SHF, 4 LOP3 into magic floats, 4 packed subtractions)
    and goes to the tensor cores without moving between threads (the layout conversion is
    asserted trivial at compile time);
  - x^T is B, in shared memory (wgmma's rule): a step's (BM, STEP) tile, its k slots in the
    words' order (slot 16u + 8p + 2c + e holds k = 16u + 4c + 2p + e: the order the GEMV's B
    registers use), loaded into registers a step ahead and stored permuted;
  - the batch is wgmma's N (BM = 16, 32 or 64 columns; past 64 rows, tiles of 64 on a grid
    axis): each weight is read and dequantized once for all the rows of its tile.
A row's result: per group D = sum over k of (q - z) x by the tensor cores (exact products,
fp32 sums), then acc += D * scale in fp32: the GEMV's contract (triton_int4_mma), the same
reference tolerance.

Work: a program takes BN = 16 x WARPS x RREP weight rows (WARPS warps, RREP 64-row repetitions
of the warpgroup's MMA) and a split of K's groups, in steps of STEP k (one MMA chain each, SPG
a group). Each step's MMA is waited for before the next dequantizes (two or three programs an
SM overlap each other's MMAs and ALU work), or under ASYNC a group's MMAs stay in flight while
its later steps dequantize, waited for at the group's end: an MMA in flight across the per-group
scaling made ptxas serialize every wgmma (C7515: the accumulator's copies), hence the group
boundary. Configs (warps, step, split-K, a register cap, ASYNC) per GPU and shape:
int4_wgmma_configs.py.
Split-K partials are reduced deterministically by the split that arrives last (triton_int4_gemm's
scheme)."""

from __future__ import annotations

from typing import Optional

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared,
                                                              warpgroup_mma,
                                                              warpgroup_mma_wait)

from radixlm.runtime.layers.int4_mma_layout import dequant_ptx
from radixlm.runtime.layers.int4_wgmma_configs import bm_for, default_config, split_for, supported
from radixlm.runtime.layers.triton_int4_host import split_counters

# the CTA-wide barrier: gl.thread_barrier in Triton 3.6 (the GPU image's), gl.barrier in 3.7
_cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier


def _dequant_asm(kind: str, magic: int) -> str:
    # $0-$7 the 8 outputs (a0.lo, a0.hi, a1.lo, .. a3.hi: a register i's two 16-bit halves),
    # $8 the word, $9 / $10 the packed (magic + z) of rows g / g + 8
    return dequant_ptx(kind, magic, """    mov.b32 {$0, $1}, a0;
    mov.b32 {$2, $3}, a1;
    mov.b32 {$4, $5}, a2;
    mov.b32 {$6, $7}, a3;""")


_ASM_BF16 = gl.constexpr(_dequant_asm("bf16", 0x43004300))
_ASM_F16 = gl.constexpr(_dequant_asm("f16", 0x64006400))


@gluon.jit
def _dequant(w, zg, zg8, A_LAYOUT: gl.constexpr, BN: gl.constexpr, STEP: gl.constexpr,
             BF16: gl.constexpr):
    # w (RT, 32 lanes, CP, J) int32 words of a step's tile, zg / zg8 the packed (magic + z) of
    # rows g / g + 8 broadcast to w's shape -> (BN, STEP) (q - z) in A's register layout, column =
    # k slot 16u + 8p + 2c + e
    zg, _ = gl.broadcast(zg, w)
    zg8, _ = gl.broadcast(zg8, w)
    if BF16:
        o = gl.inline_asm_elementwise(_ASM_BF16, "=h,=h,=h,=h,=h,=h,=h,=h,r,r,r", [w, zg, zg8],
                                      dtype=(gl.bfloat16, ) * 8, is_pure=True, pack=1)
    else:
        o = gl.inline_asm_elementwise(_ASM_F16, "=h,=h,=h,=h,=h,=h,=h,=h,r,r,r", [w, zg, zg8],
                                      dtype=(gl.float16, ) * 8, is_pure=True, pack=1)
    # register i = 2p + h holds (row g + 8h, slots 8p + 2c + e), e = its half
    p0 = gl.join(gl.join(o[0], o[1]), gl.join(o[2], o[3]))  # (..., e, h)
    p1 = gl.join(gl.join(o[4], o[5]), gl.join(o[6], o[7]))
    v = gl.join(p0, p1)  # (RT, 32 lanes, CP, J, e, h, p)
    v = gl.reshape(v, (v.shape[0], 8, 4, v.shape[2], v.shape[3], 2, 2, 2))  # lane = 4g + c
    v = gl.permute(v, (0, 6, 1, 3, 4, 7, 2, 5))  # (RT, h, g, CP, J, p, c, e): u = 4 cp + j
    return gl.convert_layout(gl.reshape(v, (BN, STEP)), A_LAYOUT, assert_trivial=True)


@gluon.jit
def _x_slots(x, BM: gl.constexpr, STEP: gl.constexpr):
    # x (BM, STEP) in k order -> its columns in slot order (slot 16u + 8p + 2c + e = k 16u +
    # 4c + 2p + e; c = 2 ch + cl): k = 16u + 8ch + 4cl + 2p + e, slot = 16u + 8p + 4ch + 2cl + e
    x6 = gl.reshape(x, (BM, STEP // 16, 2, 2, 2, 2))  # (m, u, ch, cl, p, e)
    return gl.reshape(gl.permute(x6, (0, 1, 4, 2, 3, 5)), (BM, STEP))


@gluon.jit
def _load_w(WD, Z, w_off, z_off, gi, h, stride_s, U: gl.constexpr, US: gl.constexpr,
            MAGIC16: gl.constexpr):
    # step h of group gi: its words (RT, 32, CP, J) and the packed (magic + z) of rows g and
    # g + 8 (RT, 32, 1, 1) int32 (no masks: every index the kernel passes is in range). Its
    # first k step (16 k) ks = gi U + h US lies in chunk ks // 4 (128 words a row tile) at step
    # ks % 4, written so that the offset's alignment (16 or 8 bytes) is visible: vector loads
    if US >= 4:
        off = gi * (U // 4 * 128) + h * (US // 4 * 128)
    else:  # a step of 32 k: half a chunk
        ks = gi * U + h * US
        off = (ks // 4) * 128 + (ks // US % (4 // US)) * US
    words = gl.load(WD + w_off + off)
    z0 = gl.load(Z + z_off + gi).to(gl.int32)
    z1 = gl.load(Z + z_off + 8 * stride_s + gi).to(gl.int32)
    return words, (z0 | MAGIC16) * 65537, (z1 | MAGIC16) * 65537


@gluon.jit
def _load_x(P, x_rows, xk, gi, h, GROUP: gl.constexpr, STEP: gl.constexpr,
            HAS_PERM: gl.constexpr):
    # step h of group gi's x tile (BM, STEP) in k order (act-order: x's columns gathered
    # through perm); rows past M read row M - 1 (x_rows is clamped: their columns of Y^T are
    # not stored)
    cols = gi * GROUP + h * STEP + xk
    if HAS_PERM:
        cols = gl.load(P + cols)
    return gl.load(x_rows + gl.expand_dims(cols, 0))


@gluon.jit
def _int4_gemm_wgmma_kernel(X, WD, S, Z, P, B, Y, WS, CNT, M, N, stride_xm, stride_ym, stride_s,
                            groups_per_split, K: gl.constexpr, GROUP: gl.constexpr,
                            BM: gl.constexpr, RREP: gl.constexpr, STEP: gl.constexpr,
                            ASYNC: gl.constexpr, SPLIT_K: gl.constexpr,
                            HAS_BIAS: gl.constexpr, HAS_PERM: gl.constexpr, BF16: gl.constexpr,
                            num_warps: gl.constexpr):
    WARPS: gl.constexpr = num_warps
    RT: gl.constexpr = WARPS * RREP  # 16-row tiles a program
    BN: gl.constexpr = 16 * RT
    U: gl.constexpr = GROUP // 16  # k steps (16 k) a group
    US: gl.constexpr = STEP // 16  # ... a step of the loop (one MMA: STEP k)
    SPG: gl.constexpr = GROUP // STEP  # loop steps a group
    J: gl.constexpr = 4 if US >= 4 else US  # ... within a chunk (64 k: 16 bytes a lane)
    CP: gl.constexpr = US // J  # chunks a loop step
    KC: gl.constexpr = K // 64
    G: gl.constexpr = K // GROUP
    MAGIC16: gl.constexpr = 0x4300 if BF16 else 0x6400  # 128.0 bf16 / 1024.0 fp16
    DT: gl.constexpr = gl.bfloat16 if BF16 else gl.float16
    # the words of a group's tile: (RT, 32 lanes, CP, J), a lane's J words one load; tile rt of
    # the program on warp rt % WARPS (wgmma's 16-row slice of a warp), repetition rt // WARPS
    WL: gl.constexpr = gl.BlockedLayout([1, 1, 1, J], [1, 32, 1, 1], [WARPS, 1, 1, 1],
                                        [3, 2, 1, 0])
    L3: gl.constexpr = gl.SliceLayout(3, WL)
    L2: gl.constexpr = gl.SliceLayout(2, L3)
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                  instr_shape=[16, BM, 16])
    AL: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    TK: gl.constexpr = STEP // 8 if STEP // 8 < 32 else 32  # x: 16 bytes a thread a row
    XL: gl.constexpr = gl.BlockedLayout([1, 8], [32 // TK, TK], [WARPS, 1], [1, 0])
    XS: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128 if STEP >= 64 else 64,
                                            element_bitwidth=16, rank=2)
    pid_n = gl.program_id(0)
    pid_k = gl.program_id(1)
    m0 = gl.program_id(2) * BM  # the batch tile (rows m0 .. m0 + BM of x)
    n0 = pid_n * BN
    rt = gl.expand_dims(gl.expand_dims(gl.expand_dims(
        gl.arange(0, RT, layout=gl.SliceLayout(1, L2)), 1), 2), 3)  # (RT, 1, 1, 1)
    ln = gl.expand_dims(gl.expand_dims(gl.expand_dims(
        gl.arange(0, 32, layout=gl.SliceLayout(0, L2)), 0), 2), 3)  # (1, 32, 1, 1)
    cp = gl.expand_dims(gl.expand_dims(gl.expand_dims(
        gl.arange(0, CP, layout=gl.SliceLayout(0, gl.SliceLayout(1, L3))), 0), 1), 3)
    jj = gl.expand_dims(gl.expand_dims(gl.expand_dims(
        gl.arange(0, J, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, WL)))),
        0), 1), 2)
    rt_g = pid_n * RT + rt
    w_off = (rt_g * KC * 32 + ln) * 4 + cp * 128 + jj  # (RT, 32, CP, J): k step 0's word
    z_off = (rt_g * 16 + ln // 4) * stride_s  # (RT, 32, 1, 1): row g of the lane's tile
    s_off = (n0 + gl.arange(0, BN, layout=gl.SliceLayout(1, MMA))) * stride_s  # (BN,)
    xm = gl.arange(0, BM, layout=gl.SliceLayout(1, XL))
    xk = gl.arange(0, STEP, layout=gl.SliceLayout(0, XL))
    x_rows = X + gl.expand_dims(gl.minimum(m0 + xm, M - 1).to(gl.int64) * stride_xm, 1)
    NBUF: gl.constexpr = SPG if ASYNC and SPG > 2 else 2
    xs = gl.allocate_shared_memory(DT, [NBUF, BM, STEP], XS)  # x^T tiles

    g_lo = pid_k * groups_per_split
    g_hi = gl.minimum(g_lo + groups_per_split, G)
    acc = gl.zeros([BN, BM], gl.float32, MMA)
    d = acc
    w, zg, zg8 = _load_w(WD, Z, w_off, z_off, g_lo, 0, stride_s, U, US, MAGIC16)
    xt = _load_x(P, x_rows, xk, g_lo, 0, GROUP, STEP, HAS_PERM)
    for gi in range(g_lo, g_hi):
        sc = gl.load(S + s_off + gi).to(gl.float32)
        alive = ()  # (ASYNC: the A registers of the group's MMAs in flight)
        for h in gl.static_range(SPG):
            # dequantize step h of group gi and store its x^T tile, request the next step's
            # loads, then the MMA. Sync: buffer (gi SPG + h) % 2 (its last reader, the MMA two
            # steps back, finished before the last step's barrier). ASYNC: buffer h, the
            # group's MMAs chained in flight while the next steps dequantize, waited for at the
            # group's end
            a = _dequant(w, zg, zg8, AL, BN, STEP, BF16)
            if ASYNC:
                xb = xs.index(h)
            else:
                xb = xs.index((gi * SPG + h) % 2)
            xb.store(_x_slots(xt, BM, STEP))
            if h + 1 < SPG:
                w, zg, zg8 = _load_w(WD, Z, w_off, z_off, gi, h + 1, stride_s, U, US, MAGIC16)
                xt = _load_x(P, x_rows, xk, gi, h + 1, GROUP, STEP, HAS_PERM)
            else:
                nxt = gl.minimum(gi + 1, g_hi - 1)  # (the last group's again at the end)
                w, zg, zg8 = _load_w(WD, Z, w_off, z_off, nxt, 0, stride_s, U, US, MAGIC16)
                xt = _load_x(P, x_rows, xk, nxt, 0, GROUP, STEP, HAS_PERM)
            fence_async_shared()
            _cta_barrier()  # every thread's x stored (and fenced) before the MMA reads it
            if ASYNC:
                d = warpgroup_mma(a, xb.permute((1, 0)), d, use_acc=h > 0, is_async=True)
                alive = alive + (a, )
            else:
                d = warpgroup_mma(a, xb.permute((1, 0)), d, use_acc=h > 0)
        if ASYNC:
            d = warpgroup_mma_wait(num_outstanding=0, deps=(d, ) + alive)[0]
            _cta_barrier()  # both warpgroups' MMAs done before buffer 0 is stored again
        acc += d * gl.expand_dims(sc, 1)
    _epilogue(acc, B, Y, WS, CNT, M, N, m0, n0, pid_n, pid_k, stride_ym, BN, BM, WARPS,
              SPLIT_K, HAS_BIAS)


@gluon.jit
def _epilogue(acc, B, Y, WS, CNT, M, N, m0, n0, pid_n, pid_k, stride_ym, BN: gl.constexpr,
              BM: gl.constexpr, WARPS: gl.constexpr, SPLIT_K: gl.constexpr,
              HAS_BIAS: gl.constexpr):
    # acc (BN, BM) = Y^T's tile -> Y[m, n0 + i] (lanes along n: 64-byte runs a warp)
    OL: gl.constexpr = gl.BlockedLayout([1, 1], [32, 1], [1, WARPS], [0, 1])
    out = gl.convert_layout(acc, OL)
    on = n0 + gl.arange(0, BN, layout=gl.SliceLayout(1, OL))
    om = m0 + gl.arange(0, BM, layout=gl.SliceLayout(0, OL))
    ok = gl.expand_dims(om < M, 0) & gl.expand_dims(on < N, 1)
    if SPLIT_K > 1:
        # deterministic split-K (triton_int4_gemm's scheme): each split stores its fp32
        # partial; the one that arrives last sums them in split order and resets the counter
        mn = gl.expand_dims(om.to(gl.int64), 0) * N + gl.expand_dims(on, 1)
        gl.store(WS + pid_k.to(gl.int64) * M * N + mn, out, mask=ok)
        _cta_barrier()
        tile = gl.program_id(2) * gl.num_programs(0) + pid_n
        if gl.atomic_add(CNT + tile, 1, sem="acq_rel") == SPLIT_K - 1:
            out = gl.zeros([BN, BM], gl.float32, OL)
            for sk in gl.static_range(SPLIT_K):
                out += gl.load(WS + sk * M.to(gl.int64) * N + mn, mask=ok, other=0.0,
                               cache_modifier=".cg")
            _store(out, B, Y, on, om, ok, stride_ym, HAS_BIAS)
            gl.atomic_xchg(CNT + tile, 0)
    else:
        _store(out, B, Y, on, om, ok, stride_ym, HAS_BIAS)


@gluon.jit
def _store(out, B, Y, on, om, ok, stride_ym, HAS_BIAS: gl.constexpr):
    if HAS_BIAS:
        out += gl.expand_dims(gl.load(B + on).to(gl.float32), 1)
    ptrs = Y + gl.expand_dims(om.to(gl.int64) * stride_ym, 0) + gl.expand_dims(on, 1)
    gl.store(ptrs, out.to(Y.dtype.element_ty), mask=ok)


_COUNTERS: dict = {}  # device -> split-K arrival counters (self-resetting)


def gemm(x: torch.Tensor, words: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
         group: int, bias: Optional[torch.Tensor] = None, perm: Optional[torch.Tensor] = None,
         config: Optional[tuple] = None) -> torch.Tensor:
    """x (M, K) bf16 / fp16 -> y (M, N) in x's dtype; W as int4_mma_layout.pack()'s words of the
    layer's (N, K) weights with its (N, G) scales and zeros; batch tiles of bm_for(M) rows (a
    grid axis above 64). config (None: config_for's default): (WARPS, RREP),
    + STEP (32, 64 or 128 k an MMA, <= group; None: min(group, 64)), + SPLIT_K (None:
    split_for), + MAXNREG (a register cap a thread; None: ptxas's choice), + ASYNC (1: a
    group's MMAs in flight while its next steps dequantize; None / 0: each MMA waited for)."""
    m, k = x.shape
    n = words.shape[0] * 16
    cfg = tuple(config or default_config(n, group, m))
    warps, rrep, step, split, maxnreg, asy = cfg + (None,) * (6 - len(cfg))
    step = step or min(group, 64)
    if not (m >= 1 and supported(n, k, group, x.dtype, warps, rrep)
            and x.stride(1) == 1 and step in (32, 64, 128) and group % step == 0):
        raise ValueError(f"int4 wgmma GEMM: x {tuple(x.shape)} {x.dtype} (stride {x.stride()}), "
                         f"N {n}, group {group}, config {config}: not supported()")
    bm = bm_for(m)
    programs = n // (16 * warps * rrep)
    m_tiles = triton.cdiv(m, bm)
    groups = k // group
    split = split or split_for(programs * m_tiles, groups)
    per_split = triton.cdiv(groups, split)
    split = triton.cdiv(groups, per_split)
    cnt = split_counters(_COUNTERS, x.device, programs * m_tiles, 4096) if split > 1 else None
    if cnt is None:
        split, per_split = 1, groups
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    ws = torch.empty((split, m, n), dtype=torch.float32, device=x.device) if split > 1 else y
    _int4_gemm_wgmma_kernel[(programs, split, m_tiles)](
        x, words, scales, zeros, perm if perm is not None else words,
        bias if bias is not None else x, y, ws, cnt if cnt is not None else words,
        m, n, x.stride(0), y.stride(0), scales.stride(0), per_split, K=k, GROUP=group, BM=bm,
        RREP=rrep, STEP=step, ASYNC=bool(asy), SPLIT_K=split, HAS_BIAS=bias is not None,
        HAS_PERM=perm is not None, BF16=x.dtype == torch.bfloat16, num_warps=warps,
        **({"maxnreg": maxnreg} if maxnreg else {}))
    return y
