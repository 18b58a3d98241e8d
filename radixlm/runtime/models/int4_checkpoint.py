"""Int4 weight-only checkpoints (AWQ, GPTQ, compressed-tensors W4A16): loading them kept int4
(layers/int4_linear.py) or dequantized at load.

Formats: models/int4_config.py (which quantization_configs load) and models/int4_formats.py
(the tensor layouts). Which layers are int4 comes from the tensors themselves (`<layer>.qweight`
or `<layer>.weight_packed`), so `modules_to_not_convert` / `ignore` need no interpretation.
Two ways to run them (ServerArgs.int4_linear, env RADIXLM_INT4_LINEAR wins):
  triton   (auto on CUDA with tp_size 1) decoder projections whose pieces are all int4 become
           Int4Linear (packed weights, Triton kernels picked per call by M: the GEMV for
           M <= triton_int4.GEMV_MAX_M, the tensor-core GEMM above); other int4 tensors are
           dequantized. Auto never takes torch's kernel: its bf16-rounded scales miss the
           tolerance of the dequantized weights the Triton kernels hold to
  torch    the same layers on torch's int4 kernel (_weight_int4pack_mm, bf16; layers/
           int4_torch.py: within a tolerance, not bit-equal to the dequantized weights), to
           measure against the Triton kernels; layers it cannot take keep Triton
  dequant  (auto elsewhere: the CPU, tensor parallelism) every int4 weight is dequantized at
           load, W = (q - z) * s in fp32 rounded once to the runtime dtype: the dequantized
           reference itself, at the dense model's speed and memory
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass
from typing import Iterator, Optional

import torch

from radixlm.runtime.layers import int4_linear
from radixlm.runtime.models import fp8_checkpoint, int4_formats
from radixlm.runtime.models.int4_config import Int4Scheme, parse

logger = logging.getLogger(__name__)

ENV_VAR = "RADIXLM_INT4_LINEAR"
SETTINGS = ("auto", "triton", "torch", "dequant")
DUMMY_GROUP = 128  # dummy weights of a config without a group size (GPTQ -1: per row)
# the checkpoint pieces of each fused projection, in row order (llama.py's load_weights order)
_ORDER = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


@dataclass(frozen=True)
class Int4Plan:
    scheme: Int4Scheme
    mode: str  # "triton" | "torch" (Int4Linear, which kernels) | "dequant" (dense weights)

    @property
    def keep(self) -> bool:
        return self.mode in ("triton", "torch")


def resolve_mode(setting: str, device: torch.device, tp_size: int = 1) -> str:
    setting = os.environ.get(ENV_VAR, "").strip().lower() or setting
    if setting not in SETTINGS:
        raise ValueError(f"int4_linear / {ENV_VAR} must be one of {', '.join(SETTINGS)} "
                         f"(got {setting!r})")
    if tp_size > 1:  # distributed/sharding splits dense weights only
        if setting in ("triton", "torch"):
            raise ValueError(f"int4_linear={setting} does not support tensor parallelism "
                             f"(tp_size={tp_size}); use auto or dequant")
        return "dequant"
    if setting != "auto":
        return setting
    return "triton" if device.type == "cuda" else "dequant"


def plan(hf_config: dict, setting: str, device: torch.device, tp_size: int = 1,
         load_format: str = "safetensors") -> Optional[Int4Plan]:
    scheme = parse(hf_config)
    if scheme is None:
        return None
    if load_format not in ("safetensors", "dummy"):
        raise ValueError(f"an int4 quantization_config with load_format={load_format!r}: int4 "
                         "weights load from safetensors")
    return Int4Plan(scheme, resolve_mode(setting, device, tp_size))


class Checkpoint:
    """The safetensors files of an int4 checkpoint: which layers are int4, their tensors."""

    def __init__(self, model_path: str, scheme: Int4Scheme):
        from safetensors import safe_open

        from radixlm.runtime.models import loader

        self.scheme, self.path = scheme, model_path
        self._stack = contextlib.ExitStack()
        self.where: dict[str, object] = {}  # tensor name -> its open file
        try:
            for file in loader._safetensors_files(model_path):
                f = self._stack.enter_context(safe_open(file, framework="pt"))
                for name in f.keys():
                    self.where[name] = f
            self._index(scheme, model_path)
        except BaseException:
            self.close()
            raise

    def _index(self, scheme: Int4Scheme, model_path: str) -> None:
        """Which layers are int4 (those with the packed tensor) and which tensors are theirs."""
        packed = "." + int4_formats.PACKED_SUFFIX[scheme.method]
        self.layers = sorted(n[: -len(packed)] for n in self.where if n.endswith(packed))
        if not self.layers:
            raise ValueError(f"{model_path}: config.json has an int4 quantization_config "
                             f"({scheme.method}) but no tensor is named *{packed}")
        suffixes = int4_formats.SUFFIXES[scheme.method]
        self.int4_tensors = {f"{p}.{s}" for p in self.layers for s in suffixes} & set(self.where)
        stray = [n for n in self.where if n.rsplit(".", 1)[-1] in suffixes
                 and n not in self.int4_tensors
                 and n.rsplit(".", 1)[0] + ".weight" not in self.where]
        if stray:
            raise ValueError(f"{model_path}: {stray[0]} belongs to no int4 layer")

    def close(self) -> None:
        self._stack.close()

    def get(self, name: str) -> Optional[torch.Tensor]:
        f = self.where.get(name)
        return None if f is None else f.get_tensor(name)

    def read(self, prefix: str) -> int4_formats.Int4Weight:
        return int4_formats.read(self.scheme, prefix, lambda s: self.get(f"{prefix}.{s}"))

    def fused_pieces(self) -> dict[str, list[str]]:
        """Module path (layers.3.self_attn.qkv_proj) -> the int4 layer prefixes it fuses, in
        row order; only modules whose every piece is int4 (a mix is an error)."""
        by_path: dict[str, dict[str, str]] = {}
        for p in self.layers:
            path = fp8_checkpoint.module_path(p + ".weight")
            if path is not None:
                by_path.setdefault(path, {})[p.rsplit(".", 1)[-1]] = p
        out = {}
        for path, pieces in by_path.items():
            attr = path.rsplit(".", 1)[-1]
            # (a checkpoint may store the fused projection itself, as Phi-3 does)
            order = (attr,) if set(pieces) == {attr} else _ORDER.get(attr, (attr,))
            missing = [o for o in order if o not in pieces]
            if missing:
                raise ValueError(f"{path} fuses {', '.join(order)}, of which "
                                 f"{', '.join(missing)} are not int4: a fused layer needs its "
                                 "pieces in one format")
            out[path] = [pieces[o] for o in order]
        return out

    def iter_weights(self, dtype: torch.dtype, kept: set[str]
                     ) -> Iterator[tuple[str, torch.Tensor]]:
        """HF-named tensors for the model's load_weights: int4 layers not in `kept` (prefixes)
        as `<layer>.weight` dequantized to `dtype`, kept ones skipped, the rest cast to `dtype`
        (floating) or as stored."""
        packed = int4_formats.PACKED_SUFFIX[self.scheme.method]
        for name in self.where:
            if name in self.int4_tensors:
                prefix, suffix = name.rsplit(".", 1)
                if suffix == packed and prefix not in kept:
                    yield prefix + ".weight", self.read(prefix).dequantize(dtype)
                continue
            t = self.get(name)
            yield name, t.to(dtype) if t.is_floating_point() else t


def _convert(model: torch.nn.Module, ckpt: Checkpoint, dtype: torch.dtype,
             device: torch.device) -> set[str]:
    """Swap the projections whose pieces are all int4 for Int4Linear, filled from the
    checkpoint; returns the int4 layer prefixes now held packed."""
    pieces = ckpt.fused_pieces()
    kept: set[str] = set()
    for path, parent, attr, lin in list(int4_linear.projection_modules(model)):
        names = pieces.get(path)
        if not names:
            continue
        try:
            new = int4_linear.Int4Linear.from_weights([ckpt.read(p) for p in names],
                                                      lin.bias is not None, dtype, device)
        except ValueError as e:  # e.g. q/k/v act-order with different permutations
            logger.warning("%s stays dense (dequantized at load): %s", path, e)
            continue
        if (new.out_features, new.in_features) != (lin.out_features, lin.in_features):
            raise ValueError(f"{path}: int4 weight {new.out_features} x {new.in_features}, the "
                             f"model's is {lin.out_features} x {lin.in_features}")
        new.sources = tuple(names)
        setattr(parent, attr, new)
        kept.update(names)
    return kept


def load_weights(model: torch.nn.Module, model_path: str, dtype: torch.dtype, p: Int4Plan,
                 device: torch.device) -> None:
    """Fill `model` (built, on its device, not yet loaded) from an int4 checkpoint per `p`."""
    ckpt = Checkpoint(model_path, p.scheme)
    try:
        kept = _convert(model, ckpt, dtype, device) if p.keep else set()
        model.load_weights(ckpt.iter_weights(dtype, kept))
    finally:
        ckpt.close()
    _pick_kernels(model, p)
    n_deq = len(ckpt.layers) - len(kept)
    if p.keep:
        logger.info("int4 checkpoint (%s, group %s): %d layers kept int4 (%s), %d "
                    "dequantized at load to %s", p.scheme.method, p.scheme.group_size or "row",
                    len(kept), _kernels_note(p.mode), n_deq, dtype)
    else:
        logger.info("int4 checkpoint (%s, group %s) on %s: all %d int4 layers dequantized at "
                    "load to %s (int4_linear=dequant)", p.scheme.method,
                    p.scheme.group_size or "row", device, n_deq, dtype)


def _kernels_note(mode: str) -> str:
    if mode != "triton":
        return f"{mode} kernels"
    from radixlm.runtime.layers import triton_int4  # (CUDA: triton is there)

    return (f"triton kernels: GEMV for batch <= {triton_int4.GEMV_MAX_M}, tensor-core GEMM "
            "above, one packed copy")


def init_dummy(model: torch.nn.Module, p: Int4Plan) -> None:
    """Random int4 weights (load_format dummy, kept int4): the dense random projections
    rounded to int4 in the scheme's group size."""
    if p.keep:
        int4_linear.quantize_model(model, p.scheme.group_size or DUMMY_GROUP, p.scheme.sym)
        _pick_kernels(model, p)


