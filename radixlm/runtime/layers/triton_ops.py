"""Fused small ops of the Llama layer for CUDA (Triton): fewer, larger kernels per decode step.

Why: the first profile on an H100 (Llama-3.1-8B shape, bf16, batch-1 decode in a CUDA graph)
spent 5.5 ms/step in the weight GEMMs (~2.75 TB/s) and ~2.1 ms/step in ~1300 tiny elementwise,
reduce and copy kernels: RMSNorm was 8 kernels (cast, pow, mean, add, rsqrt, mul, cast, mul),
rotary 7 per tensor, SiLU-and-mul 2, each residual add 1. Here each becomes one kernel:
  rmsnorm(x, w, eps, residual)  residual add + RMSNorm in one pass (residual stream returned)
  rotary_inplace(qk, cos, sin)  rotate-half rotary of all q and k heads, in place, one launch
  rotary_store_kv(qkv, ...)     the same, and the rotated k and the v heads written into the KV
                                pool at their slots: one launch instead of three per layer
  silu_and_mul(gate_up)         silu(gate) * up

Numerics follow the torch code of llama.py / rotary.py step by step (fp32 math, the same roundings
to the storage dtype at the same places); only reduction order and FMA contraction differ, so bf16
results may differ from the torch path by an ulp now and then.

`RADIXLM_DISABLE_FUSED_OPS=1` turns them off (llama.py then runs its plain torch ops).
"""

from __future__ import annotations

import os
from functools import lru_cache
from typing import Optional

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

ENABLED = os.environ.get("RADIXLM_DISABLE_FUSED_OPS", "") in ("", "0")


