"""The int4 GEMV (M = 1) as a persistent stream: triton_int4.gemv with a config's PERSIST p > 0
(layout, dequant and sums: triton_int4's docstring).

Why: the one-tile-a-program kernel (triton_int4._int4_gemv_kernel) has, per program, a DRAM
round trip with nothing else to do before its first step's math, and after its last load a
reduction, a store and an exit while its SM slot loads nothing; with K = 4096 = 2 steps of
2048 that is most of a program's life (the sm_90 SASS: 4 128-bit word loads a thread a step,
then a ~650-instruction loop body, 128 registers: 8 programs of 2 warps an SM). Here a grid
of p programs an SM each takes the row tiles pid, pid + P, pid + 2P, ... (P programs) and
walks all their (tile, half, step) triples as ONE loop, loading the NEXT triple's words,
zeros and scales into registers before this one's math: every program keeps a step's bytes
in flight across tile boundaries, and no block is launched a tile. Costs (sm_90, 4 rows x
2048, 2 warps, LEAN): the walk and the per-step pointers put the loop body at ~665 executed
instructions a step against the one-tile kernel's 597; ptxas issues the next step's word
loads ~55% into the body (not at its top), so they overlap the last ~45% of the math.

Same sums as the one-tile kernel at the same BLOCK_N, BLOCK_K and warps (acc (BLOCK_N, NB,
4) over a row tile's steps, then reduced the same way): the same bits
(tests/gpu/test_int4_gemv_variants.py, also run under the interpreter). No split-K (a
program's tiles are whole rows)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixlm.runtime.layers.triton_int4_dequant import (MAGIC, _gemv_block_sums,
                                                        _gemv_tile_end, _gemv_words,
                                                        _gemv_zs)


@triton.jit
def _stream_next(t, h, st, steps, n_prog, HALVES: tl.constexpr):
    # the (row tile, half, step) after (t, h, st) in a program's walk: counters, no division
    # (an integer division by a runtime value is ~20 instructions; the walk runs every step)
    st += 1
    wrap = st == steps
    st = tl.where(wrap, 0, st)
    h += wrap.to(tl.int32)
    wrap = h == HALVES
    return t + tl.where(wrap, n_prog, 0), tl.where(wrap, 0, h), st


@triton.jit
def _stream_load(QW, S, Z, t, h, st, ok, N, n_blocks, stride_qw, stride_s,
                 GROUP: tl.constexpr, BLOCK_N: tl.constexpr, NB: tl.constexpr,
                 CACHE: tl.constexpr, WIDE: tl.constexpr):
    # (tile t, half h, step st)'s words (BLOCK_N, NB, 4), zeros and scales (BLOCK_N, NB): 0
    # past K, past N and where not ok (the prefetch after a program's last step); the up
    # half of [gate | up] is N rows down. Offsets in int32 unless WIDE (qweight of 2^31
    # words or more): computed every step, unlike the one-tile kernel's pointers
    out_rows = t * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = (out_rows < N) & ok
    rows64 = out_rows + h * N
    if WIDE:
        rows64 = rows64.to(tl.int64)
    ob = tl.arange(0, NB)
    w_ptrs = QW + rows64[:, None, None] * stride_qw + (ob[:, None] * 4
                                                        + tl.arange(0, 4)[None, :])[None, :, :]
    words = _gemv_words(w_ptrs, st * NB, n_blocks, ob, row_ok, CACHE)
    z, s = _gemv_zs(Z, S, rows64[:, None] * stride_s, st * NB, ob, row_ok, n_blocks, GROUP)
    return words, z, s


@triton.jit
def _int4_gemv_stream_kernel(X, QW, S, Z, P, B, Y, N, K, stride_qw, stride_s, magic,
                             GROUP: tl.constexpr, HAS_PERM: tl.constexpr,
                             HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
                             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                             CACHE: tl.constexpr, LEAN: tl.constexpr,
                             XPAIRS: tl.constexpr, EVEN_K: tl.constexpr,
                             WIDE: tl.constexpr):
    # SILU: W (2N, K) = [gate | up]; a tile's gate steps, then its up steps, then the epilogue
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    NB: tl.constexpr = BLOCK_K // 32
    HALVES: tl.constexpr = 2 if SILU else 1
    n_blocks = K // 32
    steps = tl.cdiv(n_blocks, NB)
    total = tl.cdiv(tl.cdiv(N, BLOCK_N) - pid, n_prog) * steps * HALVES  # this program's
    ob = tl.arange(0, NB)
    t, h, st = pid, pid * 0, pid * 0  # the position of the step at hand
    words, z, s = _stream_load(QW, S, Z, t, h, st, total > 0, N, n_blocks, stride_qw,
                               stride_s, GROUP, BLOCK_N, NB, CACHE, WIDE)
    acc = tl.zeros([BLOCK_N, NB, 4], tl.float32)
    g = tl.zeros([BLOCK_N], tl.float32)  # the tile's gate sums (SILU), till its up sums
    for i in range(0, total):
        t_n, h_n, st_n = _stream_next(t, h, st, steps, n_prog, HALVES)
        cur_w, zf, sf = words, z.to(tl.float32)[:, :, None], s.to(tl.float32)
        words, z, s = _stream_load(QW, S, Z, t_n, h_n, st_n, i + 1 < total, N, n_blocks,
                                   stride_qw, stride_s, GROUP, BLOCK_N, NB, CACHE, WIDE)
        kb = st * NB
        p = _gemv_block_sums(X, P, cur_w, zf, magic, kb, kb + ob < n_blocks, HAS_PERM, LEAN,
                             XPAIRS, EVEN_K)  # (the one-tile kernel's math, term for term)
        acc += p * sf[:, :, None]
        if st == steps - 1:  # the tile's (half's) last step: reduce, store or keep the gate
            y = tl.sum(tl.sum(acc, axis=2), axis=1)
            acc = tl.zeros([BLOCK_N, NB, 4], tl.float32)
            out_rows = t * BLOCK_N + tl.arange(0, BLOCK_N)
            g = _gemv_tile_end(y, g, h, B, Y, out_rows, out_rows < N, HAS_BIAS, SILU)
        t, h, st = t_n, h_n, st_n


_SMS: dict = {}  # device -> programs an SM are counted against (the SM count on a GPU)


def _sm_count(device: torch.device) -> int:
    c = _SMS.get(device)
    if c is None:
        # the interpreter: 2 "SMs", so that the CPU tests' programs take several tiles each
        c = torch.cuda.get_device_properties(device).multi_processor_count \
            if device.type == "cuda" else 2
        _SMS[device] = c
    return c


def launch(x, qweight, scales, zeros, perm, bias, y, group, silu, block_n, block_k, warps,
           cache, maxnreg, persist, lean, xpairs) -> None:
    """y (1, N out) = the GEMV (triton_int4.gemv's arguments, checked there) on
    min(row tiles, persist x SMs) programs."""
    n_out, k = y.shape[1], x.shape[1]
    grid = min(triton.cdiv(n_out, block_n), persist * _sm_count(x.device))
    _int4_gemv_stream_kernel[(grid,)](
        x, qweight, scales, zeros, perm if perm is not None else qweight,
        bias if bias is not None else scales, y, n_out, k, qweight.stride(0),
        scales.stride(0), MAGIC, GROUP=group, HAS_PERM=perm is not None,
        HAS_BIAS=bias is not None, SILU=silu, BLOCK_N=block_n, BLOCK_K=block_k, CACHE=cache,
        LEAN=lean, XPAIRS=xpairs, EVEN_K=lean and k % block_k == 0,
        WIDE=max(qweight.numel(), scales.numel()) >= 2 ** 31, num_warps=warps,
        maxnreg=maxnreg or None)
