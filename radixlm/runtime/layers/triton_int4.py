"""Triton kernels of the int4 weight-only linear layer (layers/int4_linear.py): the packed
weights are read as stored and dequantized in registers.

The layout they read (int4_linear.pack_rows makes it from every format, K = in, N = out):
  qweight (N, K/8) int32   rows of W contiguous (K/2 bytes a row), cut in blocks of 4 words =
                           32 values = 16 bytes (one thread's vector load). Within a block,
                           nibble i of word j holds q[n, 32b + 4i + j]: the 4 words' nibble i
                           are 4 CONSECUTIVE columns, so the x that nibble i multiplies is a
                           contiguous run (a vector load, no gather) and one block never
                           straddles a group (groups are multiples of 32).
  scales  (N, G) float     G = K / GROUP groups per row
  zeros   (N, G) uint8     W[n, k] = (q[n, k] - zeros[n, k // GROUP]) * scales[n, k // GROUP]
  perm    (K,) int64 | None  act-order: stored column c is the checkpoint's column perm[c]; the
                           kernels read x[:, perm[c]] themselves (no permuted copy of x)

Nibble -> fp32 in 2 instructions and exact (the "magic number" trick): for j <= 4 the float
whose bits are (w & (0xF << 4j)) | bits(2^(23-4j)) IS 2^(23-4j) + q (the nibble lands in the
mantissa at weight 1), so q - z = that - (2^(23-4j) + z) exactly (one LOP3, one FADD); nibbles
5..7 use j = 0..2 on w >> 20. Per value ~3 ALU ops (LOP3, FADD, FFMA): batch-1 int4 is
ALU-bound near HBM speed on an H100/H200, so every op per value counts (the old kernel spent
~7 plus a register reshape through shared memory, and read 0.3-0.6 TB/s). An fp16x2 dequant
(two nibbles a LOP3 and an HSUB2) saves nothing here: the contract's exact fp32 products
(q - z) x need each value converted to fp32 again (an F2F, slower than the FADD it saves).

  gemv(x, ...)   M == 1: program p owns BLOCK_N whole rows (SPLIT_K 1: N / BLOCK_N programs,
                 512 for N = 4096 at BLOCK_N 8, fill 132 SMs), streams them along K in steps
                 of BLOCK_K values, tile (BLOCK_N, BLOCK_K/32 blocks, 4 words): a warp reads
                 512 contiguous bytes of a row (32 threads x one 16-byte block: 4 full 128-byte
                 lines), each thread BLOCK_N rows so that one x load serves them all. Per block
                 p = sum (q - z) x in fp32, then acc += p * s: y = sum_g s * sum_{k in g} (q-z) x,
                 no rounding of W (closer to fp32 than the dequantized bf16 model).
                 gemv(..., silu=True): the MLP's [gate | up] with the SiLU-and-mul epilogue.
                 Streaming knobs (config values 7-11, triton_int4_host._gemv_knobs):
                 the word loads' cache operator, the K loop's unroll, a register cap,
                 PERSIST: a persistent grid walking the row tiles (triton_int4_stream.py),
                 LEAN: fewer instructions a value (_gemv_block_sums), the same values.
                 Split-K (config's SPLIT_K > 1): the K steps cut among SPLIT_K programs a row
                 tile (more programs and bytes in flight where N is small or K long; with
                 stages 1 and one step a split, a program issues all its loads at once),
                 their fp32 partials summed in split order by the last to finish (one launch,
                 deterministic; other bits than SPLIT_K 1: another summation order).
  M > 1: layers/triton_int4_gemm.py (tensor cores on the same layout).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

# (gemv_config: the GEMV's default config a shape; _gemv_knobs: a config's values;
# _counters: split-K's arrival counters)
from radixlm.runtime.layers.triton_int4_host import (_COUNTERS, _counters,  # noqa: F401
                                                     _gemv_knobs, gemv_config)
# (the device helpers: the nibble -> fp32 step, loads, a block's sums, the store; MAGIC and
# _nibble_minus_zero are triton_int4_gemm's too)
from radixlm.runtime.layers.triton_int4_dequant import (MAGIC, _gemv_block_sums,  # noqa: F401
                                                        _gemv_store, _gemv_words, _gemv_zs,
                                                        _load_words, _nibble_minus_zero)

# Int4Linear's dispatch (int4_linear=auto or triton): batch sizes up to this run the GEMV,
# above it the GEMM. 1: the GEMV takes one row (at M = 2..16 the GEMM does the same dequant
# work a weight and leaves the MACs to the tensor cores, so a multi-row GEMV should not win
# by much). Constant from reasoning and the H200 table of the old kernels (GEMM 23-97 us at
# M = 64, tinygemm 79-519 us: torch never wins above one row, nor is auto allowed it);
# re-measure with benchmarks/int4_decode.py --kernels --ms 1 2 4 8 16 64.
GEMV_MAX_M = 1


@triton.jit
def _gemv_rows(X, QW, S, Z, P, rows, row_ok, K, kb_lo, kb_hi, stride_qw, stride_s, magic,
               GROUP: tl.constexpr, HAS_PERM: tl.constexpr, EVEN_K: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
               PREFETCH: tl.constexpr, CACHE: tl.constexpr, UNROLL: tl.constexpr,
               LEAN: tl.constexpr, XPAIRS: tl.constexpr, FULL: tl.constexpr):
    # x (1, K) . W[rows] over the 32-value blocks [kb_lo, kb_hi) (kb_lo, kb_hi - kb_lo whole
    # steps of BLOCK_K, but kb_hi = K / 32 for the last): (BLOCK_N,) fp32. LEAN
    # (_gemv_block_sums) with FULL (N, K whole tiles): words, zeros, scales and x unmasked,
    # so no zeroed destination registers nor predicates: with LEAN's other two, the sm_90 loop
    # body at 4 rows x 2048 on 2 warps 649 -> 539 instructions, 128 -> 96 registers
    rows64 = rows.to(tl.int64)
    ob = tl.arange(0, BLOCK_K // 32)  # (NB,) NB = BLOCK_K / 32 blocks of 4 words a step
    oj = tl.arange(0, 4)
    w_off = ob[:, None] * 4 + oj[None, :]  # (NB, 4) words of a step
    w_ptrs = QW + rows64[:, None, None] * stride_qw + w_off[None, :, :]  # (BLOCK_N, NB, 4)
    s_row = rows64[:, None] * stride_s  # (BLOCK_N, 1)
    n_blocks = K // 32
    acc = tl.zeros([BLOCK_N, BLOCK_K // 32, 4], tl.float32)
    # PREFETCH 1: a step's zeros and scales loaded one step ahead. They are 1-2 bytes a thread
    # (no cp.async, so the pipeliner leaves them) and cold weight bytes like the words: loaded
    # in their own step, the dequant waits a DRAM round trip each step. Costs registers (sm_90
    # ptxas at BLOCK_N 8: 218 against 167; fewer programs an SM), so both are kept until timed.
    # PREFETCH 2: the words too, into registers (for stages 1: a step's bytes in flight
    # during the previous step's math without the pipeliner's shared memory and barriers;
    # masked at kb_hi, so no split reads its successor's words).
    if PREFETCH:
        z_next, s_next = _gemv_zs(Z, S, s_row, kb_lo, ob, row_ok, n_blocks, GROUP)
    if PREFETCH >= 2:
        w_next = _gemv_words(w_ptrs, kb_lo, kb_hi, ob, row_ok, CACHE)
    # UNROLL: Triton's unroller copies the body (with stages 1, lets ptxas issue the next
    # step's loads before this step's math: what PREFETCH 2 does by hand)
    for kb in tl.range(kb_lo, kb_hi, BLOCK_K // 32, num_stages=NUM_STAGES,
                       loop_unroll_factor=UNROLL):  # kb: the step's first block
        blk_ok = kb + ob < n_blocks  # (NB,)
        if PREFETCH >= 2:
            words = w_next
            w_next = _gemv_words(w_ptrs, kb + BLOCK_K // 32, kb_hi, ob, row_ok, CACHE)
        elif EVEN_K:
            words = _load_words(w_ptrs + kb * 4, row_ok[:, None, None], CACHE, FULL)
        else:
            words = _load_words(w_ptrs + kb * 4, row_ok[:, None, None] & blk_ok[None, :, None],
                                CACHE)
        if PREFETCH:
            zf = z_next.to(tl.float32)[:, :, None]
            s = s_next.to(tl.float32)
            z_next, s_next = _gemv_zs(Z, S, s_row, kb + BLOCK_K // 32, ob, row_ok, n_blocks,
                                      GROUP)
        else:
            z, s = _gemv_zs(Z, S, s_row, kb, ob, row_ok, n_blocks, GROUP, FULL)
            zf = z.to(tl.float32)[:, :, None]
            s = s.to(tl.float32)
        p = _gemv_block_sums(X, P, words, zf, magic, kb, blk_ok, HAS_PERM, LEAN, XPAIRS,
                             EVEN_K and LEAN)
        acc += p * s[:, :, None]
    return tl.sum(tl.sum(acc, axis=2), axis=1)


@triton.jit
def _int4_gemv_kernel(X, QW, S, Z, P, B, Y, WS, CNT, N, K, blocks_per_split, ws_stride,
                      stride_qw, stride_s, magic,
                      GROUP: tl.constexpr, HAS_PERM: tl.constexpr, HAS_BIAS: tl.constexpr,
                      SILU: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
                      PREFETCH: tl.constexpr, SPLIT: tl.constexpr, CACHE: tl.constexpr,
                      UNROLL: tl.constexpr, LEAN: tl.constexpr, XPAIRS: tl.constexpr,
                      FULL: tl.constexpr):
    # SILU: W (2N, K) = [gate | up], y (1, N) = silu(x W_gate^T) * (x W_up^T): program p
    # streams gate rows [p BLOCK_N, +BLOCK_N) then the matching up rows (the MLP's batch-1
    # gate_up + SiLU-and-mul in one launch, no (1, 2N) intermediate)
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)  # (BLOCK_N,)
    row_ok = rows < N
    n_blocks = K // 32
    kb_lo, kb_hi = 0, n_blocks
    if SPLIT:  # split-K: this program's blocks [pid_k * blocks_per_split, +blocks_per_split)
        kb_lo = tl.program_id(1) * blocks_per_split
        kb_hi = tl.minimum(kb_lo + blocks_per_split, n_blocks)
    y = _gemv_rows(X, QW, S, Z, P, rows, row_ok, K, kb_lo, kb_hi, stride_qw, stride_s, magic,
                   GROUP, HAS_PERM, EVEN_K, BLOCK_N, BLOCK_K, NUM_STAGES, PREFETCH, CACHE,
                   UNROLL, LEAN, XPAIRS, FULL)
    u = y
    if SILU:
        u = _gemv_rows(X, QW, S, Z, P, rows + N, row_ok, K, kb_lo, kb_hi, stride_qw, stride_s,
                       magic, GROUP, HAS_PERM, EVEN_K, BLOCK_N, BLOCK_K, NUM_STAGES,
                       PREFETCH, CACHE, UNROLL, LEAN, XPAIRS, FULL)
    if SPLIT:
        # deterministic split-K in one launch (triton_int4_gemm's scheme): each split stores
        # its fp32 partial (gate then up rows: WS (splits, 1 or 2, N)); the split arriving last
        # at this row tile's counter sums all partials in split order (the same bits whichever
        # arrives last), runs the epilogue and resets the counter for the next call
        ws = WS + tl.program_id(1).to(tl.int64) * ws_stride + rows
        tl.store(ws, y, mask=row_ok)
        if SILU:
            tl.store(ws + N, u, mask=row_ok)
        tl.debug_barrier()  # every thread's partial stored before the release below
        n_split = tl.num_programs(1)
        if tl.atomic_add(CNT + pid, 1, sem="acq_rel") == n_split - 1:
            y = tl.zeros([BLOCK_N], tl.float32)
            u = tl.zeros([BLOCK_N], tl.float32)
            for sk in range(n_split):
                # .cg: from L2 (the other programs' stores, not a stale L1 line)
                y += tl.load(WS + sk * ws_stride + rows, mask=row_ok, other=0.0,
                             cache_modifier=".cg")
                if SILU:
                    u += tl.load(WS + sk * ws_stride + N + rows, mask=row_ok, other=0.0,
                                 cache_modifier=".cg")
            _gemv_store(y, u, B, Y, rows, row_ok, HAS_BIAS, SILU)
            tl.atomic_xchg(CNT + pid, 0)
    else:
        _gemv_store(y, u, B, Y, rows, row_ok, HAS_BIAS, SILU)


def _check(x, qweight, scales, zeros, group, perm):
    m, k = x.shape
    n = qweight.shape[0]
    assert k % 32 == 0 and group % 32 == 0 and qweight.shape[1] * 8 == k, \
        (k, group, tuple(qweight.shape))
    assert scales.shape == zeros.shape == (n, k // group), (tuple(scales.shape), group)
    assert x.stride(1) == 1 and qweight.is_contiguous() and scales.is_contiguous() \
        and zeros.is_contiguous()
    assert perm is None or (perm.shape == (k,) and perm.is_contiguous())
    return m, n, k


def gemv(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
         group: int, bias: Optional[torch.Tensor] = None,
         config: Optional[tuple] = None,
         perm: Optional[torch.Tensor] = None, silu: bool = False) -> torch.Tensor:
    """x (1, K) -> y (1, N) in x's dtype (layout in the module docstring). perm: act-order,
    the stored column -> x column map (K,) int64. silu: W is [gate | up] (2I, K), y (1, I) =
    silu(gate) * up (no bias). config: 4 to 11 values (triton_int4_host._gemv_knobs),
    gemv_config's when None. Split-K assumes one stream at a time per device (the counters
    are shared)."""
    m, n, k = _check(x, qweight, scales, zeros, group, perm)
    assert m == 1 and not (silu and (bias is not None or n % 2))
    n_out = n // 2 if silu else n
    y = torch.empty((1, n_out), dtype=x.dtype, device=x.device)
    block_n, block_k, warps, stages, prefetch, split, cache, unroll, maxnreg, persist, lean = \
        _gemv_knobs(config or gemv_config(n, k))
    xpairs = lean and perm is None and x.dtype == torch.bfloat16 and x.data_ptr() % 4 == 0
    if persist:
        from radixlm.runtime.layers import triton_int4_stream

        triton_int4_stream.launch(x, qweight, scales, zeros, perm, bias, y, group, silu,
                                  block_n, block_k, warps, cache, maxnreg, persist, lean,
                                  xpairs)
        return y
    tiles = triton.cdiv(n_out, block_n)
    n_blocks, step = k // 32, block_k // 32
    per_split = triton.cdiv(triton.cdiv(n_blocks, step), split) * step  # whole steps a split
    split = triton.cdiv(n_blocks, per_split)  # (no empty split: 3 steps in 2 or 3 splits)
    cnt = _counters(x.device, tiles) if split > 1 else None
    if cnt is None:
        split, per_split = 1, n_blocks
    ws_stride = n if silu else n_out  # a split's partials: gate then up rows under silu
    ws = torch.empty((split, ws_stride), dtype=torch.float32, device=x.device) \
        if split > 1 else y
    _int4_gemv_kernel[(tiles, split)](
        x, qweight, scales, zeros, perm if perm is not None else qweight,
        bias if bias is not None else scales, y, ws, cnt if cnt is not None else qweight,
        n_out, k, per_split, ws_stride, qweight.stride(0), scales.stride(0), MAGIC,
        GROUP=group, HAS_PERM=perm is not None, HAS_BIAS=bias is not None, SILU=silu,
        EVEN_K=k % block_k == 0, BLOCK_N=block_n, BLOCK_K=block_k, NUM_STAGES=stages,
        PREFETCH=prefetch, SPLIT=split > 1, CACHE=cache, UNROLL=unroll, LEAN=lean,
        XPAIRS=xpairs, FULL=lean and k % block_k == 0 and n_out % block_n == 0,
        num_warps=warps, maxnreg=maxnreg or None)
    return y
