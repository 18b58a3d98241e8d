"""FP8 (e4m3) linear layers: weights stay float8_e4m3fn on the GPU and multiply through
`torch._scaled_mm`; activations are quantized to e4m3 on the fly.

What the layer computes (W_q (N, K) e4m3, w_scale (N,) fp32, one scale per output row):
    y = (x_q * s_x) @ (W_q * w_scale)^T (+ bias)        x (M, K) -> y (M, N) in x's dtype
  with x_q = round_e4m3(x / s_x) per row of x:
    dynamic  s_x = amax(|x[m]|) / 448 per token (the finest the checkpoint can ask for: a
             checkpoint's "dynamic per-tensor" activations also run per token here, never coarser)
    static   s_x = the checkpoint's input scale (one per layer; a fused qkv / gate_up takes the
             max of its pieces' scales, as vLLM does: nothing clips that did not clip before)
  `torch._scaled_mm(x_q, W_q.t(), scale_a=s_x (M, 1), scale_b=w_scale (1, N))` (rowwise scaling:
  torch >= 2.5 on SM89+/SM90; the second operand is W_q (N, K) row-major seen as a column-major
  (K, N) matrix, as cuBLASLt / CUTLASS want it; K and N multiples of 16; bf16 out on CUDA, the
  only output type rowwise scaling offers, rounded to x's dtype when that differs).

Why per-row weight scales: checkpoints give one scale per tensor (or per output channel), but
q/k/v and gate/up are fused into one matmul here. Per-tensor scales of the pieces become per-row
scales of the fused weight, which is exact (vLLM instead requantizes the pieces to their max
scale, which rounds the weights a second time). Per-tensor and per-channel checkpoints then run
the same kernel.

Batch-1 decode (M == 1): the Triton GEMV of layers/triton_fp8.py reads the e4m3 weight (half the
bytes of the bf16 GEMV) and the unquantized activation (no quantization launch, and closer to the
dequantized reference); `RADIXLM_DISABLE_FP8_GEMV=1` sends M == 1 to `_scaled_mm` too. Which is
faster per M is measured by benchmarks/fp8_linear.py (H100 results in benchmarks/results/).

CUDA graphs: forward reads only device tensors (scales are device tensors, no .item(), no
data-dependent branch), so it captures; the path is picked from M, fixed per graph bucket.

On the CPU this layer runs only when asked (`fp8_linear=scaled_mm`): torch's CPU `_scaled_mm`
computes the same math (tests use it to check the GPU path's layout and scales) but is a slow
reference (1728 x 576 at M=1: 5.6 ms vs 0.14 ms for the fp32 GEMM on a 2-core EPYC), so CPU
serving dequantizes at load instead (models/fp8_checkpoint.py).
"""

from __future__ import annotations

import os
from typing import Optional

import torch
from torch import nn

E4M3 = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
MIN_SCALE = 1e-12
GEMV_MAX_M = 1  # rows of x for which the Triton GEMV runs instead of _scaled_mm (CUDA only)
GEMV_ENABLED = os.environ.get("RADIXLM_DISABLE_FP8_GEMV", "") in ("", "0")
# the four projections of every decoder layer (llama.py's module names): what can be FP8
PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def quantize_rows_torch(x: torch.Tensor, static_scale: Optional[torch.Tensor] = None):
    """The reference quantizer (CPU, and CUDA tensors when Triton is off): x (M, K) ->
    (x_q (M, K) e4m3, scale (M, 1) fp32), x ~= x_q * scale. See layers/triton_fp8.quantize_rows."""
    xf = x.float()
    if static_scale is None:
        s = (xf.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=MIN_SCALE)
    else:
        s = static_scale.float().reshape(1, 1).expand(x.shape[0], 1).contiguous()
    return (xf / s).clamp(-FP8_MAX, FP8_MAX).to(E4M3), s


def quantize_weight(w: torch.Tensor, per_channel: bool = True):
    """A dense weight (N, K) -> (W_q (N, K) e4m3, scale) with W ~= W_q * scale: scale (N,) per
    output row, or a 0-d per-tensor scale. For dummy weights, tests and the benchmark."""
    wf = w.detach().float()
    amax = wf.abs().amax(dim=1) if per_channel else wf.abs().amax()
    s = (amax / FP8_MAX).clamp(min=MIN_SCALE)
    q = (wf / (s[:, None] if per_channel else s)).clamp(-FP8_MAX, FP8_MAX).to(E4M3)
    return q, s