def _pick_kernels(model: torch.nn.Module, p: Int4Plan) -> None:
    if p.mode == "triton":  # small batches on a Hopper kernel (layers/int4_batch1.py)
        done, left = int4_linear.use_tma(model)
        if done:
            kinds = sorted({m.tma.kind for m in model.modules()
                            if isinstance(m, int4_linear.Int4Linear) and m.tma is not None})
            logger.info("int4: %d layers run small batches on the %s GEMV, %d on the register "
                        "GEMV", done, " / ".join(kinds), left)
    if p.mode == "torch":
        done, left = int4_linear.use_torch_kernels(model)
        if left:
            logger.warning("int4_linear=torch: %d layers keep the Triton kernels (shapes torch's "
                           "int4 kernel does not take)", left)


def reload_weights(model: torch.nn.Module, model_path: str, load_format: str, hf_config: dict,
                   dtype: torch.dtype, p: Int4Plan) -> None:
    """update_weights_from_disk for a model loaded from an int4 checkpoint: the new checkpoint
    must be int4 in the same scheme, with int4 pieces of the same shapes for every kept layer
    (all checked before any layer is written)."""
    if load_format != "safetensors":
        raise ValueError("the served model is an int4 checkpoint: new weights must be safetensors")
    if parse(hf_config) != p.scheme:
        raise ValueError(f"the served model is int4 {p.scheme}; {model_path} has "
                         f"{parse(hf_config)}")
    ckpt = Checkpoint(model_path, p.scheme)
    try:
        mods = [m for m in model.modules() if isinstance(m, int4_linear.Int4Linear)]
        new = []
        for m in mods:
            if not all(s in ckpt.layers for s in m.sources):
                raise ValueError(f"{model_path}: {', '.join(m.sources)} not all int4 there")
            r = int4_linear.Int4Linear.from_weights([ckpt.read(s) for s in m.sources],
                                                    False, dtype, "cpu")
            for b in ("qweight", "scales", "zeros", "perm"):
                a, c = getattr(m, b), getattr(r, b)
                if (a is None) != (c is None) or (a is not None and a.shape != c.shape):
                    raise ValueError(f"{model_path}: {m.sources[0]} {b} differs in shape or "
                                     "act-order from the served layer's")
            new.append(r)
        kept = {s for m in mods for s in m.sources}
        model.load_weights(ckpt.iter_weights(dtype, kept))
    finally:
        ckpt.close()
    for m, r in zip(mods, new):
        for b in ("qweight", "scales", "zeros", "perm"):
            if getattr(m, b) is not None:
                getattr(m, b).copy_(getattr(r, b))
        if m.torch_packed is not None:  # torch's packs follow the new weights
            m.use_torch_kernels()
        if m.tma is not None:  # (the transposed scales and zeros, in place)
            m.use_tma()
