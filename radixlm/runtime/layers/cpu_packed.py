"""bf16 linear layers on a CPU with native bf16 matmul (avx512_bf16 / AMX), through oneDNN with
the weight reordered once into its blocked layout ("prepacked"), as torch's inductor does for
frozen CPU models.

Why: F.linear on a plain bf16 weight makes oneDNN reorder the weight on every call. At decode's
row counts that reorder is most of the cost: SmolLM2-135M's projections on an AVX512-BF16 EPYC
(2 cores) run 1.4-2.5x faster prepacked at 1-32 rows, 1.1-1.3x at 64-256, the 49152-row head
1.4x. Without a bias the results are bit-identical to F.linear's (same oneDNN GEMM; checked in
tests/unit/test_cpu_packed.py, through the Engine too); with a bias, oneDNN adds it inside the
GEMM, which once in a full-suite run differed from F.linear's by one bf16 rounding.

Memory: each layer keeps its plain weight too (load_weights and weight updates write the plain
one; `repack_model` refreshes the packed copies after any such write), so bf16 weights take twice
their size on these CPUs. `RADIXLM_CPU_PACKED_LINEAR=off` turns it off. Not under tensor
parallelism (ModelRunner leaves sharded models unpacked).
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from radixlm.runtime.layers import cpu_linear

logger = logging.getLogger(__name__)

ENV_VAR = "RADIXLM_CPU_PACKED_LINEAR"
ROWS_HINT = 32  # the row count oneDNN picks the packed layout for (any count runs on it)


@functools.lru_cache(maxsize=1)
def packing_works() -> bool:
    """This torch build packs bf16 weights and multiplies by them exactly as F.linear does."""
    try:
        g = torch.Generator().manual_seed(0)
        w = torch.randn(48, 64, generator=g).bfloat16()
        pk = pack(w)
        return all(torch.equal(linear(x, pk, None), F.linear(x, w))
                   for x in (torch.randn(m, 64, generator=g).bfloat16() for m in (1, 5, 40)))
    except (RuntimeError, AttributeError) as e:  # no mkldnn ops in this build / on this CPU
        logger.info("prepacked bf16 linear layers unavailable (%s); using F.linear", e)
        return False


def use_packed(device: torch.device, dtype: torch.dtype) -> bool:
    setting = os.environ.get(ENV_VAR, "auto").strip().lower()
    if setting not in ("auto", "off"):
        raise ValueError(f"{ENV_VAR} must be auto or off (got {setting!r})")
    return (setting == "auto" and device.type == "cpu" and dtype == torch.bfloat16
            and cpu_linear.cpu_has_native_bf16_matmul() and packing_works())


def pack(w: torch.Tensor) -> torch.Tensor:
    """(out, in) bf16 -> an opaque oneDNN tensor of the same values."""
    return torch.ops.mkldnn._reorder_linear_weight(w.detach().contiguous(), ROWS_HINT)


def linear(x: torch.Tensor, packed: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """(..., in) @ packed^T + bias -> (..., out), as F.linear."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class PackedLinear(nn.Module):
    """An nn.Linear (bf16) that multiplies by its prepacked weight. `weight` stays the plain
    parameter that loaders write; call `repack` after writing it."""

    def __init__(self, lin: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = lin.in_features, lin.out_features
        self.weight, self.bias = lin.weight, lin.bias
        self.packed = pack(self.weight)

    def repack(self) -> None:
        self.packed = pack(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.packed, self.bias)

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}, "
                "prepacked bf16")


def convert_model(model: nn.Module) -> int:
    """Swap the decoder projections (nn.Linear) for PackedLinear, pack the dense weights that
    QuantizedLinear keeps for many rows, and give the model a packed head
    (`model.lm_head_packed`). After loading; single-rank models only. Returns the layers packed."""
    n = 0
    for parent in list(model.modules()):
        for name in cpu_linear.PROJECTIONS:
            child = getattr(parent, name, None)
            if isinstance(child, nn.Linear):
                setattr(parent, name, PackedLinear(child))
                n += 1
    n += repack_model(model)
    return n


def repack_model(model: nn.Module) -> int:
    """Refresh every packed copy from its plain weight (after a weight update)."""
    from radixlm.runtime.layers.quantized_linear import QuantizedLinear  # it imports this module

    n = 0
    for mod in model.modules():
        if isinstance(mod, PackedLinear):
            mod.repack()
            n += 1
        elif isinstance(mod, QuantizedLinear) and mod.weight is not None:
            mod.packed = pack(mod.weight)
            n += 1
    blocks_only = (getattr(model, "lm_head_quant", None) is not None
                   and getattr(model, "lm_head_dense_above", None) is None)
    if hasattr(model, "lm_head_packed") and not blocks_only:  # else the head is GGUF blocks
        head = getattr(model, "lm_head", None)
        w = model.embed_tokens.weight if head is None else head.weight
        model.lm_head_packed = pack(w)
        n += 1
    return n
