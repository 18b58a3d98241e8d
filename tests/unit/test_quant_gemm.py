"""The quantized CPU GEMM (csrc/quant_gemm.cpp via layers/quant_kernels.py) against gguf-py's
reference dequantizers (gguf.quants) followed by a float64 matmul.

Tolerances: `dequant` must be bit-identical to gguf.quants (d * q is exact in fp32 for an fp16 d
and a 4/8-bit q, so the fused multiply-add rounds once where numpy's d * q + m does too). The
GEMMs then differ from the exact product only by fp32 summation: max |y - ref| <= 1e-5 * max|ref|
(seen: ~4e-7 with K <= 768)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T, quants

from radixlm.runtime.layers import quant_kernels as qk, quantized_linear

REL_TOL = 1e-5
FMTS = {"Q4_1": 3, "Q8_0": 8, "Q4_K": 12, "Q6_K": 14}


@pytest.fixture(scope="module")
def ops():
    try:
        return qk.load()
    except qk.QuantKernelsUnavailable as e:
        pytest.skip(f"quantized GEMM unavailable: {e}")


def q4k_quantize(w: np.ndarray) -> np.ndarray:
    """(N, K) fp32 -> Q4_K blocks (N, K / 256 * 144): a plain min/max quantizer in the layout
    llama.cpp documents (gguf-py has only Q4_K's dequantizer). Per 32-value sub-block j:
    w ~ (d * sc[j]) * q - dmin * m[j], 6-bit sc / m, 4-bit q."""
    n, k = w.shape
    sb = w.reshape(n, k // 256, 8, 32).astype(np.float64)
    lo = np.minimum(sb.min(-1), 0.0)
    scale, mins = (sb.max(-1) - lo) / 15, -lo
    d = (scale.max(-1) / 63).astype(np.float16)
    dmin = (mins.max(-1) / 63).astype(np.float16)
    safe = lambda a: np.where(a == 0, 1, a)  # noqa: E731
    sc = np.clip(np.rint(scale / safe(d.astype(np.float64))[..., None]), 0, 63).astype(np.uint8)
    m = np.clip(np.rint(mins / safe(dmin.astype(np.float64))[..., None]), 0, 63).astype(np.uint8)
    eff = (d.astype(np.float64)[..., None] * sc)[..., None]
    off = (dmin.astype(np.float64)[..., None] * m)[..., None]
    q = np.clip(np.rint((sb + off) / np.where(eff == 0, 1, eff)), 0, 15).astype(np.uint8)
    s = np.zeros((n, k // 256, 12), np.uint8)
    s[..., 0:4] = sc[..., :4] | ((sc[..., 4:] >> 4) << 6)
    s[..., 4:8] = m[..., :4] | ((m[..., 4:] >> 4) << 6)
    s[..., 8:12] = (sc[..., 4:] & 0xF) | ((m[..., 4:] & 0xF) << 4)
    qs = (q[..., 0::2, :] | (q[..., 1::2, :] << 4)).reshape(n, k // 256, 128)
    out = np.concatenate([d[..., None].view(np.uint8), dmin[..., None].view(np.uint8), s, qs], -1)
    return out.reshape(n, -1)


def q6k_random(n: int, k: int, rng) -> np.ndarray:
    """Random Q6_K blocks (gguf-py has no Q6_K quantizer): random 6-bit values and int8 scales,
    fp16 d of 1e-3 at bytes 208..209."""
    raw = rng.integers(0, 256, size=(n, k // 256, 210), dtype=np.uint8)
    raw[..., 208:210] = np.full((n, k // 256, 1), 1e-3, np.float16).view(np.uint8)
    return raw.reshape(n, -1)


def quantize(w: np.ndarray, fmt: int) -> np.ndarray:
    if fmt == 14:
        return q6k_random(*w.shape, np.random.default_rng(int(abs(w[0, 0]) * 1e6)))
    return q4k_quantize(w) if fmt == 12 else quants.quantize(w, T(fmt))


def blocks(fmt: int, n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, np.ndarray]:
    """Random weights quantized: (raw blocks as torch uint8, gguf's dequantized fp32 (N, K))."""
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    raw = np.ascontiguousarray(quantize(w, fmt))
    return torch.from_numpy(raw), quants.dequantize(raw, T(fmt)).reshape(n, k)


def bf16_weights(ops, fmt: int, x: torch.Tensor, ref_w: np.ndarray) -> np.ndarray:
    """The weights the kernel multiplies x by: Q4_1 / Q8_0 against bf16 x on an AVX512-BF16 CPU
    take them as bf16 (gguf's fp32 dequantization rounded to nearest even, as a bf16 model's
    dense weight holds them; quant_bf16.h), every other pair exactly."""
    if fmt in (3, 8) and x.dtype == torch.bfloat16 and ops.isa() == "avx512bf16":
        return torch.from_numpy(ref_w).to(torch.bfloat16).float().numpy()
    return ref_w


def check(y: torch.Tensor, x: torch.Tensor, ref_w: np.ndarray) -> float:
    ref = x.double() @ torch.from_numpy(ref_w).double().T
    assert y.dtype == torch.float32 and y.shape == ref.shape
    err = ((y.double() - ref).abs().max() / ref.abs().max()).item()
    assert err <= REL_TOL, err
    return err


def test_q4k_quantizer_round_trips():
    w = np.random.default_rng(3).standard_normal((4, 512)).astype(np.float32)
    back = quants.dequantize(q4k_quantize(w), T.Q4_K).reshape(w.shape)
    # 4-bit steps of a sub-block's range (~5 sigma / 15) plus 6-bit scale error
    assert np.abs(back - w).max() < 0.35


@pytest.mark.parametrize("fmt", FMTS.values(), ids=FMTS.keys())
def test_dequant_is_bit_identical(ops, fmt):
    raw, ref_w = blocks(fmt, 37, 512)
    assert np.array_equal(qk.dequant(raw, fmt, 512).numpy(), ref_w)


# odd M, N not a multiple of the 16-row task split, K of 1-3 super-blocks; M crosses the direct
# kernel's 8 / 4 / 2 / 1 row tiles
@pytest.mark.parametrize("fmt", FMTS.values(), ids=FMTS.keys())
@pytest.mark.parametrize("m,n,k", [(1, 37, 256), (3, 100, 512), (9, 33, 768), (15, 70, 256)])
def test_gemm_matches_reference(ops, fmt, m, n, k):
    raw, ref_w = blocks(fmt, n, k, seed=m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(n))
    check(ops.gemm(x, raw, fmt, k), x, ref_w)
    check(ops.gemm_tiled(x, raw, fmt, k), x, ref_w)
    check(ops.gemm_chunked(x, raw, fmt, k), x, ref_w)


@pytest.mark.parametrize("fmt", [3, 8], ids=["Q4_1", "Q8_0"])
@pytest.mark.parametrize("m", [1, 2])
@pytest.mark.parametrize("k", [576, 33792])  # 18 blocks (2 past the last 4), and > 1024 blocks
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_rows_with_tail_and_long_rows(ops, fmt, m, k, dtype):
    # the AVX-512 rows convert a row's scales first (and sum Q4_1's m terms 4 blocks at a time)
    # up to 1024 blocks, and per block past that: both, with blocks left over after the last 4
    raw, ref_w = blocks(fmt, 9, k, seed=k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
    check(ops.gemm(x, raw, fmt, k), x.float(), bf16_weights(ops, fmt, x, ref_w))


@pytest.mark.parametrize("fmt", [3, 8], ids=["Q4_1", "Q8_0"])
@pytest.mark.parametrize("k", [576, 8224])  # one pass over K, and 257 blocks: two passes
def test_bf16_rows_do_not_depend_on_the_row_count(ops, fmt, k):
    # a speculative verify multiplies several rows at once where plain decoding multiplies one:
    # each row must come out bit for bit as it does alone (tiles of 1..16 rows; N = 37 leaves a
    # partial group of W rows)
    raw, ref_w = blocks(fmt, 37, k, seed=k + fmt)
    x = torch.randn(16, k, generator=torch.Generator().manual_seed(k)).to(torch.bfloat16)
    alone = torch.cat([ops.gemm(x[i:i + 1], raw, fmt, k) for i in range(16)])
    check(alone, x.float(), bf16_weights(ops, fmt, x, ref_w))
    for m in (2, 5, 9, 16):
        assert torch.equal(ops.gemm(x[:m], raw, fmt, k), alone[:m]), m


@pytest.mark.parametrize("fmt", FMTS.values(), ids=FMTS.keys())
def test_bf16_x_takes_the_same_weights_on_every_path(ops, fmt):
    # a bf16 model's prefill (tiles, chunks) and decode (direct) multiply the same weights: where
    # the direct kernel rounds them to bf16, the tiles are rounded alike
    raw, ref_w = blocks(fmt, 70, 512, seed=fmt)
    x = torch.randn(20, 512, generator=torch.Generator().manual_seed(fmt)).to(torch.bfloat16)
    w = bf16_weights(ops, fmt, x, ref_w)
    for y in (ops.gemm(x[:9], raw, fmt, 512), ops.gemm_tiled(x, raw, fmt, 512),
              ops.gemm_chunked(x, raw, fmt, 512)):
        check(y, x[: y.shape[0]].float(), w)


@pytest.mark.parametrize("fmt", FMTS.values(), ids=FMTS.keys())
def test_tiled_gemm_many_rows_and_tiles(ops, fmt):
    raw, ref_w = blocks(fmt, 1000, 512)  # 4 tiles of 256 rows at K = 512, the last partial
    x = torch.randn(67, 512)
    check(ops.gemm_tiled(x, raw, fmt, 512), x, ref_w)


def test_chunked_gemm_several_chunks(ops):
    raw, ref_w = blocks(8, 8200, 512)  # 4.2 Mi values: two 16 MiB chunks of fp32
    x = torch.randn(300, 512)
    check(ops.gemm_chunked(x, raw, 8, 512), x, ref_w)


def test_half_inputs_are_widened(ops):
    raw, ref_w = blocks(3, 50, 256)
    x = torch.randn(5, 256).to(torch.bfloat16)
    check(ops.gemm(x, raw, 3, 256), x.float(), bf16_weights(ops, 3, x, ref_w))
    check(ops.gemm(x.half(), raw, 3, 256), x.half().float(), ref_w)


def test_bad_arguments_are_refused(ops):
    raw, _ = blocks(8, 4, 64)
    with pytest.raises(RuntimeError, match="format"):
        ops.gemm(torch.randn(1, 64), raw, 2, 64)
    with pytest.raises(RuntimeError, match="row_bytes|uint8"):
        ops.gemm(torch.randn(1, 96), raw, 8, 96)
    with pytest.raises(RuntimeError, match="multiple"):
        ops.gemm(torch.randn(1, 48), raw, 8, 48)


@pytest.mark.parametrize("m", [1, 5, quantized_linear.DIRECT_MAX_M + 3,  # all three paths
                               quantized_linear.TILED_MAX_M + 1])
def test_quantized_linear_layer(ops, m):
    raw, ref_w = blocks(8, 96, 256)
    lin = quantized_linear.QuantizedLinear(raw, 8, 256, bias=True)
    lin.bias.data.copy_(torch.randn(96))
    x = torch.randn(2, m, 256, generator=torch.Generator().manual_seed(m))  # leading dims kept
    y = lin(x)
    assert y.shape == (2, m, 96)
    ref = x.double() @ torch.from_numpy(ref_w).double().T + lin.bias.double()
    assert ((y.double() - ref).abs().max() / ref.abs().max()).item() <= REL_TOL
    xb = x.to(torch.bfloat16)
    yb = lin(xb)  # widened input, fp32 sums, one rounding of the result to bf16
    assert yb.dtype == torch.bfloat16
    # (every path multiplies the bf16 weights where the direct kernel does: bf16_weights)
    refb = xb.double() @ torch.from_numpy(bf16_weights(ops, 8, xb, ref_w)).double().T \
        + lin.bias.double()
    # rtol: the one bf16 rounding; atol: fp32 summation error where y is near 0 (|y| ~ 1e-3)
    torch.testing.assert_close(yb.double(), refb, rtol=2 ** -8, atol=1e-4)


_GENERIC_CHECK = """
import numpy as np, torch
from gguf import GGMLQuantizationType as T, quants
from radixlm.runtime.layers import quant_kernels as qk
from test_quant_gemm import blocks, check
assert qk.load().isa() == "generic", qk.load().isa()
for fmt in (3, 8, 12, 14):
    raw, ref_w = blocks(fmt, 21, 512)
    assert np.array_equal(qk.dequant(raw, fmt, 512).numpy(), ref_w)
    for m in (1, 3, 40):
        x = torch.randn(m, 512)
        check(qk.gemm(x, raw, fmt, 512), x, ref_w)
        check(qk.load().gemm_tiled(x, raw, fmt, 512), x, ref_w)
        check(qk.load().gemm_chunked(x, raw, fmt, 512), x, ref_w)
print("ok")
"""


def test_scalar_fallback_build(ops, tmp_path):
    """The portable path (no AVX2: here forced with -march=x86-64-v2, its own cache entry; ~20 s
    to build the first time): same bit-identical dequantization, same GEMM tolerance."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, RADIXLM_KERNEL_CFLAGS="-march=x86-64-v2",
               PYTHONPATH=os.pathsep.join([os.path.dirname(__file__), os.getcwd()]))
    r = subprocess.run([sys.executable, "-c", _GENERIC_CHECK], env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


def test_build_lists_every_included_header():
    """Every local `#include "..."` is hashed into the build's name (else an edited header would
    load a stale cached build)."""
    import re

    listed = set(qk._SOURCES + qk._HEADERS)
    for name in listed:
        for inc in re.findall(r'#include "([^"]+)"', (qk._CSRC / name).read_text()):
            assert inc in listed, (name, inc)
