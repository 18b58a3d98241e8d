"""bf16 models on CPUs without bf16 matmul instructions: linear layers run as fp32 GEMMs.

Why: PyTorch's bf16 CPU GEMM accumulates in fp32 anyway; on a CPU with neither AVX512_BF16 nor
AMX it widens every bf16 operand in a generic kernel, 3-6x slower than MKL's fp32 GEMM on the same
shapes (AVX2 EPYC: (236, 576) @ (576, 1536) takes 77 ms in bf16, 29.5 ms in fp32). So each linear
keeps its weight as an fp32 tensor holding the exact bf16 values (bf16 -> fp32 is exact), widens
the activation, runs the fp32 GEMM and rounds the output back to bf16: the same math as the bf16
GEMM (fp32 products and sums, one rounding to bf16 at the end); only the summation order differs.

Everything else stays as it was: activations, norms and the KV cache remain bf16 (the C++
attention kernels read bf16). The cost is memory: linear weights take twice the bytes (fp32), and
a tied lm_head gets an fp32 copy of the embedding (SmolLM2-135M: ~270 MB -> ~600 MB).

The switch is ServerArgs.cpu_fp32_gemm ("auto" | "on" | "off"), overridden by the environment
variable RADIXLM_CPU_FP32_GEMM (same values): "auto" turns it on for bf16/fp16 models on a CPU
that lacks native bf16 matmul (no avx512_bf16 / amx_bf16 in /proc/cpuinfo). Never on CUDA.
"""

from __future__ import annotations

import functools
import os
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

ENV_VAR = "RADIXLM_CPU_FP32_GEMM"
SETTINGS = ("auto", "on", "off")
# the four projections of every decoder layer; lm_head is handled by the model (maybe tied)
PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


@functools.lru_cache(maxsize=1)
def cpu_has_native_bf16_matmul() -> bool:
    """True when the CPU multiplies bf16 natively (AVX512_BF16 or AMX-BF16), where oneDNN's
    bf16 GEMM is the fast one. From /proc/cpuinfo; elsewhere from torch's capability string."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return bool(flags & {"avx512_bf16", "amx_bf16"})
    except OSError:
        pass
    cap = str(torch.backends.cpu.get_cpu_capability()).upper()
    return "AVX512_BF16" in cap or "AMX" in cap


def use_fp32_gemm(setting: str, device: torch.device, dtype: torch.dtype) -> bool:
    """Resolve the switch. `setting` is ServerArgs.cpu_fp32_gemm; the env var, when set, wins."""
    setting = os.environ.get(ENV_VAR, "").strip().lower() or setting
    if setting not in SETTINGS:
        raise ValueError(f"cpu_fp32_gemm / {ENV_VAR} must be one of {', '.join(SETTINGS)} "
                         f"(got {setting!r})")
    if device.type != "cpu" or dtype == torch.float32 or setting == "off":
        return False
    return setting == "on" or not cpu_has_native_bf16_matmul()


class Fp32GemmLinear(nn.Module):
    """nn.Linear whose weight (out, in) and bias are fp32 copies of a half-precision layer's;
    forward (T, in) half -> (T, out) half through one fp32 GEMM."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = nn.Parameter(linear.weight.detach().float(), requires_grad=False)
        self.bias = (None if linear.bias is None
                     else nn.Parameter(linear.bias.detach().float(), requires_grad=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # bias added in fp32 before the one rounding (the bf16 addmm also adds before rounding)
        return F.linear(x.float(), self.weight, self.bias).to(x.dtype)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}, fp32 GEMM"


def convert_model(model: nn.Module) -> int:
    """Swap every decoder projection for an Fp32GemmLinear, in place, and give the model an fp32
    lm_head weight (`model.lm_head_fp32`, (vocab, hidden)). Returns the number of layers swapped."""
    swapped = 0
    for parent in list(model.modules()):
        for name in PROJECTIONS:
            child = getattr(parent, name, None)
            if isinstance(child, nn.Linear):
                setattr(parent, name, Fp32GemmLinear(child))
                swapped += 1
    if getattr(model, "lm_head_quant", None) is not None:  # the head stays GGUF blocks
        return swapped
    if model.lm_head is None:  # tied: an fp32 copy; the embedding lookup keeps the bf16 table
        model.lm_head_fp32 = model.embed_tokens.weight.detach().float()
    else:  # untied: the fp32 layer replaces the bf16 one, its weight is the head
        model.lm_head = Fp32GemmLinear(model.lm_head)
        # a plain tensor: assigning the Parameter would try to register a parameter over the
        # class attribute `lm_head_fp32` (KeyError "attribute already exists")
        model.lm_head_fp32 = model.lm_head.weight.detach()
    return swapped + 1


def logits_fp32(hidden: torch.Tensor, w32: torch.Tensor, dtype: Optional[torch.dtype]) -> torch.Tensor:
    """(N, hidden) half -> (N, vocab) float32 logits from the fp32 head (vocab, hidden). Rounded
    through `dtype` first, so logits equal the plain half path's (which returns half logits)."""
    out = F.linear(hidden.float(), w32)
    return out if dtype is None else out.to(dtype).float()
