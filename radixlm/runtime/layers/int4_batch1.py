"""Which kernel an Int4Linear's small-batch calls take on a Hopper GPU, and the operands it
derives from the layer's (kept beside qweight, refreshed in place after new weights: descriptors
and captured CUDA graphs hold their addresses). RADIXLM_INT4_TMA picks:
  mma / unset  layers/triton_int4_mma.py: 1-8 rows on tensor cores, W repacked into the MMA
             fragments' layout (layers/int4_mma_layout.py: a second copy of the int4 weights,
             qweight stays for the Triton GEMM above 64 rows); on sm_90 the same words take
             9-64 rows through layers/gluon_int4_gemm.py's wgmma GEMM (RADIXLM_INT4_WGMMA=0:
             the Triton GEMM instead)
  1          `tma`: batch 1 on layers/triton_int4_tma.py (scales and zeros transposed to (G, N))
             at the GPU's tuned config for the shape (layers/int4_tma_tuned.py) or its default
  0          the register GEMV (triton_int4.gemv) for every batch-1 call
A layer whose shape the chosen kernel does not take keeps the register GEMV (mma falls back to
tma first). Measured on an H200 on 2026-11-29 and removed: a wgmma batch-1 variant (each group's
sums by wgmma for 1-64 rows; 2x slower than the TMA GEMV at batch 1, 0.92x of the GEMM at 64
rows) and packed fp16 products in the TMA GEMV (~2/3 of its sm_90 instructions, no faster at any
shape's best config); and an mma GEMM for 9-64 rows over the mma words (each word dequantized
once for ceil(M / 8) B tiles, x's fragments loaded a step by every lane): 0.25-0.33x of cuBLAS
bf16 at 64 rows (gate_up 248 us against 61; the Triton GEMM 76), its x loads latency-bound at
~170 registers a thread."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

import torch

logger = logging.getLogger(__name__)
ENV_VAR = "RADIXLM_INT4_TMA"


WGMMA_ENV = "RADIXLM_INT4_WGMMA"  # 0: 9-64 rows on the Triton GEMM instead of the wgmma GEMM


def wgmma_enabled() -> bool:
    v = os.environ.get(WGMMA_ENV, "1").strip()
    if v not in ("0", "1"):
        raise ValueError(f"{WGMMA_ENV} must be 0 or 1 (got {v!r})")
    return v == "1" and _gluon_importable()


@lru_cache(maxsize=None)
def _gluon_importable() -> bool:
    """The wgmma GEMM is Gluon code (Triton >= 3.5's explicit-layout dialect); an older Triton
    keeps 9-64 rows on the Triton GEMM, and the log says so once."""
    try:
        from radixlm.runtime.layers import gluon_int4_gemm  # noqa: F401
    except Exception as e:  # noqa: BLE001 (an old Triton fails in several ways; logged)
        logger.warning("int4: 9-64 rows stay on the Triton GEMM: the wgmma GEMM needs Triton's "
                       "Gluon (%s: %s)", type(e).__name__, e)
        return False
    return True


def setting() -> str:
    v = os.environ.get(ENV_VAR, "mma").strip().lower()
    if v not in ("0", "1", "mma"):
        raise ValueError(f"{ENV_VAR} must be 0, 1 or mma (got {v!r})")
    return {"0": "off", "1": "tma", "mma": "mma"}[v]


@dataclass
class Batch1:
    kind: str  # "tma" | "mma"
    cfg: tuple
    derived: tuple  # tma: (scales_t, zeros_t); mma: (words,)
    descs: Optional[tuple]  # tma: its TMA descriptors

    def accepts(self, layer, x2: torch.Tensor, silu: bool = False) -> bool:
        """Whether this call is the kernel's: one row (tma); 1-8 rows of bf16 / fp16, 8-byte
        aligned (mma)."""
        if self.kind == "tma":
            return x2.shape[0] == 1
        from radixlm.runtime.layers import int4_mma_layout as MM

        return (1 <= x2.shape[0] <= MM.MAX_M and x2.dtype in (torch.bfloat16, torch.float16)
                and x2.stride(0) % 4 == 0 and x2.data_ptr() % 8 == 0
                and (not silu or MM.supported(layer.out_features, layer.in_features,
                                              layer.group, x2.dtype, silu=True)))

    def gemm_config(self, layer, x2: torch.Tensor) -> Optional[tuple]:
        """The wgmma GEMM's config (layers/int4_wgmma_configs.py) when this call (9-64 rows) is
        its, over the mma words: Hopper (sm_90: wgmma), bf16 / fp16, RADIXLM_INT4_WGMMA not 0;
        else None."""
        from radixlm.runtime.layers import int4_wgmma_configs as WC

        if not (self.kind == "mma" and WC.MIN_M <= x2.shape[0] <= WC.MAX_M and x2.is_cuda
                and torch.cuda.get_device_capability(x2.device)[0] == 9 and wgmma_enabled()):
            return None
        n, k, group = layer.out_features, layer.in_features, layer.group
        cfg = WC.config_for(n, k, group, x2.shape[0], torch.cuda.get_device_name(x2.device))
        return cfg if WC.supported(n, k, group, x2.dtype, *cfg[:2]) else None

    def takes_gemm(self, layer, x2: torch.Tensor) -> bool:
        return self.gemm_config(layer, x2) is not None

    def gemm(self, layer, x2: torch.Tensor, config: tuple) -> torch.Tensor:
        from radixlm.runtime.layers import gluon_int4_gemm as GG

        return GG.gemm(x2, self.derived[0], layer.scales, layer.zeros, layer.group, layer.bias,
                       perm=layer.perm, config=config)

    def refresh(self, layer) -> None:
        """The derived operands recomputed from the layer's, in place."""
        for t, new in zip(self.derived, _derive(layer, self.kind)):
            t.copy_(new)

    def __call__(self, layer, x2: torch.Tensor, silu: bool) -> torch.Tensor:
        n_out = layer.out_features // 2 if silu else layer.out_features
        bias = None if silu else layer.bias
        if self.kind == "mma":
            from radixlm.runtime.layers import triton_int4_mma

            return triton_int4_mma.gemv(x2, self.derived[0], layer.scales, layer.zeros,
                                        layer.group, bias, perm=layer.perm, silu=silu,
                                        config=self.cfg)
        from radixlm.runtime.layers import triton_int4_tma

        return triton_int4_tma.gemv(x2, self.descs, n_out, layer.in_features, layer.group,
                                    bias, perm=layer.perm, silu=silu, config=self.cfg)


def _derive(layer, kind: str) -> tuple:
    if kind == "mma":
        from radixlm.runtime.layers import int4_mma_layout

        return (int4_mma_layout.pack(layer.codes()),)
    return layer.scales.t().contiguous(), layer.zeros.t().contiguous()


def _mma_config(layer) -> Optional[tuple]:
    from radixlm.runtime.layers import int4_mma_layout as MM

    device = layer.qweight.device
    if not MM.available(device):
        return None
    dtype = layer.act_dtype if layer.act_dtype in (torch.bfloat16, torch.float16) \
        else torch.bfloat16
    cfg = MM.config_for(layer.out_features, layer.in_features, layer.group,
                        torch.cuda.get_device_name(device))
    return cfg if MM.supported(layer.out_features, layer.in_features, layer.group, dtype,
                               r=cfg[0]) else None


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
