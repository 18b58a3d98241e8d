"""Which kernel an Int4Linear's small-batch calls take on a Hopper GPU, and the operands it
derives from the layer's (kept beside qweight, refreshed in place after new weights: descriptors
and captured CUDA graphs hold their addresses). RADIXLM_INT4_TMA picks:
  mma        layers/triton_int4_mma.py: 1-8 rows on tensor cores, W repacked into the MMA
             fragments' layout, and 9-64 rows on layers/triton_int4_mma_gemm.py over the same
             words (a second copy of the int4 weights: qweight stays for the Triton GEMM above
             64 rows and for act-order layers above 8)
  1 / unset  `tma`: batch 1 on layers/triton_int4_tma.py (scales and zeros transposed to (G, N))
             at the GPU's tuned config for the shape (layers/int4_tma_tuned.py) or its default
  0          the register GEMV (triton_int4.gemv) for every batch-1 call
A layer whose shape the chosen kernel does not take keeps the register GEMV (mma falls back to
tma first). Measured on an H200 on 2026-11-29 and removed: a wgmma batch-1 variant (each group's
sums by wgmma for 1-64 rows; 2x slower than the TMA GEMV at batch 1, 0.92x of the GEMM at 64
rows) and packed fp16 products in the TMA GEMV (~2/3 of its sm_90 instructions, no faster at any
shape's best config)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import torch

ENV_VAR = "RADIXLM_INT4_TMA"


def setting() -> str:
    v = os.environ.get(ENV_VAR, "1").strip().lower()
    if v not in ("0", "1", "mma"):
        raise ValueError(f"{ENV_VAR} must be 0, 1 or mma (got {v!r})")
    return {"0": "off", "1": "tma", "mma": "mma"}[v]


@dataclass
class Batch1:
    kind: str  # "tma" | "mma"
    cfg: tuple  # tma: its config; mma: (its GEMV's, its GEMM's)
    derived: tuple  # tma: (scales_t, zeros_t); mma: (words,)
    descs: Optional[tuple]  # tma: its TMA descriptors

    def accepts(self, layer, x2: torch.Tensor, silu: bool = False) -> bool:
        """Whether this call is the kernel's: one row (tma); 1-8 rows of bf16 / fp16 8-byte
        aligned (mma's GEMV), or 9-64 rows (its GEMM: no SiLU epilogue, no act-order)."""
        if self.kind == "tma":
            return x2.shape[0] == 1
        from radixlm.runtime.layers import int4_mma_layout as MM
        from radixlm.runtime.layers import triton_int4_mma_gemm as MG

        m = x2.shape[0]
        if not (x2.dtype in (torch.bfloat16, torch.float16) and x2.stride(0) % 4 == 0
                and x2.data_ptr() % 8 == 0):
            return False
        if m <= MM.MAX_M:
            return m >= 1 and (not silu or MM.supported(layer.out_features, layer.in_features,
                                                        layer.group, x2.dtype, silu=True))
        return (m <= MG.MAX_M and not silu and layer.perm is None
                and MG.supported(layer.out_features, layer.in_features, layer.group, x2.dtype,
                                 self.cfg[1][0]))

    def refresh(self, layer) -> None:
        """The derived operands recomputed from the layer's, in place."""
        for t, new in zip(self.derived, _derive(layer, self.kind)):
            t.copy_(new)

    def __call__(self, layer, x2: torch.Tensor, silu: bool) -> torch.Tensor:
        n_out = layer.out_features // 2 if silu else layer.out_features
        bias = None if silu else layer.bias
        if self.kind == "mma":
            from radixlm.runtime.layers import int4_mma_layout, triton_int4_mma
            from radixlm.runtime.layers import triton_int4_mma_gemm

            if x2.shape[0] > int4_mma_layout.MAX_M:
                return triton_int4_mma_gemm.gemm(x2, self.derived[0], layer.scales,
                                                 layer.zeros, layer.group, bias,
                                                 config=self.cfg[1])
            return triton_int4_mma.gemv(x2, self.derived[0], layer.scales, layer.zeros,
                                        layer.group, bias, perm=layer.perm, silu=silu,
                                        config=self.cfg[0])
        from radixlm.runtime.layers import triton_int4_tma

        return triton_int4_tma.gemv(x2, self.descs, n_out, layer.in_features, layer.group,
                                    bias, perm=layer.perm, silu=silu, config=self.cfg)


def _derive(layer, kind: str) -> tuple:
    if kind == "mma":
        from radixlm.runtime.layers import int4_linear, int4_mma_layout

        return (int4_mma_layout.pack(int4_linear.unpack_rows(layer.qweight)),)
    return layer.scales.t().contiguous(), layer.zeros.t().contiguous()


def _mma_config(layer) -> Optional[tuple]:
    from radixlm.runtime.layers import int4_mma_layout as MM

    device = layer.qweight.device
    if not MM.available(device):
        return None
    dtype = layer.act_dtype if layer.act_dtype in (torch.bfloat16, torch.float16) \
        else torch.bfloat16
    name = torch.cuda.get_device_name(device)
    cfg = MM.config_for(layer.out_features, layer.in_features, layer.group, name)
    gemm_cfg = MM.config_for(layer.out_features, layer.in_features, layer.group, name, "gemm")
    return (cfg, gemm_cfg) if MM.supported(layer.out_features, layer.in_features, layer.group,
                                           dtype, r=cfg[0]) else None


def prepare(layer, old: Optional[Batch1]) -> Optional[Batch1]:
    """The small-batch kernel for `layer` (an Int4Linear) now, or None (the register GEMV);
    `old` (the layer's previous choice) is refreshed in place when the choice stands."""
    kind = setting()
    if kind == "off":
        return None
    cfg = _mma_config(layer) if kind == "mma" else None
    if cfg is not None:
        if old is not None and old.kind == "mma" and old.cfg == cfg:
            old.refresh(layer)
            return old
        return Batch1("mma", cfg, _derive(layer, "mma"), None)
    device = layer.qweight.device
    from radixlm.runtime.layers import triton_int4_tma as T

    if not T.available(device):
        return None
    rows, k, group = layer.out_features, layer.in_features, layer.group
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
    cfg = T.config_for(rows, k, group, layer.scales.element_size(), name)
    if cfg is None:
        return None
    if old is not None and old.kind == "tma" and old.cfg == cfg:
        old.refresh(layer)
        return old
    derived = _derive(layer, "tma")  # (another config: new descriptors over new copies)
    descs = T.descriptors(layer.qweight, *derived, group, cfg[0], cfg[1])
    return Batch1("tma", cfg, derived, descs)
