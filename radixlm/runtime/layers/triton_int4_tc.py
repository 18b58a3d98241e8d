"""Int4 weights times up to 64 rows of x (batch-1 and decode-batch calls) with each group's
sums on the tensor cores (RADIXLM_INT4_TMA=tc: layers/int4_batch1.py). Not yet run on a GPU: checked under Triton's interpreter (its fp32
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
tolerance (tests/gpu/test_int4.py), for every batch size: a row's result does not depend on
the others (each column of the dot is summed alike), unlike the GEMM's (W rounded to x's
dtype). One row: the dequantized tile's columns stay in _k_order's order (pairs of nibbles
i, i + 4 side by side, as the asm leaves them: no byte permutes of W) and x is gathered in
that order from L1 (act-order: through the permutation, any number of rows); more rows
otherwise: W's columns are permuted into K's order in registers, so x^T's tile loads as
16-byte vectors straight into the dot's shared memory (fewer instructions than permuting x:
sm_90 SASS at 64 rows).

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

from radixlm.runtime.layers.triton_int4_dequant import MAGIC, _gemv_store, _gemv_tile_end
from radixlm.runtime.layers.triton_int4_pack16 import _group_minus_zero, _k_order
from radixlm.runtime.layers.triton_int4_host import split_counters
from radixlm.runtime.layers.triton_int4_stream import _sm_count


@triton.jit
def _store_rows(acc, B, Y, rows, om, M, N_OUT, stride_ym, HAS_BIAS: tl.constexpr):
    # acc (BLOCK_N, BLOCK_M) fp32, y^T of a row tile -> Y[m, rows] (+ bias) for m < M
    if HAS_BIAS:
        acc += tl.load(B + rows, mask=rows < N_OUT, other=0.0).to(tl.float32)[:, None]
    ok = (rows < N_OUT)[:, None] & (om < M)[None, :]
    tl.store(Y + om[None, :] * stride_ym + rows[:, None], acc.to(Y.dtype.element_ty), mask=ok)


@triton.jit
def _column0(acc, om):
    # (BLOCK_N, BLOCK_M) -> (BLOCK_N,) column 0: x's only row (M == 1)
    return tl.sum(tl.where(om[None, :] == 0, acc, 0.0), axis=1)


@triton.jit
def _split_reduce(tile, WS, CNT, B, Y, rows, om, M, N_OUT, stride_ym, HAS_BIAS: tl.constexpr,
                  SILU: tl.constexpr, SPLIT: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_M: tl.constexpr):
    # after a work item's partials are in WS (SPLIT, HALVES x N_OUT, BLOCK_M): the item
    # arriving last at its tile's counter sums the partials in split order (the same bits
    # whichever arrives last), stores y and resets the counter. Outside the K loop: an atomic
    # inside it keeps Triton 3.6's pipeliner off the loop (one buffer, no load in flight)
    tl.debug_barrier()  # every thread's partial stored before the release below
    if tl.atomic_add(CNT + tile, 1, sem="acq_rel") == SPLIT - 1:
        R = N_OUT * (2 if SILU else 1)
        a = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        u = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        ok = (rows < N_OUT)[:, None]
        for k in tl.static_range(SPLIT):
            base = WS + k * R * BLOCK_M + rows[:, None] * BLOCK_M + om[None, :]
            a += tl.load(base, mask=ok, other=0.0, cache_modifier=".cg")
            if SILU:
                u += tl.load(base + N_OUT * BLOCK_M, mask=ok, other=0.0, cache_modifier=".cg")
        if SILU:
            _gemv_store(_column0(a, om), _column0(u, om), B, Y, rows, rows < N_OUT, HAS_BIAS,
                        SILU)
        else:
            _store_rows(a, B, Y, rows, om, M, N_OUT, stride_ym, HAS_BIAS)
        tl.atomic_xchg(CNT + tile, 0)


@triton.jit
def _int4_tc_kernel(X, qd, ZS, P, B, Y, WS, CNT, M, N_OUT, stride_xm, stride_ym, magic,
                    K: tl.constexpr, GROUP: tl.constexpr, HAS_PERM: tl.constexpr,
                    HAS_BIAS: tl.constexpr, SILU: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_M: tl.constexpr, NUM_STAGES: tl.constexpr, SCALE_DT: tl.constexpr,
                    SPLIT: tl.constexpr, ONE_ROW: tl.constexpr, ASM: tl.constexpr):
    # y^T (N_OUT, M) = W x^T for M <= BLOCK_M rows of x. Work items: (row tile, split) pairs,
    # item = tile * SPLIT + sk, each SPI = STEPS / SPLIT groups of K; program p walks items p,
    # p + P, ..., each item's halves, each half's steps, as one loop (the pipeliner keeps it
    # full across items). SPLIT > 1: one item a program (the grid is the items), its partials
    # reduced after the loop. SILU (M == 1): W = [gate | up], y = silu(gate) * up
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    STEPS: tl.constexpr = K // GROUP
    SPI: tl.constexpr = STEPS // SPLIT
    HALVES: tl.constexpr = 2 if SILU else 1
    NB: tl.constexpr = GROUP // 32
    rows_all = N_OUT * HALVES  # zs's row stride
    items = tl.cdiv(N_OUT, BLOCK_N) * SPLIT
    total = tl.cdiv(items - pid, n_prog) * (HALVES * SPI)
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    g = tl.zeros([BLOCK_N], tl.float32)
    on = tl.arange(0, BLOCK_N)
    om = tl.arange(0, BLOCK_M)
    kcols = _k_order(GROUP)  # (GROUP,) the K order of the dequantized tile's columns
    kn = tl.arange(0, GROUP)
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
                               BLOCK_N, GROUP, ASM, not ONE_ROW and not HAS_PERM)
        cols = st * GROUP + kcols
        if HAS_PERM:
            cols = tl.load(P + cols)
        if ONE_ROW:  # x's row broadcast to the dot's 16 columns (L1-resident, 1-D loads)
            xt = tl.broadcast_to(tl.load(X + cols)[:, None], (GROUP, BLOCK_M))
        elif HAS_PERM:  # (GROUP, BLOCK_M): x^T, rows past M zero, gathered
            xt = tl.load(X + om[None, :] * stride_xm + cols[:, None], mask=(om < M)[None, :],
                         other=0.0)
        else:  # the same in K's order (16-byte vectors; wq's columns in K's order too)
            xt = tl.load(X + om[None, :] * stride_xm + (st * GROUP + kn)[:, None],
                         mask=(om < M)[None, :], other=0.0)
        acc += tl.dot(wq, xt) * s[:, None]  # (BLOCK_N, BLOCK_M) fp32
        if sl == SPI - 1:  # the item's half done
            rows = tile * BLOCK_N + on
            if SPLIT > 1:  # this item's partial sums of this half
                tl.store(WS + (sk * rows_all + h * N_OUT + rows)[:, None] * BLOCK_M
                         + om[None, :], acc, mask=(rows < N_OUT)[:, None])
            elif SILU:
                g = _gemv_tile_end(_column0(acc, om), g, h, B, Y, rows, rows < N_OUT,
                                   HAS_BIAS, SILU)
            else:
                _store_rows(acc, B, Y, rows, om, M, N_OUT, stride_ym, HAS_BIAS)
            acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    if SPLIT > 1:
        tile = pid // SPLIT
        _split_reduce(tile, WS, CNT, B, Y, tile * BLOCK_N + on, om, M, N_OUT, stride_ym,
                      HAS_BIAS, SILU, SPLIT, BLOCK_N, BLOCK_M)


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
MAX_M = 64  # rows of x a call takes (BLOCK_M up to 64)


def matmul(x: torch.Tensor, qd, zs: torch.Tensor, n_out: int, k: int, group: int,
           scale_dtype: torch.dtype, bias: Optional[torch.Tensor] = None,
           perm: Optional[torch.Tensor] = None, silu: bool = False,
           config: Optional[tuple] = None, asm: Optional[bool] = None) -> torch.Tensor:
    """x (M, K), M <= MAX_M -> y (M, n_out): triton_int4.gemv's contract for each row (silu:
    M == 1, [gate | up], n_out = I). asm: the packed dequant (default: on a GPU). Split-K
    assumes one stream at a time per device (the counters are shared)."""
    block_n, warps, stages, per_sm, split = config or DEFAULT
    m = x.shape[0]
    assert 1 <= m <= MAX_M and x.shape[1] == k and x.stride(1) == 1, (tuple(x.shape), k)
    assert not silu or (m == 1 and bias is None)
    assert k % group == 0 and n_out % block_n == 0, (k, group, n_out, block_n)
    block_m = max(16, triton.next_power_of_2(m))
    y = torch.empty((m, n_out), dtype=x.dtype, device=x.device)
    sms = _sm_count(x.device)
    split = split or split_for(n_out, k, group, block_n, sms)
    assert (k // group) % split == 0, (k, group, split)
    tiles = n_out // block_n
    cnt = split_counters(_COUNTERS, x.device, tiles, 4096) if split > 1 else None
    if cnt is None:  # (first allocated inside a capture: no split-K this call)
        split = 1
    ws = torch.empty((split, n_out * (2 if silu else 1), block_m), dtype=torch.float32,
                     device=x.device) if split > 1 else y
    grid = min(tiles * split, per_sm * sms) if split == 1 else tiles * split
    _int4_tc_kernel[(grid,)](
        x, qd, zs, perm if perm is not None else x, bias if bias is not None else x, y, ws,
        cnt if cnt is not None else zs, m, n_out, x.stride(0), y.stride(0), MAGIC, K=k,
        GROUP=group, HAS_PERM=perm is not None, HAS_BIAS=bias is not None, SILU=silu,
        BLOCK_N=block_n, BLOCK_M=block_m, NUM_STAGES=stages,
        SCALE_DT=tl.float16 if scale_dtype == torch.float16 else tl.bfloat16,
        SPLIT=split, ONE_ROW=m == 1, ASM=x.is_cuda if asm is None else asm,
        num_warps=warps if block_m <= 16 else max(warps, 8))
    return y
