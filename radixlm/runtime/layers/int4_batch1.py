"""Which kernel an Int4Linear's batch-1 (tc: up to 64-row) calls take on a Hopper GPU, and the operands it derives
from the layer's (kept beside qweight, refreshed in place after new weights: descriptors and
captured CUDA graphs hold their addresses). RADIXLM_INT4_TMA picks:
  1 / unset  `tma`: layers/triton_int4_tma.py (scales and zeros transposed to (G, N))
  tc         `tc`: layers/triton_int4_tc.py, each group's sums on the tensor cores (zero and
             scale packed in one (G, N) int32), for batches of up to 64 rows too (in place
             of the GEMM); an experiment, not yet timed on a GPU
  0          the register GEMV (triton_int4.gemv) for every call
A layer whose shape no config of the chosen kernel fits keeps the register GEMV."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import torch

ENV_VAR = "RADIXLM_INT4_TMA"


def setting() -> str:
    v = os.environ.get(ENV_VAR, "1").strip().lower()
    if v not in ("0", "1", "tc"):
        raise ValueError(f"{ENV_VAR} must be 0, 1 or tc (got {v!r})")
    return {"0": "off", "1": "tma", "tc": "tc"}[v]


@dataclass
class Batch1:
    kind: str  # "tma" | "tc"
    cfg: tuple
    derived: tuple  # tma: (scales_t, zeros_t); tc: (zs,)
    descs: tuple

    def accepts(self, layer, x2: torch.Tensor, silu: bool = False) -> bool:
        """Whether this call is the kernel's: one row (tma); up to triton_int4_tc.MAX_M rows of
        16-bit activations, and under the SiLU epilogue whole row tiles in each half (tc)."""
        if self.kind == "tma":
            return x2.shape[0] == 1
        from radixlm.runtime.layers import triton_int4_tc

        return (x2.shape[0] <= triton_int4_tc.MAX_M
                and x2.dtype in (torch.float16, torch.bfloat16)
                and not (silu and (layer.out_features // 2) % self.cfg[0]))

    def refresh(self, layer) -> None:
        """The derived operands recomputed from the layer's, in place."""
        for t, new in zip(self.derived, _derive(self.kind, layer)):
            t.copy_(new)

    def __call__(self, layer, x2: torch.Tensor, silu: bool) -> torch.Tensor:
        n_out = layer.out_features // 2 if silu else layer.out_features
        bias = None if silu else layer.bias
        if self.kind == "tma":
            from radixlm.runtime.layers import triton_int4_tma

            return triton_int4_tma.gemv(x2, self.descs, n_out, layer.in_features, layer.group,
                                        bias, perm=layer.perm, silu=silu, config=self.cfg)
        from radixlm.runtime.layers import triton_int4_tc

        return triton_int4_tc.matmul(x2, self.descs[0], self.derived[0], n_out,
                                     layer.in_features, layer.group, layer.scales.dtype, bias,
                                     perm=layer.perm, silu=silu, config=self.cfg)


def _derive(kind: str, layer) -> tuple:
    if kind == "tma":
        return layer.scales.t().contiguous(), layer.zeros.t().contiguous()
    from radixlm.runtime.layers import triton_int4_tc

    return (triton_int4_tc.pack_zs(layer.scales, layer.zeros),)


def prepare(layer, old: Optional[Batch1]) -> Optional[Batch1]:
    """The batch-1 kernel for `layer` (an Int4Linear) now, or None (the register GEMV); `old`
    (the layer's previous choice) is refreshed in place when the choice stands."""
    kind = setting()
    device = layer.qweight.device
    from radixlm.runtime.layers import triton_int4_tma as T

    if kind == "off" or not T.available(device):
        return None
    rows, k, group = layer.out_features, layer.in_features, layer.group
    if kind == "tma":
        cfg = T.config_for(rows, k, group, layer.scales.element_size())
    else:
        from radixlm.runtime.layers import triton_int4_tc as TC

        cfg = TC.DEFAULT if TC.supported(rows, k, group, TC.DEFAULT[0], layer.scales.dtype,
                                         layer.act_dtype) else None
    if cfg is None:
        return None
    if old is not None and old.kind == kind and old.cfg == cfg:
        old.refresh(layer)
        return old
    derived = _derive(kind, layer)
    if kind == "tma":
        descs = T.descriptors(layer.qweight, *derived, group, cfg[0], cfg[1])
    else:
        descs = (TC.descriptor(layer.qweight, group, cfg[0]),)
    return Batch1(kind, cfg, derived, descs)
