"""The int4 GEMV (M = 1) with its weights brought in by the Hopper tensor memory accelerator (TMA):
triton_int4.gemv's math (layout, exact nibble -> fp32 step, block sums: triton_int4's
docstring) over a different way of keeping bytes in flight.

Why: the register kernels (triton_int4._int4_gemv_kernel, triton_int4_stream) hold their
loads in registers: ~8 programs of 64 threads an SM, 4 KB a program a step, and while a
program does a step's math it has nothing (or one step) in flight, where Little's law at
3.35-4.8 TB/s and ~1-1.5 us of DRAM latency asks for 25-55 KB an SM at all times: ~1.2-1.5
TB/s on an H100 or H200 whatever the tile. Here the words land in shared memory by TMA,
NUM_STAGES steps ahead (Triton's software pipeliner over descriptor loads: one thread issues
a step's copy, an mbarrier says when it landed), so a program keeps NUM_STAGES - 1 steps in
flight during its math without registers. Measured (H200, benchmarks/probes/
int4_gemv_bound.py): ~2.0 TB/s against the register kernel's ~1.5, and 3.3-3.8 TB/s for the
same walk without the math: the math (~4.9 sm_90 SASS instructions a value in the loop at
the default, ~3.4 of them the LOP3 + FADD + FFMA of each value) now bounds it.

A persistent grid: program p walks the row tiles p, p + P, ... (P programs), every (tile,
half, step) triple as ONE flat loop of i (st = i % STEPS, ...: STEPS and HALVES are constexprs,
so no runtime division), which the pipeliner keeps full across tile boundaries.

Operands (Int4Linear keeps both scale layouts: triton_int4's (N, G) for the GEMM, and this
one's transposed copy, since a TMA box of (N, G) would be GPS values wide: BLOCK_N rows of a
group are contiguous here; every box a multiple of 128 bytes, supported()):
  qweight  (R, K/8) int32   triton_int4's layout, R = N (or 2N: [gate | up] under SILU)
  scales_t (G, R)   fp16 / bf16 / fp32   scales_t[g, n] = scales[n, g]
  zeros_t  (G, R)   uint8
Each step: BLOCK_K values of BLOCK_N rows (GPS = BLOCK_K / GROUP groups: BLOCK_K a multiple
of GROUP), K = STEPS * BLOCK_K exactly, R a multiple of BLOCK_N (supported() says which
shapes; others take triton_int4.gemv). Sums per block as triton_int4 (p = sum (q - z) x in
fp32, acc += p * s), reduced once a tile: other summation bits than the register kernel's
(another blocking), the same reference tolerance."""

from __future__ import annotations

import os
from typing import Optional

import torch
import triton
import triton.language as tl

from radixlm.runtime.layers.triton_int4_dequant import MAGIC, _gemv_block_sums, _gemv_tile_end
from radixlm.runtime.layers.triton_int4_stream import _sm_count


@triton.jit
def _expand_groups(v, BLOCK_N: tl.constexpr, GPS: tl.constexpr, BPG: tl.constexpr):
    # (GPS, BLOCK_N) a value a (group, row) -> (BLOCK_N, NB) a value a (row, 32-value block)
    t = tl.trans(v)  # (BLOCK_N, GPS)
    return tl.reshape(tl.broadcast_to(t[:, :, None], (BLOCK_N, GPS, BPG)), (BLOCK_N, GPS * BPG))


