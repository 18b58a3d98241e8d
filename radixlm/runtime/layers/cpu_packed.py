"""bf16 linear layers on a CPU with native bf16 matmul (avx512_bf16 / AMX), with the weight
packed once: for radixlm's own GEMM (csrc/cpu_gemm.cpp, AVX512-BF16, where it is built), else for
oneDNN's blocked layout ("prepacked"), as torch's inductor does for frozen CPU models.

The own GEMM (`RADIXLM_CPU_PACKED_LINEAR=auto`, the default where available), on SmolLM2's
projections and head: 0.57-0.68x oneDNN's time at 1-8 rows, 0.80x at decode's 32, 1.02x at
prefill's hundreds to thousands (benchmarks/probes/cpu_gemm_ab.py,
results/cpu_gemm_ab-cpu.jsonl). Its rounding is independent of the row count, like oneDNN's, but
its order of summation is not
oneDNN's: ~4e-5 of outputs differ from F.linear's by one bf16 rounding. `onednn` keeps the oneDNN path, whose results are F.linear's bit for bit.
An MLP's fused gate/up weight is packed paired (gate and up features side by side), so the GEMM
applies the SiLU-and-mul in its epilogue (`silu_linear`): 30 layers of SmolLM2's MLP input
projection at 2048 rows took 524 ms against 602 ms for the GEMM then cpu_fused.silu_and_mul, with
the same bits.

Why: F.linear on a plain bf16 weight makes oneDNN reorder the weight on every call. At decode's
row counts that reorder is most of the cost: SmolLM2-135M's projections on an AVX512-BF16 EPYC
(2 cores) run 1.4-2.5x faster prepacked at 1-32 rows, 1.1-1.3x at 64-256, the 49152-row head
1.4x. Without a bias oneDNN's results are bit-identical to F.linear's (same oneDNN GEMM; checked
in tests/unit/test_cpu_packed.py, through the Engine too); with a bias, oneDNN adds it inside the
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

from radixlm.runtime.layers import cpu_fused, cpu_linear

logger = logging.getLogger(__name__)

ENV_VAR = "RADIXLM_CPU_PACKED_LINEAR"
ROWS_HINT = 32  # the row count oneDNN picks the packed layout for (any count runs on it)


SETTINGS = ("auto", "onednn", "off")


class OwnPacked:
    """A weight packed for csrc/cpu_gemm.cpp: `data` (P, K/2, 48, 2) bf16 of W (n, k), zero
    padded to whole 48-column panels; or, `paired` (an MLP's fused gate/up weight, n = 2I with
    I % 32 == 0), (I/32, K/2, 64, 2): panel p holds gate rows 32p.. and up rows I + 32p.., so the
    GEMM can apply the SiLU-and-mul in its epilogue (`silu_linear`)."""

    __slots__ = ("data", "n", "k", "paired")

    def __init__(self, w: torch.Tensor, paired: bool = False):
        n, k = w.shape
        w = w.detach()
        if paired:
            p = n // 64
            rows = torch.cat([w[: n // 2].reshape(p, 32, k), w[n // 2:].reshape(p, 32, k)], 1)
            self.data = rows.reshape(p, 64, k // 2, 2).permute(0, 2, 1, 3).contiguous()
        else:
            p = -(-n // 48)
            wp = torch.zeros(p * 48, k, dtype=torch.bfloat16)
            wp[:n] = w
            self.data = wp.view(p, 48, k // 2, 2).permute(0, 2, 1, 3).contiguous()
        self.n, self.k, self.paired = n, k, paired


@functools.lru_cache(maxsize=1)
def own_gemm_works() -> bool:
    """radixlm's GEMM is built for this CPU (AVX512-BF16) and agrees with F.linear."""
    from radixlm.runtime.attention import cpu_kernels

    try:
        ops = cpu_kernels.load()
        if not ops.gemm_bf16_available():
            return False
        g = torch.Generator().manual_seed(0)
        w = (torch.randn(100, 64, generator=g) * 0.1).bfloat16()
        x = torch.randn(5, 64, generator=g).bfloat16()
        ref = x.float() @ w.float().t()
        return torch.allclose(_own_linear(x, OwnPacked(w), None).float(), ref, atol=0.02, rtol=0.01)
    except (cpu_kernels.CpuKernelsUnavailable, RuntimeError, AttributeError) as e:
        logger.info("radixlm's bf16 GEMM unavailable (%s); using oneDNN", e)
        return False


