"""The int4 GEMV's streaming variants (layers/triton_int4.gemv configs past SPLIT_K: CACHE,
UNROLL, MAXNREG, PERSIST (layers/triton_int4_stream.py), LEAN) on CUDA. Each only moves loads or
registers, or walks the same row tiles in another program: the result must be the same BITS
as the plain config with the same BLOCK_N / BLOCK_K / warps (same per-thread sums, same
reduction). The check also runs under Triton's interpreter on the CPU
(tests/unit/test_triton_int4_variants.py).
Run with `pytest -m gpu tests/gpu/test_int4_gemv_variants.py`."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from test_int4 import check_int4_kernels, random_layer  # noqa: E402

pytestmark = pytest.mark.gpu


def check_gemv_variants(device, n, k, group, bases, exts, silu=False, act=False,
                        dtype=torch.float32, calls=2) -> None:
    """gemv(base + ext) == gemv(base) bit for bit, for each base (BLOCK_N, BLOCK_K, warps,
    stages) and each ext (PREFETCH, SPLIT_K, CACHE, UNROLL, MAXNREG, PERSIST, LEAN); a bias when
    not silu, act-order through perm when act; each variant called `calls` times (PERSIST's
    programs own disjoint tiles: no state carried between calls)."""
    from radixlm.runtime.layers import triton_int4

    qw, s, z, _ = random_layer(n, k, group, seed=n + k)
    qw, s, z = qw.to(device), s.to(device), z.to(device)
    g = torch.Generator().manual_seed(k)
    perm = torch.randperm(k, generator=g).to(device) if act else None
    x = torch.randn(1, k, generator=g).to(dtype).to(device)
    b = None if silu else torch.randn(n, generator=g).to(dtype).to(device)
    for base in bases:
        want = triton_int4.gemv(x, qw, s, z, group, b, config=base, perm=perm, silu=silu)
        for ext in exts:
            for _ in range(calls):
                y = triton_int4.gemv(x, qw, s, z, group, b, config=base + ext, perm=perm,
                                     silu=silu)
                assert torch.equal(y, want), (base, ext, float((y - want).abs().max()))


# the Llama-3.1-8B GEMV family the first sweep picked, with each new knob
CUDA_EXTS = ((0, 1, 1), (0, 1, 2), (0, 1, 0, 2), (0, 1, 0, 1, 96), (0, 1, 0, 1, 0, 1),
             (0, 1, 2, 1, 0, 4), (0, 1, 0, 1, 128, 2), (0, 1, 0, 1, 0, 0, 1),
             (0, 1, 2, 2, 0, 0, 1), (0, 1, 2, 1, 0, 8, 1))


@pytest.mark.parametrize("silu,act", [(False, False), (True, False), (False, True)])
def test_int4_gemv_variants_cuda(silu, act):
    # N ragged against every BLOCK_N (more tiles than programs at PERSIST 1 on any GPU) with
    # K = 5120 (ragged: 2.5 steps of 2048), and N, K whole tiles (LEAN's unmasked loads); the
    # SiLU and act-order cases on the LEAN and PERSIST variants only (fewer compiles)
    bases, exts = ((4, 2048, 2, 1), (2, 1024, 1, 1)), CUDA_EXTS
    if silu or act:
        bases, exts = bases[:1], CUDA_EXTS[4:5] + CUDA_EXTS[-3:]
    for n, k in ((1501, 5120), (1504, 4096)):
        check_gemv_variants("cuda", 2 * n if silu else n, k, 128, bases, exts, silu, act,
                            torch.bfloat16)
    if not (silu or act):
        check_int4_kernels("cuda", [(1501, 4096, 128, 1), (300, 2048, 64, 1)],
                           gemv_configs=tuple((4, 2048, 2, 1) + e for e in CUDA_EXTS))