def dequantize(q: torch.Tensor, row_scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """W_q (N, K) e4m3 * scale (N,) -> (N, K) `dtype`: the fp32 product rounded once."""
    return (q.float() * row_scale.float().reshape(-1, 1)).to(dtype)


class Fp8Linear(nn.Module):
    """y (..., out) = x (..., in) @ (weight * weight_scale[:, None])^T + bias, x quantized to e4m3
    (see the module docstring). Parameters, filled by the model's load_weights from HF-named
    tensors (models/fp8_checkpoint.py turns every scale into per-row form first, so the fused
    loading of q/k/v and gate/up rows works on them unchanged):
      weight        (out, in) float8_e4m3fn
      weight_scale  (out,) float32, the dequantization multiplier of each row
      input_scale   (out,) float32 (static activations only): each row's piece's input scale;
                    finish_loading() reduces it to `input_scale_max` (a (1,) device tensor)
      bias          (out,) in the model dtype, or None"""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                 device, static_input: bool = False):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        p = lambda t: nn.Parameter(t, requires_grad=False)  # noqa: E731
        self.weight = p(torch.empty(out_features, in_features, dtype=E4M3, device=device))
        self.weight_scale = p(torch.ones(out_features, dtype=torch.float32, device=device))
        self.input_scale = (p(torch.ones(out_features, dtype=torch.float32, device=device))
                            if static_input else None)
        self.bias = p(torch.zeros(out_features, dtype=dtype, device=device)) if bias else None
        self.register_buffer("input_scale_max", torch.ones(1, dtype=torch.float32, device=device)
                             if static_input else None, persistent=False)

    @staticmethod
    def from_linear(linear: nn.Module, per_channel: bool = True) -> "Fp8Linear":
        """The dense layer's weight quantized here (dummy weights, tests): dynamic activations."""
        w = linear.weight.detach()
        new = Fp8Linear(w.shape[1], w.shape[0], linear.bias is not None, w.dtype, w.device)
        q, s = quantize_weight(w, per_channel)
        new.weight.data.copy_(q)
        new.weight_scale.data.copy_(s.expand(w.shape[0]) if not per_channel else s)
        if linear.bias is not None:
            new.bias.data.copy_(linear.bias.detach())
        return new

    def finish_loading(self) -> None:
        """After load_weights: check the scales (finite, > 0: a zero or NaN scale would turn the
        layer's output into garbage without an error) and set the static input scale."""
        for name in ("weight_scale", "input_scale"):
            t = getattr(self, name)
            if t is not None and not bool(torch.isfinite(t).all() and (t > 0).all()):
                raise ValueError(f"{name} of an FP8 layer ({self.out_features} x "
                                 f"{self.in_features}) holds values that are not finite and > 0")
        if self.input_scale is not None:
            self.input_scale_max.copy_(self.input_scale.max().reshape(1))

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize(self.weight, self.weight_scale, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        if x2.is_cuda and x2.shape[0] <= GEMV_MAX_M and GEMV_ENABLED:
            from radixlm.runtime.layers import triton_fp8

            y = triton_fp8.gemv(x2.contiguous(), self.weight, self.weight_scale, self.bias)
            return y.view(*x.shape[:-1], self.out_features)
        if x2.is_cuda:
            from radixlm.runtime.layers import triton_fp8

            xq, sx = triton_fp8.quantize_rows(x2.contiguous(), self.input_scale_max)
            out_dtype = torch.bfloat16  # rowwise-scaled _scaled_mm on CUDA writes bf16 only
        else:
            xq, sx = quantize_rows_torch(x2, self.input_scale_max)
            out_dtype = x.dtype
        y = torch._scaled_mm(xq, self.weight.t(), scale_a=sx,
                             scale_b=self.weight_scale.view(1, -1), out_dtype=out_dtype)
        if y.dtype != x.dtype:
            y = y.to(x.dtype)
        if self.bias is not None:  # added apart: _scaled_mm takes no bias with fp32 out
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, e4m3, "
                f"{'static' if self.input_scale is not None else 'dynamic per-token'} "
                f"activations, bias={self.bias is not None}")


def projection_modules(model: nn.Module):
    """(path, parent, attr, module) of every decoder projection that is a dense linear layer
    (llama.py's qkv_proj / o_proj / gate_up_proj / down_proj under `layers.`)."""
    for path, mod in model.named_modules():
        if not path.startswith("layers."):
            continue
        for attr in PROJECTIONS:
            child = mod._modules.get(attr)
            if isinstance(child, nn.Linear):
                yield f"{path}.{attr}", mod, attr, child


def convert_model(model: nn.Module, paths: set[str], static_input: bool) -> None:
    """Swap the projections at `paths` (module paths, e.g. layers.0.self_attn.qkv_proj) for empty
    Fp8Linear layers, in place, before load_weights fills them."""
    found = set()
    for path, parent, attr, lin in list(projection_modules(model)):
        if path in paths:
            w = lin.weight
            setattr(parent, attr, Fp8Linear(lin.in_features, lin.out_features,
                                            lin.bias is not None, w.dtype, w.device, static_input))
            found.add(path)
    if found != paths:
        raise ValueError(f"no dense projection at {sorted(paths - found)[:4]} to hold FP8 weights")


def quantize_model(model: nn.Module) -> int:
    """Dense projections -> Fp8Linear with per-channel scales (dummy weights with an FP8
    quantization_config: what benchmarks load). Returns the number of layers swapped."""
    n = 0
    for _, parent, attr, lin in list(projection_modules(model)):
        setattr(parent, attr, Fp8Linear.from_linear(lin))
        n += 1
    return n


def finish_loading(model: nn.Module) -> int:
    mods = [m for m in model.modules() if isinstance(m, Fp8Linear)]
    for m in mods:
        m.finish_loading()
    return len(mods)


def check_shapes(model: nn.Module, device: torch.device) -> None:
    """CUDA's _scaled_mm needs K and N to be multiples of 16: refuse a model that breaks it at
    load, not at its first forward."""
    if device.type != "cuda":
        return
    bad = [(n, m.out_features, m.in_features) for n, m in model.named_modules()
           if isinstance(m, Fp8Linear) and (m.in_features % 16 or m.out_features % 16)]
    if bad:
        raise ValueError(f"FP8 layers need in/out features divisible by 16 for torch._scaled_mm; "
                         f"{bad[0][0]} is {bad[0][1]} x {bad[0][2]} (use fp8_linear=dequant)")
