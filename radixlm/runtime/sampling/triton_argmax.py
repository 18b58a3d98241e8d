"""torch.argmax(logits, -1) for CUDA rows in two Triton launches: the greedy token of a step.

Why: in a batch-1 decode step of the Llama-3.1-8B shape on an H200, torch's reduction kernel
(`reduce_kernel<512, 1>` in the profile) took ~28 us over the 128,256 fp32 logits (0.5 MB),
~0.7% of a bf16 step and ~1.3% of an int4 one; with this, batch-1 decode went 240.5 -> 242.0
tok/s (bf16) and 479.6 -> 485.2 (AWQ). Stage 1 splits each row into chunks of BLOCK logits, one
program each; stage 2 takes each row's best chunk.

The same answer as torch.argmax, bit for bit: the largest value, the first index among equal
ones; a NaN counts as larger than everything (torch's rule), so the first NaN wins; -inf rows
(everything masked) give index 0. `RADIXLM_DISABLE_TRITON_ARGMAX=1` turns it off.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

ENABLED = os.environ.get("RADIXLM_DISABLE_TRITON_ARGMAX", "") in ("", "0")
BLOCK = 4096  # logits a stage-1 program reads
MAX_INDEX = 2**31 - 1  # int32 indices; also "no such index" in the kernels
_BIG = tl.constexpr(MAX_INDEX)


@triton.jit
def _chunk_best(X, stride_x, V, PartV, PartI, C, BLOCK: tl.constexpr):
    # program (row, chunk): its chunk's max (NaN if it has one) and the first index holding it
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    offs = c * BLOCK + tl.arange(0, BLOCK)
    ok = offs < V
    x = tl.load(X + row * stride_x + offs, mask=ok, other=float("-inf")).to(tl.float32)
    is_nan = x != x
    first_nan = tl.min(tl.where(is_nan & ok, offs, _BIG), 0)
    m = tl.max(tl.where(is_nan, float("-inf"), x), 0)
    first_max = tl.min(tl.where((x == m) & ok, offs, _BIG), 0)
    has_nan = first_nan < _BIG
    tl.store(PartV + row * C + c, tl.where(has_nan, float("nan"), m))
    tl.store(PartI + row * C + c, tl.where(has_nan, first_nan, first_max))


@triton.jit
def _row_best(PartV, PartI, Out, C, BLOCK_C: tl.constexpr):
    # program row: the best of its C chunks (chunks in index order: the first of equal maxima)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_C)
    ok = offs < C
    v = tl.load(PartV + row * C + offs, mask=ok, other=float("-inf"))
    i = tl.load(PartI + row * C + offs, mask=ok, other=_BIG)
    is_nan = (v != v) & ok
    first_nan = tl.min(tl.where(is_nan, i, _BIG), 0)
    m = tl.max(tl.where(is_nan, float("-inf"), v), 0)
    first_max = tl.min(tl.where((v == m) & ok, i, _BIG), 0)
    # a row of -inf only (or empty): index 0, as torch
    best = tl.where(first_nan < _BIG, first_nan, tl.where(first_max < _BIG, first_max, 0))
    tl.store(Out + row, best.to(tl.int64))


def supports(logits: torch.Tensor) -> bool:
    return (ENABLED and logits.is_cuda and logits.dim() == 2 and logits.shape[1] > 0
            and logits.shape[1] < MAX_INDEX and logits.stride(1) == 1
            and logits.dtype in (torch.float32, torch.bfloat16, torch.float16))


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """logits (B, V) on CUDA, last dim contiguous -> (B,) int64, torch.argmax(logits, -1)."""
    b, v = logits.shape
    out = torch.empty(b, dtype=torch.int64, device=logits.device)
    if b == 0:
        return out
    c = triton.cdiv(v, BLOCK)
    part_v = torch.empty((b, c), dtype=torch.float32, device=logits.device)
    part_i = torch.empty((b, c), dtype=torch.int32, device=logits.device)
    _chunk_best[(b, c)](logits, logits.stride(0), v, part_v, part_i, c, BLOCK=BLOCK,
                        num_warps=8)
    _row_best[(b,)](part_v, part_i, out, c, BLOCK_C=max(16, triton.next_power_of_2(c)),
                    num_warps=1)
    return out
