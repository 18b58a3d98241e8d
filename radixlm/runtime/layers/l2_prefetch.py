"""L2 prefetch of weights on sm_90+: `cp.async.bulk.prefetch.L2.global [addr], bytes`.

Why: a batch-1 decode step alternates weight GEMVs, which stream at the memory's speed, with
kernels that hardly touch memory (RMSNorm, rotary, decode attention, and under TP the
all-reduces). While those run, the memory system idles. One thread's bulk prefetch asks the
memory system for a whole range without holding registers or waiting for it, so a kernel that
ends just before such a gap can start the next GEMV's weights on their way into L2 (H100 / H200:
50 MB) and the GEMV finds part of them there.

`prefetch_l2(ptr, nbytes)` is a device function for other kernels (thread 0 of the program
issues it; ptr a uint8 pointer, 16-byte aligned, nbytes a multiple of 16); `prefetch(t, nbytes)`
launches a kernel that prefetches the first `nbytes` of tensor `t`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# thread 0 of the program issues the prefetch; the bulk prefetch has no completion to wait for
_ASM = tl.constexpr("{ .reg .pred p; .reg .u32 t; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; "
        "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }")

CHUNK = 1 << 18  # bytes a program of `prefetch` asks for


@triton.jit
def prefetch_l2(ptr, nbytes):
    """ptr: a uint8 pointer (16-byte aligned); nbytes: int32, a multiple of 16, > 0."""
    tl.inline_asm_elementwise(_ASM, "=r,l,r", [ptr, nbytes], dtype=tl.int32, is_pure=False,
                              pack=1)


@triton.jit
def prefetch_share(ptr, total, share, pid):
    """Program `pid`'s share of a prefetch of `total` bytes at `ptr` split in `share`-byte
    pieces (share and total multiples of 16); programs past the end ask for nothing."""
    off = pid.to(tl.int64) * share
    if off < total:
        prefetch_l2(ptr + off, tl.minimum(share, total - off).to(tl.int32))


@triton.jit
def _prefetch_kernel(P, TOTAL, CHUNK_BYTES: tl.constexpr):
    prefetch_share(P, TOTAL, CHUNK_BYTES, tl.program_id(0))


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """t's storage from its first element as a flat uint8 tensor (t contiguous)."""
    assert t.is_contiguous()
    return t.view(-1).view(torch.uint8)


def span(t: torch.Tensor, nbytes: int) -> int:
    """min(nbytes, t's bytes) rounded down to 16 (what prefetch_l2 takes)."""
    return min(int(nbytes), t.numel() * t.element_size()) // 16 * 16


def prefetch(t: torch.Tensor, nbytes: int) -> None:
    """Start the first `nbytes` of `t` (contiguous, CUDA, sm_90+) on their way into L2."""
    n = span(t, nbytes)
    if n > 0:
        _prefetch_kernel[(triton.cdiv(n, CHUNK),)](byte_view(t), n, CHUNK_BYTES=CHUNK,
                                                    num_warps=1)
