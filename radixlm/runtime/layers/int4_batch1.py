"""Which kernel an Int4Linear's batch-1 calls take on a Hopper GPU, and the operands it derives
from the layer's (kept beside qweight, refreshed in place after new weights: descriptors and
captured CUDA graphs hold their addresses). RADIXLM_INT4_TMA picks:
  1 / unset  `tma`: layers/triton_int4_tma.py (scales and zeros transposed to (G, N)) at the
             GPU's tuned config for the shape (layers/int4_tma_tuned.py) or its default
  0          the register GEMV (triton_int4.gemv) for every call
A layer whose shape no config of the kernel fits keeps the register GEMV. Measured on an H200
on 2026-11-29 and removed: a tensor-core variant (each group's sums by wgmma for 1-64 rows; 2x
slower than the TMA GEMV at batch 1, 0.92x of the GEMM at 64 rows) and packed fp16 products in
the TMA GEMV (~2/3 of its sm_90 instructions, no faster at any shape's best config: the
instruction count does not bound it)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import torch

ENV_VAR = "RADIXLM_INT4_TMA"


def setting() -> str:
    v = os.environ.get(ENV_VAR, "1").strip().lower()
    if v not in ("0", "1"):
        raise ValueError(f"{ENV_VAR} must be 0 or 1 (got {v!r})")
    return {"0": "off", "1": "tma"}[v]


@dataclass
class Batch1:
    kind: str  # "tma"
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
        return triton_int4_tma.gemv(x2, self.descs, n_out, layer.in_features, layer.group,
                                    bias, perm=layer.perm, silu=silu, config=self.cfg)


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
    cfg = T.config_for(rows, k, group, layer.scales.element_size(), name)
    if cfg is None:
        return None
    if old is not None and old.cfg == cfg:
        old.refresh(layer)
        return old
    derived = _derive(layer)  # (another config: new descriptors over new copies)
    descs = T.descriptors(layer.qweight, *derived, group, cfg[0], cfg[1])
    return Batch1(kind, cfg, derived, descs)
