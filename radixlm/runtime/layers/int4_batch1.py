"""Which kernel an Int4Linear's batch-1 calls take on a Hopper GPU, and the operands it derives
from the layer's (kept beside qweight, refreshed in place after new weights: descriptors and
captured CUDA graphs hold their addresses). RADIXLM_INT4_TMA picks:
  1 / unset  `tma`: layers/triton_int4_tma.py (scales and zeros transposed to (G, N)), exact
             fp32 products (q - z) x
  h2         `h2`: the same kernel with packed fp16 products (layers/triton_int4_half2.py:
             ~2/3 of the instructions; each 8-value word's sum rounded in fp16, within the
             error of the bf16-dequantized weight), for fp16 / bf16 activations (fp32 ones
             keep the exact products)
  0          the register GEMV (triton_int4.gemv) for every call
A layer whose shape no config of the kernel fits keeps the register GEMV. (A tensor-core
variant, each group's sums by wgmma for 1-64 rows, was measured on an H200 on 2026-11-29 and
removed: 2x slower than the TMA GEMV at batch 1, 0.92x of the GEMM at 64 rows.)"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import torch

ENV_VAR = "RADIXLM_INT4_TMA"


def setting() -> str:
    v = os.environ.get(ENV_VAR, "1").strip().lower()
    if v not in ("0", "1", "h2"):
        raise ValueError(f"{ENV_VAR} must be 0, 1 or h2 (got {v!r})")
    return {"0": "off", "1": "tma", "h2": "h2"}[v]


@dataclass
class Batch1:
    kind: str  # "tma" | "h2"
    cfg: tuple
    derived: tuple  # (scales_t, zeros_t)
    descs: tuple

    def accepts(self, layer, x2: torch.Tensor, silu: bool = False) -> bool:
        """Whether this call is the kernel's: one row."""
        return x2.shape[0] == 1

    def refresh(self, layer) -> None:
        """The derived operands recomputed from the layer's, in place."""
        for t, new in zip(self.derived, _derive(layer)):
            t.copy_(new)

    def __call__(self, layer, x2: torch.Tensor, silu: bool) -> torch.Tensor:
        from radixlm.runtime.layers import triton_int4_tma

        n_out = layer.out_features // 2 if silu else layer.out_features
        bias = None if silu else layer.bias
        math = 2 if self.kind == "h2" and x2.dtype in (torch.float16, torch.bfloat16) else 1
        return triton_int4_tma.gemv(x2, self.descs, n_out, layer.in_features, layer.group,
                                    bias, perm=layer.perm, silu=silu, config=self.cfg,
                                    math=math)


def _derive(layer) -> tuple:
    return layer.scales.t().contiguous(), layer.zeros.t().contiguous()


def prepare(layer, old: Optional[Batch1]) -> Optional[Batch1]:
    """The batch-1 kernel for `layer` (an Int4Linear) now, or None (the register GEMV); `old`
    (the layer's previous choice) is refreshed in place when the choice stands."""
    kind = setting()
    device = layer.qweight.device
    from radixlm.runtime.layers import triton_int4_tma as T

    if kind == "off" or not T.available(device):
        return None
    rows, k, group = layer.out_features, layer.in_features, layer.group
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
    cfg = T.config_for(rows, k, group, layer.scales.element_size(), name, kind)
    if cfg is None:
        return None
    if old is not None and old.cfg == cfg:
        old.kind = kind
        old.refresh(layer)
        return old  # (another config: new descriptors, new derived copies)
    derived = _derive(layer)
    descs = T.descriptors(layer.qweight, *derived, group, cfg[0], cfg[1])
    return Batch1(kind, cfg, derived, descs)