@triton.jit
def _int4_gemv_tma_kernel(X, qd, sd, zd, P, B, Y, N_OUT, magic,
                          K: tl.constexpr, GROUP: tl.constexpr, HAS_PERM: tl.constexpr,
                          HAS_BIAS: tl.constexpr, SILU: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
                          XPAIRS: tl.constexpr, MATH: tl.constexpr):
    # qd, sd, zd: TMA descriptors of qweight (block (BLOCK_N, BLOCK_K / 8)), scales_t and
    # zeros_t (block (GPS, BLOCK_N)). MATH 0: the loads only (words XOR'ed: the load side's
    # bound, for benchmarks/probes/int4_gemv_bound.py), y meaningless.
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    NB: tl.constexpr = BLOCK_K // 32
    GPS: tl.constexpr = BLOCK_K // GROUP
    BPG: tl.constexpr = GROUP // 32
    STEPS: tl.constexpr = K // BLOCK_K
    HALVES: tl.constexpr = 2 if SILU else 1
    tiles = tl.cdiv(N_OUT, BLOCK_N)
    total = tl.cdiv(tiles - pid, n_prog) * (HALVES * STEPS)
    acc = tl.zeros([BLOCK_N, NB, 4], tl.float32)
    xacc = tl.zeros([BLOCK_N, BLOCK_K // 8], tl.int32)
    g = tl.zeros([BLOCK_N], tl.float32)  # a tile's gate sums (SILU) till its up sums
    ob = tl.arange(0, NB)
    for i in tl.range(0, total, num_stages=NUM_STAGES):
        st = i % STEPS
        r = i // STEPS
        h = r % HALVES
        tile = pid + (r // HALVES) * n_prog
        row0 = tile * BLOCK_N + h * N_OUT
        w = qd.load([row0, st * (BLOCK_K // 8)])  # (BLOCK_N, BLOCK_K / 8) int32
        if MATH:
            s = sd.load([st * GPS, row0])  # (GPS, BLOCK_N)
            z = zd.load([st * GPS, row0])
            words = tl.reshape(w, (BLOCK_N, NB, 4))
            zf = _expand_groups(z.to(tl.float32), BLOCK_N, GPS, BPG)[:, :, None]
            sf = _expand_groups(s.to(tl.float32), BLOCK_N, GPS, BPG)
            p = _gemv_block_sums(X, P, words, zf, magic, st * NB, ob < NB, HAS_PERM, True,
                                 XPAIRS, True)
            acc += p * sf[:, :, None]
        else:
            xacc ^= w
        if st == STEPS - 1:  # the tile's (half's) last step: reduce, store or keep the gate
            if MATH:
                y = tl.sum(tl.sum(acc, axis=2), axis=1)
            else:
                y = tl.xor_sum(xacc, axis=1).to(tl.float32)
            acc = tl.zeros([BLOCK_N, NB, 4], tl.float32)
            rows = tile * BLOCK_N + tl.arange(0, BLOCK_N)
            g = _gemv_tile_end(y, g, h, B, Y, rows, rows < N_OUT, HAS_BIAS, SILU)


# (BLOCK_N, BLOCK_K, num_warps, NUM_STAGES, programs an SM[, MAXNREG]): untimed first guess, 8 KB
# of words a step (16 rows x 512 bytes), 3 steps in flight during the math, 2 programs an SM (N =
# 4096: 256 row tiles, ~2 an SM; 48 KB in flight an SM); FALLBACKS for K not whole steps.
# MAXNREG (optional, 0 = none): ptxas's register cap a thread (Nsight Compute on an H200: at
# (32, 512, 2, 3, 8) gate_up took 249 registers a thread, 8 warps an SM, issue slots 61% busy)
DEFAULT = (16, 1024, 4, 4, 2)
FALLBACKS = ((32, 512, 4, 4, 2), (64, 256, 4, 4, 2))

def available(device: torch.device) -> bool:
    """TMA: a Hopper or newer GPU (or Triton's interpreter, for the CPU tests)."""
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device)[0] >= 9
    return os.environ.get("TRITON_INTERPRET") == "1"


def config_for(rows: int, k: int, group: int, scale_bytes: int = 2,
               device_name: str = "") -> Optional[tuple]:
    """The config a layer of `rows` x K (group, scales of `scale_bytes`) runs at on
    `device_name`: the measured one (layers/int4_tma_tuned.py) where it fits, else DEFAULT or a
    fallback; None where no config fits (the register GEMV takes it)."""
    from radixlm.runtime.layers.int4_tma_tuned import tuned_config

    tuned = tuned_config(device_name, rows, k, group) if device_name else None
    for cfg in ((tuned,) if tuned else ()) + (DEFAULT,) + FALLBACKS:
        if supported(rows, k, group, cfg[0], cfg[1], scale_bytes):
            return cfg
    return None


def supported(rows: int, k: int, group: int, block_n: int, block_k: int,
              scale_bytes: int = 2) -> bool:
    """Whether (rows R of qweight, K, GROUP) runs here at (BLOCK_N, BLOCK_K): whole tiles, whole
    groups a step, 16-byte aligned rows of every tensor (R % 16 == 0: uint8 zeros), and every
    box (a stage's copy) a multiple of 128 bytes: a TMA copy's shared-memory destination must
    be 128-byte aligned, and Triton 3.6 lays a buffer's stages back to back (64-byte uint8
    zero boxes, 16 rows x 4 groups, faulted with a misaligned address on an H200 at stage 1)."""
    gps = block_k // group if group and block_k % group == 0 else 0
    return (gps > 0 and k % block_k == 0 and rows % block_n == 0 and rows % 16 == 0
            and (gps * block_n) % 128 == 0 and (gps * block_n * scale_bytes) % 128 == 0
            and (block_n * block_k // 2) % 128 == 0)


def descriptors(qweight: torch.Tensor, scales_t: torch.Tensor, zeros_t: torch.Tensor,
                group: int, block_n: int, block_k: int) -> tuple:
    """The three TMA descriptors of a layer at a tile shape (host objects: build once a layer,
    they hold the tensors' addresses)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    if not supported(qweight.shape[0], qweight.shape[1] * 8, group, block_n, block_k,
                     scales_t.element_size()):
        raise ValueError(f"int4 TMA GEMV: {tuple(qweight.shape)} words, group {group} at "
                         f"BLOCK_N {block_n}, BLOCK_K {block_k}: not whole tiles or a TMA box "
                         "under 128-byte multiples (supported())")
    gps = block_k // group
    return (TensorDescriptor.from_tensor(qweight, [block_n, block_k // 8]),
            TensorDescriptor.from_tensor(scales_t, [gps, block_n]),
            TensorDescriptor.from_tensor(zeros_t, [gps, block_n]))


def gemv(x: torch.Tensor, descs: tuple, n_out: int, k: int, group: int,
         bias: Optional[torch.Tensor] = None, perm: Optional[torch.Tensor] = None,
         silu: bool = False, config: Optional[tuple] = None, math: bool = True) -> torch.Tensor:
    """x (1, K) -> y (1, n_out) in x's dtype: triton_int4.gemv's contract over descriptors()
    of the same weights (silu: qweight is [gate | up], n_out = I)."""
    block_n, block_k, warps, stages, per_sm, *rest = config or DEFAULT
    maxnreg = rest[0] if rest else 0
    assert x.shape == (1, k) and x.stride(1) == 1 and not (silu and bias is not None)
    y = torch.empty((1, n_out), dtype=x.dtype, device=x.device)
    grid = min(triton.cdiv(n_out, block_n), per_sm * _sm_count(x.device))
    xpairs = perm is None and x.dtype == torch.bfloat16 and x.data_ptr() % 4 == 0
    _int4_gemv_tma_kernel[(grid,)](
        x, *descs, perm if perm is not None else x, bias if bias is not None else x, y,
        n_out, MAGIC, K=k, GROUP=group, HAS_PERM=perm is not None, HAS_BIAS=bias is not None,
        SILU=silu, BLOCK_N=block_n, BLOCK_K=block_k, NUM_STAGES=stages, XPAIRS=xpairs,
        MATH=math, num_warps=warps, maxnreg=maxnreg or None)
    return y
