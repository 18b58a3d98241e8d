"""Int4 weight-only linear layers: the weights stay packed 4-bit (a quarter of bf16's bytes) and
are dequantized in registers by the Triton kernels of layers/triton_int4.py.

What the layer computes (K = in_features, N = out_features, G = K / group groups per row):
    y (M, N) = x (M, K) @ W^T (+ bias),  W[n, k] = (q[n, k] - zeros[n, k // group]) * scales[..]
  (forward picks by M: triton_int4.GEMV_MAX_M, and the layer's small-batch kernel, `tma`)
  batch 1 (M == 1)  triton_int4.gemv: fp32 products and sums, the scale applied per 32-column
                    block (on Hopper triton_int4_tma's GEMV, or for M = 1-8 triton_int4_mma's
                    tensor-core GEMV: (q - z) x summed in fp32 a group, then scaled)
  M > 1             triton_int4_gemm.gemm: each W tile dequantized to x's dtype exactly as the
                    dequantized checkpoint would hold it, then tl.dot (fp32 accumulation)
                    (on Hopper 9-64 rows run gluon_int4_gemm's wgmma GEMM over the mma words:
                    the mma GEMV's sums, (q - z) x in fp32 a group, then the scale)
So the layer is the dequantized model's matmul up to summation order (GEMM) or up to the
rounding of W to x's dtype, which the GEMV never does (it is closer to fp32).

Buffers (one common layout for AWQ, GPTQ and compressed-tensors: models/int4_formats.py unpacks
each format into (q, z, s), `from_weights` repacks; buffers, not parameters, so that the model's
load_weights and `.to(dtype)` leave them alone):
  qweight (N, K/8) int32   rows of W contiguous, in blocks of 4 words (32 columns): nibble i
                           of word 4b + j = q[n, 32b + 4i + j] (pack_rows; why: triton_int4)
  scales  (N, G)           the checkpoint's float dtype (fp16 scales are not rounded to bf16)
  zeros   (N, G) uint8     0..16 (GPTQ v1 checkpoints can mean 16)
  perm    (K,) int64 | None  act-order (GPTQ desc_act, compressed-tensors actorder group): the
                           columns sorted by group; W's columns are stored in that order and
                           the kernels read x's columns the same way (x[:, perm] @ W[:, perm]^T
                           = x @ W^T, no permuted copy of x), so groups are contiguous runs of
                           `group` columns again
  bias    (N,) parameter in the model dtype, or None (filled by the model's load_weights)

`use_torch_kernels()` switches a layer to torch's tinygemm (layers/int4_torch.py, bf16, within
a tolerance of the reference rather than its exact weights): the `torch` choice of
ServerArgs.int4_linear, so that both can be measured on one GPU.

Off CUDA (tests, `int4_linear=triton` on the CPU) forward runs the kernels only under Triton's
interpreter (TRITON_INTERPRET=1); otherwise a torch emulation of the same layout: W dequantized
per call to x's dtype, then F.linear (the dequantized reference, slow but exact).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

# llama.py's decoder projections, found as FP8 finds them (int4_checkpoint uses both)
from radixlm.runtime.layers.fp8_linear import projection_modules  # noqa: F401

if TYPE_CHECKING:  # (the type only: layers do not import models)
    from radixlm.runtime.models.int4_formats import Int4Weight



def pack_rows(q: torch.Tensor) -> torch.Tensor:
    """q (N, K) values in [0, 15] -> (N, K/8) int32 in the kernels' layout (layers/triton_int4):
    blocks of 4 words = 32 columns; nibble i of word 4b + j holds q[:, 32b + 4i + j]."""
    n, k = q.shape
    q = q.to(torch.int32).reshape(n, k // 32, 8, 4)  # [.., b, i, j]
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=q.device)
    words = (q << shifts[:, None]).sum(dim=2, dtype=torch.int32)  # disjoint bits: sum == or
    return words.reshape(n, k // 8)


def unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    """pack_rows undone: (N, K/8) int32 -> (N, K) uint8."""
    n, kw = packed.shape
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    q = (packed.reshape(n, kw // 4, 1, 4) >> shifts[:, None]) & 0xF  # (N, K/32, 8, 4)
    return q.to(torch.uint8).reshape(n, kw * 8)


def act_order(g_idx: torch.Tensor, group: int) -> torch.Tensor:
    """The column permutation (K,) that sorts columns by group, checked to leave each group a
    run of exactly `group` columns (GPTQ's g_idx with desc_act: every group has `group`
    members); ValueError otherwise."""
    perm = torch.argsort(g_idx, stable=True)
    k = g_idx.numel()
    if not torch.equal(g_idx[perm], torch.arange(k, device=g_idx.device) // group):
        raise ValueError("g_idx does not give every group exactly group_size columns")
    return perm


class Int4Linear(nn.Module):
    """y (..., out) = x (..., in) @ W^T + bias with W held as packed int4 (module docstring)."""

    def __init__(self, in_features: int, out_features: int, group: int, bias: bool,
                 dtype: torch.dtype, device, scale_dtype: torch.dtype = torch.float16,
                 act_order: bool = False):
        super().__init__()
        if in_features % 32 or in_features % group or group % 32:
            raise ValueError(f"int4 layer {out_features} x {in_features}: in_features must be "
                             f"a multiple of 32 and of the group size {group}, itself a "
                             "multiple of 32 (the kernels' 32-column blocks)")
        self.in_features, self.out_features, self.group = in_features, out_features, group
        g = in_features // group
        self.register_buffer("qweight", torch.zeros(out_features, in_features // 8,
                                                    dtype=torch.int32, device=device))
        self.register_buffer("scales", torch.ones(out_features, g, dtype=scale_dtype,
                                                  device=device))
        self.register_buffer("zeros", torch.full((out_features, g), 8, dtype=torch.uint8,
                                                 device=device))
        self.register_buffer("perm", torch.arange(in_features, device=device)
                             if act_order else None)
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device),
                                 requires_grad=False) if bias else None
        # torch's int4 kernel (use_torch_kernels): its packed weight and (G, N, 2) bf16 scales
        # and zeros, beside qweight (kept for dequantized_weight and weight reloads)
        self.register_buffer("torch_packed", None, persistent=False)
        self.register_buffer("torch_sz", None, persistent=False)
        # batch-1 (mma: 1-8 rows) calls on a Hopper kernel (use_tma: layers/int4_batch1.py);
        # None: the register GEMV (triton_int4.gemv)
        self.tma = None
        self.act_dtype = dtype

    sources: tuple[str, ...] = ()  # the checkpoint's int4 layers it holds, in row order

    def use_torch_kernels(self) -> bool:
        """Repack for torch's _weight_int4pack_mm; False (Triton kept) where its shape
        constraints fail (layers/int4_torch.py)."""
        from radixlm.runtime.layers import int4_torch

        if not int4_torch.supported(self.in_features, self.out_features, self.group):
            self.torch_packed = self.torch_sz = None
            return False
        self.torch_packed, self.torch_sz = int4_torch.pack(unpack_rows(self.qweight),
                                                           self.zeros, self.scales)
        return True

    def use_tma(self) -> bool:
        """Batch-1 (mma: 1-8 rows) calls on a Hopper kernel where the device, RADIXLM_INT4_TMA
        and the shape allow (layers/int4_batch1.py), else on the register GEMV; call again
        after the weights change (the kernel's derived operands are refreshed in place)."""
        from radixlm.runtime.layers import int4_batch1

        self.tma = int4_batch1.prepare(self, self.tma)
        return self.tma is not None

    @staticmethod
    def from_weights(pieces: Sequence["Int4Weight"], bias: bool, dtype: torch.dtype,
                     device) -> "Int4Linear":
        """One layer from the pieces of a fused projection (q/k/v, gate/up) stacked along N.
        The pieces must share K, the group size and (act-order) the same g_idx."""
        first = pieces[0]
        k, group = first.q.shape[1], first.group_size
        if any(p.q.shape[1] != k or p.group_size != group for p in pieces):
            raise ValueError("fused int4 pieces with different in_features or group sizes")
        g_idx = [p.g_idx for p in pieces]
        if any((a is None) != (g_idx[0] is None) or (a is not None and not torch.equal(a, g_idx[0]))
               for a in g_idx):
            raise ValueError("fused int4 pieces with different g_idx (act-order) permutations")
        sdt = {p.s.dtype for p in pieces}
        sdt = sdt.pop() if len(sdt) == 1 else torch.float32
        n = sum(p.q.shape[0] for p in pieces)
        new = Int4Linear(k, n, group, bias, dtype, device, sdt, g_idx[0] is not None)
        q = torch.cat([p.q for p in pieces])  # (N, K)
        if g_idx[0] is not None:
            perm = act_order(g_idx[0], group)
            q = q[:, perm]
            new.perm.copy_(perm)
        new.qweight.copy_(pack_rows(q))
        new.scales.copy_(torch.cat([p.s.to(sdt) for p in pieces]))
        new.zeros.copy_(torch.cat([p.z for p in pieces]).to(torch.uint8))
        return new

    @staticmethod
    def quantize(w: torch.Tensor, group: int, sym: bool = False,
                 bias: Optional[torch.Tensor] = None) -> "Int4Linear":
        """A dense weight (N, K) rounded to int4 with per-group min/max scales (dummy weights
        with an int4 quantization_config: benchmarks, tests). fp16 scales as AWQ / GPTQ."""
        n, k = w.shape
        wf = w.detach().float().reshape(n, k // group, group)
        if sym:
            s = (wf.abs().amax(dim=2) / 7.5).clamp(min=1e-8)  # (N, G)
            z = torch.full_like(s, 8)
        else:
            lo, hi = wf.amin(dim=2), wf.amax(dim=2)
            s = ((hi - lo) / 15).clamp(min=1e-8)
            z = (-lo / s).round().clamp(0, 15)
        s = s.half().float()
        q = (wf / s[:, :, None] + z[:, :, None]).round().clamp(0, 15).reshape(n, k)
        new = Int4Linear(k, n, group, bias is not None, w.dtype, w.device)
        new.qweight.copy_(pack_rows(q))
        new.scales.copy_(s)
        new.zeros.copy_(z.to(torch.uint8))
        if bias is not None:
            new.bias.data.copy_(bias)
        return new

    def codes(self) -> torch.Tensor:
        """The (N, K) uint8 codes q in the stored (act-order: permuted) column order."""
        return unpack_rows(self.qweight)

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """(N, K) `dtype` in the checkpoint's column order (perm undone)."""
        q = self.codes()
        grp = torch.arange(self.in_features, device=q.device) // self.group
        w = ((q.to(torch.int16) - self.zeros.to(torch.int16)[:, grp]).float()
             * self.scales.float()[:, grp])
        if self.perm is not None:
            w = torch.empty_like(w).index_copy_(1, self.perm, w)
        return w.to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        # (the variable is read per call: tests turn the interpreter on around a test)
        if not (x2.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"
                or self.torch_packed is not None):  # torch emulation
            y = F.linear(x2, self.dequantized_weight(x.dtype), self.bias)
            return y.view(*x.shape[:-1], self.out_features)
        from radixlm.runtime.layers import int4_torch, triton_int4, triton_int4_gemm

        if self.torch_packed is not None:
            if self.perm is not None:  # act-order: x's columns in the stored (group) order
                x2 = x2.index_select(1, self.perm)
            y = int4_torch.matmul(x2, self.torch_packed, self.torch_sz, self.group).to(x.dtype)
            if self.bias is not None:
                y = y + self.bias
            return y.view(*x.shape[:-1], self.out_features)
        if x2.stride(1) != 1:  # (the kernels take any row stride; a view of x is no copy)
            x2 = x2.contiguous()
        # one launch a call: act-order's permutation and the bias are read inside the kernel;
        # GEMV (bandwidth-bound, fp32 FMAs) for M <= GEMV_MAX_M, tensor-core GEMM above
        if self.tma is not None and self.tma.accepts(self, x2):
            return self.tma(self, x2, False).view(*x.shape[:-1], self.out_features)
        cfg = self.tma.gemm_config(self, x2) if self.tma is not None else None
        if cfg is not None:  # (9-64 rows on Hopper: the wgmma GEMM)
            return self.tma.gemm(self, x2, cfg).view(*x.shape[:-1], self.out_features)
        fn = triton_int4.gemv if x2.shape[0] <= triton_int4.GEMV_MAX_M else triton_int4_gemm.gemm
        y = fn(x2, self.qweight, self.scales, self.zeros, self.group, self.bias, perm=self.perm)
        return y.view(*x.shape[:-1], self.out_features)

    def gate_up_silu(self, x: torch.Tensor) -> Optional[torch.Tensor]:
        """silu(x W_gate^T) * (x W_up^T) for this layer = [gate | up] (2I, K), one launch (the
        GEMV with the SiLU-and-mul epilogue): x (1, K) on CUDA (1-8 rows on the mma kernel) ->
        (M, I); None where the call is not taken (more rows, not CUDA, torch's kernels, a
        bias): the caller runs the unfused ops."""
        from radixlm.runtime.layers import triton_int4

        x2 = x.reshape(-1, self.in_features)
        if (self.bias is not None or self.out_features % 2 or self.torch_packed is not None
                or not (x2.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")):
            return None
        if x2.stride(1) != 1:
            x2 = x2.contiguous()
        if self.tma is not None and self.tma.accepts(self, x2, silu=True):  # (mma: 1-8 rows)
            return self.tma(self, x2, True).view(*x.shape[:-1], self.out_features // 2)
        if x2.shape[0] != 1:
            return None
        y = triton_int4.gemv(x2, self.qweight, self.scales, self.zeros, self.group,
                             perm=self.perm, silu=True)
        return y.view(*x.shape[:-1], self.out_features // 2)

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, int4 group={self.group}, "
                f"act_order={self.perm is not None}, bias={self.bias is not None}, "
                f"kernels={'torch' if self.torch_packed is not None else 'triton'}"
                f"{f', batch-1 {self.tma.kind}' if self.tma is not None else ''}")


def quantize_model(model: nn.Module, group: int, sym: bool = False) -> int:
    """Dense projections -> Int4Linear (dummy weights with an int4 quantization_config: what the
    benchmark loads). Returns the number of layers swapped."""
    n = 0
    for _, parent, attr, lin in list(projection_modules(model)):
        setattr(parent, attr, Int4Linear.quantize(lin.weight, group, sym, lin.bias))
        n += 1
    return n


def use_tma(model: nn.Module) -> tuple[int, int]:
    """Every Int4Linear of `model` onto a Hopper batch-1 kernel where it can (Int4Linear.use_tma):
    (layers switched, layers left on the register GEMV)."""
    got = [m.use_tma() for m in model.modules() if isinstance(m, Int4Linear)]
    return sum(got), len(got) - sum(got)


def use_torch_kernels(model: nn.Module) -> tuple[int, int]:
    """Every Int4Linear of `model` onto torch's int4 kernel where it can:
    (layers switched, layers left on Triton)."""
    got = [m.use_torch_kernels() for m in model.modules() if isinstance(m, Int4Linear)]
    return sum(got), len(got) - sum(got)