@triton.jit
def _rmsnorm_kernel(X, R, W, Out, ResOut, stride_x, stride_r, stride_o, stride_ro, N, eps,
                    HAS_RES: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    if PDL:  # launched early (programmatic dependent launch: pdl()): let the next kernel launch,
        gdc_launch_dependents()  # then wait for the previous one's outputs
        gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    m = offs < N
    x = tl.load(X + row * stride_x + offs, mask=m, other=0.0)
    if HAS_RES:
        r = tl.load(R + row * stride_r + offs, mask=m, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(X.dtype.element_ty)  # == torch's x + r
        tl.store(ResOut + row * stride_ro + offs, x, mask=m)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / N
    y = (xf * tl.rsqrt(var + eps)).to(X.dtype.element_ty)
    w = tl.load(W + offs, mask=m, other=0.0)
    out = (w.to(tl.float32) * y.to(tl.float32)).to(Out.dtype.element_ty)
    tl.store(Out + row * stride_o + offs, out, mask=m)


PDL_ENV = "RADIXLM_PDL"


def pdl(device: Optional[torch.device] = None) -> bool:
    """Programmatic dependent launch (on by default on sm_90+; RADIXLM_PDL=0 turns it off): a
    decode step's Triton kernels (RMSNorm, rotary + KV store, the decode attention's two stages,
    the int4 mma GEMV) are launched so that each may start while the previous one ends
    (griddepcontrol.launch_dependents first, then griddepcontrol.wait before reading its inputs:
    the launch latency hidden); the int4 GEMV requests its first unit's weights before it waits.
    The same results, kernel for kernel (tests/gpu/test_int4_mma_gpu.py)."""
    if os.environ.get(PDL_ENV, "1") != "1":  # (read a call: tests switch it)
        return False
    if device is None or device.index is None:
        if not torch.cuda.is_available():
            return False
        return _sm90(torch.cuda.current_device())
    return _sm90(device.index)


@lru_cache(maxsize=None)
def _sm90(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def _pdl(x: torch.Tensor) -> bool:
    """Whether a kernel on x's device launches with PDL (and waits for its predecessor)."""
    return x.is_cuda and pdl(x.device)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float,
            residual: Optional[torch.Tensor] = None):
    """x (T, N). Without residual: weight * norm(x). With residual: s = x + residual, returns
    (weight * norm(s), s). Rows may be strided; the last dim must be contiguous."""
    t, n = x.shape
    assert x.stride(1) == 1 and weight.is_contiguous()
    out = torch.empty((t, n), dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    block = triton.next_power_of_2(n)
    warps = min(16, max(1, block // 512))
    if residual is None:
        _rmsnorm_kernel[(t,)](x, x, weight, out, out, x.stride(0), 0, out.stride(0), 0, n, eps,
                              HAS_RES=False, BLOCK=block, PDL=_pdl(x), launch_pdl=_pdl(x),
                              num_warps=warps)
        return out
    assert residual.shape == x.shape and residual.stride(1) == 1
    res_out = torch.empty((t, n), dtype=x.dtype, device=x.device)
    _rmsnorm_kernel[(t,)](x, residual, weight, out, res_out, x.stride(0), residual.stride(0),
                          out.stride(0), res_out.stride(0), n, eps,
                          HAS_RES=True, BLOCK=block, PDL=_pdl(x), launch_pdl=_pdl(x),
                          num_warps=warps)
    return out, res_out


@triton.jit
def _rotary_kernel(X, Cos, Sin, stride_xt, stride_xh, stride_ct, stride_st,
                   HALF: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    m = offs < HALF
    base = X + t * stride_xt + h * stride_xh
    x1 = tl.load(base + offs, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF + offs, mask=m, other=0.0).to(tl.float32)
    c1 = tl.load(Cos + t * stride_ct + offs, mask=m, other=0.0)
    c2 = tl.load(Cos + t * stride_ct + HALF + offs, mask=m, other=0.0)
    s1 = tl.load(Sin + t * stride_st + offs, mask=m, other=0.0)
    s2 = tl.load(Sin + t * stride_st + HALF + offs, mask=m, other=0.0)
    # rotate_half: (x1, x2) -> (-x2, x1); out = x * cos + rotate_half(x) * sin
    o1 = x1 * c1 + (-x2) * s1
    o2 = x2 * c2 + x1 * s2
    tl.store(base + offs, o1.to(X.dtype.element_ty), mask=m)
    tl.store(base + HALF + offs, o2.to(X.dtype.element_ty), mask=m)


def rotary_inplace(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (T, H, D) rotated in place by cos/sin (T, 1, D) or (T, D) fp32 (rotary.py's tables);
    x may be a strided view (e.g. the q and k heads of the fused qkv output: H = Hq + Hkv)."""
    t, h, d = x.shape
    assert x.stride(2) == 1 and d % 2 == 0
    cos, sin = cos.reshape(t, d), sin.reshape(t, d)
    assert cos.stride(1) == 1 and sin.stride(1) == 1
    if t == 0:
        return x
    half = d // 2
    _rotary_kernel[(t, h)](x, cos, sin, x.stride(0), x.stride(1), cos.stride(0), sin.stride(0),
                           HALF=half, BLOCK=triton.next_power_of_2(half), num_warps=1)
    return x


@triton.jit
def _rope_pairs_kernel(X, Cos, Sin, Out, stride_xt, stride_xh, stride_ct, H,
                       HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK: tl.constexpr,
                       INTERLEAVED: tl.constexpr):
    # one token's H heads: pair i is (x[2i], x[2i+1]) (INTERLEAVED) or (x[i], x[i + HALF]);
    # out = [x1 cos - x2 sin | x2 cos + x1 sin] in fp32, rounded once to Out's dtype
    t = tl.program_id(0).to(tl.int64)
    hh = tl.arange(0, BLOCK_H)
    offs = tl.arange(0, BLOCK)
    m = (hh[:, None] < H) & (offs[None, :] < HALF)
    base = X + t * stride_xt + hh[:, None].to(tl.int64) * stride_xh
    if INTERLEAVED:
        p1, p2 = 2 * offs, 2 * offs + 1
    else:
        p1, p2 = offs, offs + HALF
    x1 = tl.load(base + p1[None, :], mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(base + p2[None, :], mask=m, other=0.0).to(tl.float32)
    c = tl.load(Cos + t * stride_ct + offs, mask=offs < HALF, other=0.0)[None, :]
    s = tl.load(Sin + t * stride_ct + offs, mask=offs < HALF, other=0.0)[None, :]
    o = Out + t * (H * 2 * HALF) + hh[:, None] * (2 * HALF) + offs[None, :]
    tl.store(o, (x1 * c - x2 * s).to(Out.dtype.element_ty), mask=m)
    tl.store(o + HALF, (x2 * c + x1 * s).to(Out.dtype.element_ty), mask=m)


def rope_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               interleaved: bool) -> torch.Tensor:
    """DeepSeek's rope (models/deepseek_rope.apply_rope) in one launch: x (T, H, d), a strided
    view allowed, cos / sin (T, 1, d/2) fp32 -> a new (T, H, d) in x's dtype. (The torch form is
    ~9 kernels a call, two calls a layer: at batch 1 a third of DeepSeek-V2-Lite's kernels.)"""
    t, h, d = x.shape
    half = d // 2
    assert x.stride(2) == 1 and d % 2 == 0
    cos, sin = cos.reshape(t, half), sin.reshape(t, half)
    assert cos.stride(1) == 1 and sin.stride() == cos.stride()
    out = torch.empty((t, h, d), dtype=x.dtype, device=x.device)
    if t:
        _rope_pairs_kernel[(t,)](x, cos, sin, out, x.stride(0), x.stride(1), cos.stride(0), h,
                                 HALF=half, BLOCK_H=triton.next_power_of_2(h),
                                 BLOCK=triton.next_power_of_2(half), INTERLEAVED=interleaved,
                                 num_warps=1 if h * half <= 512 else 4)
    return out


@triton.jit
def _mla_latent_store_kernel(KV, W, Cos, Sin, Buf, Loc, stride_kv, stride_ct, stride_buf, eps,
                             R: tl.constexpr, HALF: tl.constexpr, BLOCK_R: tl.constexpr,
                             BLOCK: tl.constexpr, INTERLEAVED: tl.constexpr):
    # one token: kv = [c_kv (R) | k_pe (2 HALF)] -> Buf[Loc[t]] = [rmsnorm(c_kv) | rope(k_pe)],
    # the math of _rmsnorm_kernel and _rope_pairs_kernel
    t = tl.program_id(0).to(tl.int64)
    row = KV + t * stride_kv
    dst = Buf + tl.load(Loc + t).to(tl.int64) * stride_buf
    offs = tl.arange(0, BLOCK_R)
    m = offs < R
    x = tl.load(row + offs, mask=m, other=0.0)
    xf = x.to(tl.float32)
    y = (xf * tl.rsqrt(tl.sum(xf * xf, axis=0) / R + eps)).to(KV.dtype.element_ty)
    w = tl.load(W + offs, mask=m, other=0.0)
    tl.store(dst + offs, (w.to(tl.float32) * y.to(tl.float32)).to(Buf.dtype.element_ty), mask=m)
    po = tl.arange(0, BLOCK)
    pm = po < HALF
    if INTERLEAVED:
        p1, p2 = 2 * po, 2 * po + 1
    else:
        p1, p2 = po, po + HALF
    x1 = tl.load(row + R + p1, mask=pm, other=0.0).to(tl.float32)
    x2 = tl.load(row + R + p2, mask=pm, other=0.0).to(tl.float32)
    c = tl.load(Cos + t * stride_ct + po, mask=pm, other=0.0)
    s = tl.load(Sin + t * stride_ct + po, mask=pm, other=0.0)
    # (rounded to k_pe's dtype first, as rope_pairs' output, then stored in the pool's)
    o1 = (x1 * c - x2 * s).to(KV.dtype.element_ty)
    o2 = (x2 * c + x1 * s).to(KV.dtype.element_ty)
    tl.store(dst + R + po, o1.to(Buf.dtype.element_ty), mask=pm)
    tl.store(dst + R + HALF + po, o2.to(Buf.dtype.element_ty), mask=pm)


def mla_latent_store(kv: torch.Tensor, r: int, weight: torch.Tensor, eps: float,
                     cos: torch.Tensor, sin: torch.Tensor, interleaved: bool, buf: torch.Tensor,
                     loc: torch.Tensor) -> None:
    """MLA's new latent straight into its pool: kv (T, r + dr) = kv_a_proj's output (rows may be
    strided), buf (slots, 1, r + dr) the layer's latent buffer, loc (T,) slots. Writes
    buf[loc] = [kv_a_layernorm(c_kv) | rope(k_pe)]: one launch for the norm, the rope, the cat
    and the pool's index_copy (4 kernels a layer before)."""
    t, width = kv.shape
    dr = width - r
    assert kv.stride(1) == 1 and weight.is_contiguous() and buf.shape[-1] == width
    assert buf.stride(-1) == 1 and dr % 2 == 0
    half = dr // 2
    cos, sin = cos.reshape(t, half), sin.reshape(t, half)
    assert cos.stride(1) == 1 and sin.stride() == cos.stride()
    if t:
        _mla_latent_store_kernel[(t,)](kv, weight, cos, sin, buf, loc, kv.stride(0),
                                       cos.stride(0), buf.stride(0), eps, R=r, HALF=half,
                                       BLOCK_R=triton.next_power_of_2(r),
                                       BLOCK=triton.next_power_of_2(half),
                                       INTERLEAVED=interleaved, num_warps=4)


@triton.jit
def _rotary_store_kernel(X, Cos, Sin, KB, VB, Loc, stride_xt, stride_xh, stride_ct, stride_st,
                         stride_kb, stride_kh, stride_vb, stride_vh, HQ, HKV,
                         HALF: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    # program (t, h) over the Hq + 2 Hkv heads of token t's qkv row: q heads are rotated in
    # place; k heads are rotated in place and stored at the token's slot; v heads only stored
    if PDL:  # (pdl())
        gdc_launch_dependents()
        gdc_wait()
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    m = offs < HALF
    base = X + t * stride_xt + h.to(tl.int64) * stride_xh
    x1 = tl.load(base + offs, mask=m, other=0.0)
    x2 = tl.load(base + HALF + offs, mask=m, other=0.0)
    if h < HQ + HKV:
        c1 = tl.load(Cos + t * stride_ct + offs, mask=m, other=0.0)
        c2 = tl.load(Cos + t * stride_ct + HALF + offs, mask=m, other=0.0)
        s1 = tl.load(Sin + t * stride_st + offs, mask=m, other=0.0)
        s2 = tl.load(Sin + t * stride_st + HALF + offs, mask=m, other=0.0)
        f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
        o1 = (f1 * c1 + (-f2) * s1).to(X.dtype.element_ty)
        o2 = (f2 * c2 + f1 * s2).to(X.dtype.element_ty)
        tl.store(base + offs, o1, mask=m)
        tl.store(base + HALF + offs, o2, mask=m)
        if h >= HQ:
            slot = tl.load(Loc + t)
            dst = KB + slot * stride_kb + (h - HQ).to(tl.int64) * stride_kh
            tl.store(dst + offs, o1, mask=m)
            tl.store(dst + HALF + offs, o2, mask=m)
    else:
        slot = tl.load(Loc + t)
        dst = VB + slot * stride_vb + (h - HQ - HKV).to(tl.int64) * stride_vh
        tl.store(dst + offs, x1, mask=m)
        tl.store(dst + HALF + offs, x2, mask=m)


def rotary_store_kv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, hq: int, hkv: int,
                    k_buf: torch.Tensor, v_buf: torch.Tensor, loc: torch.Tensor) -> None:
    """qkv (T, Hq + 2 Hkv, D): rotary of its q and k heads in place (as rotary_inplace), then
    k_buf[loc[t]] = rotated k heads and v_buf[loc[t]] = v heads (as KVPool.write), in one
    launch. k_buf / v_buf (slots, Hkv, D) must have qkv's dtype (no cast here); loc (T,) int64."""
    t, h, d = qkv.shape
    assert h == hq + 2 * hkv and qkv.stride(2) == 1 and d % 2 == 0
    assert k_buf.dtype == qkv.dtype == v_buf.dtype and k_buf.stride(2) == 1 and v_buf.stride(2) == 1
    cos, sin = cos.reshape(t, d), sin.reshape(t, d)
    assert cos.stride(1) == 1 and sin.stride(1) == 1
    if t == 0:
        return
    half = d // 2
    _rotary_store_kernel[(t, h)](
        qkv, cos, sin, k_buf, v_buf, loc, qkv.stride(0), qkv.stride(1), cos.stride(0),
        sin.stride(0), k_buf.stride(0), k_buf.stride(1), v_buf.stride(0), v_buf.stride(1), hq, hkv,
        HALF=half, BLOCK=triton.next_power_of_2(half), PDL=_pdl(qkv), launch_pdl=_pdl(qkv),
        num_warps=1)


@triton.jit
def _silu_mul_kernel(X, Out, stride_x, stride_o, N, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = offs < N
    g = tl.load(X + row * stride_x + offs, mask=m, other=0.0).to(tl.float32)
    u = tl.load(X + row * stride_x + N + offs, mask=m, other=0.0).to(tl.float32)
    # F.silu rounds to the storage dtype before the product, as torch's two ops do
    s = (g / (1.0 + tl.exp(-g))).to(Out.dtype.element_ty).to(tl.float32)
    tl.store(Out + row * stride_o + offs, (s * u).to(Out.dtype.element_ty), mask=m)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x (T, 2I) = [gate | up] -> silu(gate) * up (T, I)."""
    t, n2 = x.shape
    assert x.stride(1) == 1 and n2 % 2 == 0
    n = n2 // 2
    out = torch.empty((t, n), dtype=x.dtype, device=x.device)
    if t == 0:
        return out
    block = 1024
    _silu_mul_kernel[(t, triton.cdiv(n, block))](x, out, x.stride(0), out.stride(0), n,
                                                BLOCK=block, num_warps=4)
    return out