def _own_linear(x: torch.Tensor, packed: OwnPacked, bias: Optional[torch.Tensor]) -> torch.Tensor:
    x2 = x.reshape(-1, packed.k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.ops.radixlm_cpu.gemm_bf16(x2, packed.data, packed.n, bias)
    return out.view(*x.shape[:-1], packed.n)


def _setting() -> str:
    setting = os.environ.get(ENV_VAR, "auto").strip().lower()
    if setting not in SETTINGS:
        raise ValueError(f"{ENV_VAR} must be one of {', '.join(SETTINGS)} (got {setting!r})")
    return setting


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
    setting = _setting()
    return (setting != "off" and device.type == "cpu" and dtype == torch.bfloat16
            and cpu_linear.cpu_has_native_bf16_matmul()
            and ((setting == "auto" and own_gemm_works()) or packing_works()))


def _own_pairing(shape, gate_up: bool) -> Optional[bool]:
    """Whether pack() makes a paired OwnPacked of an (out, in) weight (None: a oneDNN pack)."""
    if _setting() == "auto" and shape[1] % 2 == 0 and own_gemm_works():
        return bool(gate_up and shape[0] % 64 == 0)
    return None


def pack(w: torch.Tensor, gate_up: bool = False):
    """(out, in) bf16 -> the packed weight `linear` takes: OwnPacked for radixlm's GEMM
    (`auto`, where it works, and an even `in`; paired when `gate_up` is an MLP's [gate; up]
    weight with out % 64 == 0), else an opaque oneDNN tensor."""
    paired = _own_pairing(w.shape, gate_up)
    if paired is not None:
        return OwnPacked(w, paired=paired)
    return torch.ops.mkldnn._reorder_linear_weight(w.detach().contiguous(), ROWS_HINT)


def adopt(w: torch.Tensor, gate_up: bool, data: Optional[torch.Tensor]) -> Optional[OwnPacked]:
    """An OwnPacked around `data`, a pack of `w` that pack(w, gate_up) made in an earlier
    process (executor/pack_cache.py keeps them), or None where pack() would now pack otherwise or
    the shape does not fit. The caller vouches that `data` came from the same weight."""
    paired = _own_pairing(w.shape, gate_up)
    if data is None or paired is None or data.dtype != torch.bfloat16:
        return None
    n, k = w.shape
    want = (n // 64, k // 2, 64, 2) if paired else (-(-n // 48), k // 2, 48, 2)
    if tuple(data.shape) != want:
        return None
    pk = OwnPacked.__new__(OwnPacked)
    pk.data, pk.n, pk.k, pk.paired = data, n, k, paired
    return pk


def silu_linear(x: torch.Tensor, module) -> Optional[torch.Tensor]:
    """silu(gate) * up of an MLP's fused gate_up projection in one GEMM (the epilogue applies
    it, bit for bit as layers/cpu_fused.silu_and_mul on the projection would), or None where that
    path does not apply (not a paired PackedLinear, nor a QuantizedLinear whose paired dense rows
    take this many rows; or the fused CPU ops are off)."""
    dense_pack = getattr(module, "dense_pack", None)  # PackedLinear, QuantizedLinear
    packed = dense_pack(x) if dense_pack is not None else None
    if not (isinstance(packed, OwnPacked) and packed.paired and module.bias is None
            and cpu_fused.usable(x)):
        return None
    x2 = x.reshape(-1, packed.k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    return torch.ops.radixlm_cpu.gemm_bf16_silu(x2, packed.data).view(*x.shape[:-1],
                                                                      packed.n // 2)


def linear(x: torch.Tensor, packed, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """(..., in) @ packed^T + bias -> (..., out), as F.linear."""
    if isinstance(packed, OwnPacked):
        return _own_linear(x, packed, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class PackedLinear(nn.Module):
    """An nn.Linear (bf16) that multiplies by its prepacked weight. `weight` stays the plain
    parameter that loaders write; call `repack` after writing it."""

    def __init__(self, lin: nn.Linear, gate_up: bool = False):
        super().__init__()
        self.in_features, self.out_features = lin.in_features, lin.out_features
        self.weight, self.bias = lin.weight, lin.bias
        self.gate_up = gate_up and lin.bias is None  # [gate; up] rows: pack them paired
        self.packed = pack(self.weight, self.gate_up)

    def repack(self) -> None:
        self.packed = pack(self.weight, self.gate_up)

    def dense_pack(self, x: torch.Tensor):
        """The pack that forward multiplies x by (QuantizedLinear.dense_pack's contract)."""
        return self.packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.packed, self.bias)

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}, "
                "prepacked bf16")


def convert_model(model: nn.Module, saved: Optional[dict] = None) -> int:
    """Swap the decoder projections (nn.Linear) for PackedLinear, pack the dense weights that
    QuantizedLinear keeps for many rows, and give the model a packed head
    (`model.lm_head_packed`). After loading; single-rank models only. Returns the layers packed.
    `saved`: packs of these same weights from an earlier start (repack_model)."""
    n = 0
    for parent in list(model.modules()):
        for name in cpu_linear.PROJECTIONS:
            child = getattr(parent, name, None)
            if isinstance(child, nn.Linear):
                setattr(parent, name, PackedLinear(child, gate_up=name == "gate_up_proj"))
                n += 1
    n += repack_model(model, saved)
    return n


HEAD = "lm_head_packed"  # the head's name in repack_model's `saved`


def repack_model(model: nn.Module, saved: Optional[dict] = None) -> int:
    """Refresh every packed copy from its plain weight (after a weight update). `saved`: module
    name -> pack data from an earlier start (executor/pack_cache.py), taken instead of packing
    where it fits (adopt)."""
    saved = saved or {}
    n = 0
    for name, mod in model.named_modules():
        # PackedLinear, and QuantizedLinear's dense rows (layers/quantized_linear); the layers
        # above this module define `repack`, so it needs no import of them
        if callable(getattr(mod, "repack", None)) and getattr(mod, "weight", None) is not None:
            gate_up = getattr(mod, "gate_up", False) and getattr(mod, "bias", None) is None
            pk = adopt(mod.weight, gate_up, saved.get(name))
            if pk is not None:
                mod.packed = pk
            else:
                mod.repack()
            n += 1
    blocks_only = (getattr(model, "lm_head_quant", None) is not None
                   and getattr(model, "lm_head_dense_above", None) is None)
    if hasattr(model, "lm_head_packed") and not blocks_only:  # else the head is GGUF blocks
        head = getattr(model, "lm_head", None)
        w = model.embed_tokens.weight if head is None else head.weight
        model.lm_head_packed = adopt(w, False, saved.get(HEAD)) or pack(w)
        n += 1
    return n


def own_packs(model: nn.Module) -> dict[str, torch.Tensor]:
    """Module name -> data of every OwnPacked the model holds (what repack_model's `saved`
    takes back)."""
    out = {name: mod.packed.data for name, mod in model.named_modules()
           if isinstance(getattr(mod, "packed", None), OwnPacked)}
    if isinstance(getattr(model, "lm_head_packed", None), OwnPacked):
        out[HEAD] = model.lm_head_packed.data
    return out
