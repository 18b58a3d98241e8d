"""FP8 checkpoints: reading config.json's `quantization_config` and the e4m3 weights with their
scales, for layers/fp8_linear.py (kept FP8) or dequantized at load.

Formats: models/fp8_config.py (what `quantization_config`s load, what is refused).

Which layers are FP8 comes from the tensors themselves (F8_E4M3 in the safetensors headers), so
`ignore` patterns need no interpretation. Two ways to run them (ServerArgs.fp8_linear, env
RADIXLM_FP8_LINEAR wins):
  scaled_mm  (auto on CUDA SM89+ with tp_size 1) decoder projections whose pieces are all e4m3
             become Fp8Linear (weights stay e4m3); other e4m3 tensors (MoE experts, an FP8 LM
             head) are dequantized at load to the runtime dtype
  dequant    (auto elsewhere: the CPU, tensor parallelism, GPUs without FP8 matmul) every e4m3
             weight is dequantized at load, W = weight * scale in fp32 rounded once to the
             runtime dtype; activations are not quantized. This is the dequantized reference
             itself, at the dense model's speed and memory.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Iterator, Optional

import torch

from radixlm.runtime.layers import fp8_linear
from radixlm.runtime.models.fp8_config import parse

logger = logging.getLogger(__name__)

ENV_VAR = "RADIXLM_FP8_LINEAR"
SETTINGS = ("auto", "scaled_mm", "dequant")
_FP8_DTYPES = {"F8_E4M3": torch.float8_e4m3fn}
_OTHER_FP8 = ("F8_E5M2", "F8_E4M3FNUZ", "F8_E5M2FNUZ", "F8_E8M0")
# scale-like tensor suffixes -> role
_SUFFIXES = ((".weight_scale_inv", "w"), (".weight_scale", "w"), (".input_scale", "x"),
             (".activation_scale", "x"), (".weight_zero_point", "zp"), (".input_zero_point", "zp"))
_PIECES = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
           "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}
_NAME_PREFIXES = ("model.language_model.", "language_model.model.", "model.")


@dataclass(frozen=True)
class Fp8Plan:
    method: str  # "fp8" | "compressed-tensors"
    static_input: bool  # activations quantized with the checkpoint's per-tensor input scales
    mode: str  # "scaled_mm" (Fp8Linear) | "dequant" (dense weights)

    @property
    def keep(self) -> bool:
        return self.mode == "scaled_mm"


def resolve_mode(setting: str, device: torch.device, tp_size: int = 1) -> str:
    setting = os.environ.get(ENV_VAR, "").strip().lower() or setting
    if setting not in SETTINGS:
        raise ValueError(f"fp8_linear / {ENV_VAR} must be one of {', '.join(SETTINGS)} "
                         f"(got {setting!r})")
    if tp_size > 1:  # distributed/sharding splits dense weights only
        if setting == "scaled_mm":
            raise ValueError(f"fp8_linear=scaled_mm does not support tensor parallelism "
                             f"(tp_size={tp_size}); use auto or dequant")
        logger.warning("FP8 checkpoint under tensor parallelism: weights dequantized at load")
        return "dequant"
    if setting == "scaled_mm" and device.type == "cuda":
        err = _probe_scaled_mm(device)
        if err is not None:
            raise ValueError(f"fp8_linear=scaled_mm: torch._scaled_mm with rowwise scales fails "
                             f"on {torch.cuda.get_device_name(device)} ({err}); use dequant")
    if setting != "auto":
        return setting
    if device.type != "cuda":
        logger.info("FP8 checkpoint on %s: weights dequantized at load (fp8_linear=dequant)",
                    device)
        return "dequant"
    err = _probe_scaled_mm(device)
    if err is not None:
        logger.warning("FP8 checkpoint: torch._scaled_mm with rowwise scales fails on %s (%s); "
                       "weights dequantized at load", torch.cuda.get_device_name(device), err)
        return "dequant"
    return "scaled_mm"


def _probe_scaled_mm(device: torch.device) -> Optional[str]:
    """None when rowwise-scaled e4m3 _scaled_mm runs on `device` (SM89+ with a recent torch)."""
    if torch.cuda.get_device_capability(device) < (8, 9):
        return "compute capability < 8.9 has no FP8 tensor cores"
    try:
        a = torch.zeros(16, 32, device=device).to(fp8_linear.E4M3)
        b = torch.zeros(16, 32, device=device).to(fp8_linear.E4M3)
        torch._scaled_mm(a, b.t(), scale_a=torch.ones(16, 1, device=device),
                         scale_b=torch.ones(1, 16, device=device), out_dtype=torch.bfloat16)
        return None
    except (RuntimeError, TypeError) as e:
        return str(e).splitlines()[0][:200]


def plan(hf_config: dict, setting: str, device: torch.device, tp_size: int = 1,
         load_format: str = "safetensors") -> Optional[Fp8Plan]:
    parsed = parse(hf_config)
    if parsed is None:
        return None
    if load_format not in ("safetensors", "dummy"):
        raise ValueError(f"a quantization_config with load_format={load_format!r}: FP8 weights "
                         "load from safetensors")
    return Fp8Plan(parsed[0], parsed[1], resolve_mode(setting, device, tp_size))


# --- the checkpoint ---------------------------------------------------------------------------
def module_path(hf_weight: str) -> Optional[str]:
    """`model.layers.3.self_attn.k_proj.weight` -> `layers.3.self_attn.qkv_proj` (the model's
    projection holding it), None for names that are not decoder projections."""
    name = hf_weight.removesuffix(".weight")
    for p in _NAME_PREFIXES:
        if name.startswith(p):
            name = name[len(p):]
            break
    parts = name.split(".")
    parts[-1] = _PIECES.get(parts[-1], parts[-1])
    if (len(parts) != 4 or parts[0] != "layers" or parts[2] not in ("self_attn", "mlp")
            or parts[-1] not in fp8_linear.PROJECTIONS):
        return None  # e.g. MoE experts (dequantized at load), the LM head
    return ".".join(parts)


def _scale_role(name: str) -> Optional[tuple[str, str]]:
    for suffix, role in _SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)], role
    return None


class Checkpoint:
    """The safetensors files of a folder: every tensor's dtype and shape (headers only) and the
    scales of its e4m3 weights in per-row form."""

    def __init__(self, model_path: str, static_input: bool):
        from safetensors import safe_open

        from radixlm.runtime.models import loader

        self.files = loader._safetensors_files(model_path)
        self.info: dict[str, tuple[str, tuple[int, ...]]] = {}
        scales: dict[str, dict[str, torch.Tensor]] = {}  # layer prefix -> role -> tensor
        for file in self.files:
            with safe_open(file, framework="pt") as f:
                for name in f.keys():
                    sl = f.get_slice(name)
                    self.info[name] = (sl.get_dtype(), tuple(sl.get_shape()))
                    role = _scale_role(name)
                    if role is not None:
                        got = scales.setdefault(role[0], {})
                        if role[1] in got and role[1] != "zp":
                            raise ValueError(f"{model_path}: {role[0]} has two {role[1]} scales "
                                             "(weight_scale and weight_scale_inv, or "
                                             "input_scale and activation_scale)")
                        got[role[1] if role[1] != "zp" else name] = f.get_tensor(name)
        bad = [n for n, (dt, _) in self.info.items() if dt in _OTHER_FP8]
        if bad:
            raise ValueError(f"{model_path}: {bad[0]} is {self.info[bad[0]][0]}; only "
                             "float8_e4m3fn weights are supported")
        self.fp8 = {n for n, (dt, _) in self.info.items() if dt in _FP8_DTYPES}
        if not self.fp8:
            raise ValueError(f"{model_path}: config.json has a quantization_config but no tensor "
                             "is float8_e4m3fn")
        self.w_rows: dict[str, torch.Tensor] = {}  # weight name -> (N,) fp32 multipliers
        self.x_scale: dict[str, torch.Tensor] = {}  # weight name -> 0-d fp32 input scale
        for prefix, got in scales.items():
            weight = prefix + ".weight"
            if weight not in self.fp8:
                raise ValueError(f"{model_path}: scales for {prefix} but {weight} is "
                                 f"{self.info.get(weight, ('missing',))[0]}, not float8_e4m3fn")
            for name, t in got.items():
                if name not in ("w", "x") and bool((t != 0).any()):
                    raise ValueError(f"{model_path}: {name} is not zero (asymmetric FP8 is not "
                                     "supported)")
            if "w" not in got:
                raise ValueError(f"{model_path}: {weight} has no weight_scale")
            self.w_rows[weight] = self._rows(weight, got["w"])
            if "x" in got:
                x = got["x"].float()
                if x.numel() != 1:
                    raise ValueError(f"{model_path}: {prefix} input scale of shape "
                                     f"{tuple(x.shape)}: per-tensor input scales only")
                self.x_scale[weight] = x.reshape(())
        missing = sorted(self.fp8 - set(self.w_rows))
        if missing:
            raise ValueError(f"{model_path}: {missing[0]} is float8_e4m3fn but has no "
                             "weight_scale / weight_scale_inv")
        if static_input:
            lacking = sorted(self.fp8 - set(self.x_scale))
            if lacking:
                raise ValueError(f"{model_path}: static activations (quantization_config) but "
                                 f"{lacking[0]} has no input_scale / activation_scale")

    def _rows(self, weight: str, s: torch.Tensor) -> torch.Tensor:
        shape = self.info[weight][1]
        if len(shape) != 2:
            raise ValueError(f"{weight}: FP8 tensors of shape {shape}: 2-D linear weights only")
        n = shape[0]
        s = s.float()
        if s.numel() == 1:  # per tensor: [], [1]
            return s.reshape(1).expand(n).contiguous()
        if tuple(s.shape) in ((n,), (n, 1)):  # per output channel
            return s.reshape(n).contiguous()
        raise ValueError(f"{weight}: weight scale of shape {tuple(s.shape)} for a {shape} weight: "
                         "per-tensor or per-channel scales only (block-wise scales are not "
                         "supported)")

    def kept_modules(self, candidates: set[str]) -> set[str]:
        """The module paths among `candidates` (the model's projections) whose checkpoint
        pieces are all e4m3."""
        pieces: dict[str, list[str]] = {}
        for name in self.info:
            if name.endswith(".weight"):
                path = module_path(name)
                if path is not None:
                    pieces.setdefault(path, []).append(name)
        kept = set()
        for path, names in pieces.items():
            fp8 = [n for n in names if n in self.fp8]
            if not fp8 or path not in candidates:
                continue
            if len(fp8) != len(names):
                raise ValueError(f"{path} fuses {', '.join(sorted(names))}, of which only "
                                 f"{', '.join(sorted(fp8))} are float8_e4m3fn: a fused layer "
                                 "needs its pieces in one format")
            kept.add(path)
        return kept

    def iter_weights(self, dtype: torch.dtype, kept: set[str], static_input: bool
                     ) -> Iterator[tuple[str, torch.Tensor]]:
        """HF-named tensors for the model's load_weights: e4m3 weights of `kept` modules as
        stored, with `<layer>.weight_scale` (N,) and (static) `<layer>.input_scale` (N,) in
        per-row form; every other e4m3 weight dequantized to `dtype`; scales otherwise dropped;
        other floating tensors cast to `dtype`."""
        from safetensors import safe_open

        for file in self.files:
            with safe_open(file, framework="pt") as f:
                for name in f.keys():
                    if _scale_role(name) is not None:
                        continue
                    t = f.get_tensor(name)
                    if name not in self.fp8:
                        yield name, t.to(dtype) if t.is_floating_point() else t
                        continue
                    rows = self.w_rows[name]
                    if module_path(name) not in kept:
                        yield name, fp8_linear.dequantize(t, rows, dtype)
                        continue
                    prefix = name.removesuffix(".weight")
                    yield name, t
                    yield prefix + ".weight_scale", rows
                    if static_input:
                        yield prefix + ".input_scale", self.x_scale[name].expand(rows.shape[0])


def load_weights(model: torch.nn.Module, model_path: str, dtype: torch.dtype, p: Fp8Plan,
                 device: torch.device) -> None:
    """Fill `model` (built, on its device, not yet loaded) from an FP8 checkpoint per `p`."""
    ckpt = Checkpoint(model_path, p.static_input)
    kept: set[str] = set()
    if p.keep:
        kept = ckpt.kept_modules({path for path, *_ in fp8_linear.projection_modules(model)})
        fp8_linear.convert_model(model, kept, p.static_input)
        fp8_linear.check_shapes(model, device)
    model.load_weights(ckpt.iter_weights(dtype, kept, p.static_input))
    fp8_linear.finish_loading(model)
    n_deq = sum(1 for n in ckpt.fp8 if module_path(n) not in kept)
    logger.info("FP8 checkpoint (%s, %s activations): %d projections kept e4m3, %d e4m3 "
                "tensors dequantized at load", p.method, "static" if p.static_input else
                "dynamic", len(kept), n_deq)


def reload_weights(model: torch.nn.Module, model_path: str, load_format: str, hf_config: dict,
                   dtype: torch.dtype, p: Fp8Plan) -> None:
    """update_weights_from_disk for a model loaded from an FP8 checkpoint: the new checkpoint
    must be FP8 in the same scheme, with e4m3 pieces for every kept layer."""
    if load_format != "safetensors":
        raise ValueError("the served model is an FP8 checkpoint: new weights must be safetensors")
    parsed = parse(hf_config)
    if parsed != (p.method, p.static_input):
        raise ValueError(f"the served model is FP8 ({p.method}, static activations: "
                         f"{p.static_input}); {model_path} has quantization {parsed}")
    ckpt = Checkpoint(model_path, p.static_input)
    kept = {n for n, m in model.named_modules() if isinstance(m, fp8_linear.Fp8Linear)}
    if not kept <= ckpt.kept_modules(kept):
        raise ValueError(f"{model_path}: not every layer the served model keeps in FP8 is "
                         "float8_e4m3fn there")
    model.load_weights(ckpt.iter_weights(dtype, kept, p.static_input))
    fp8_linear.finish_loading(model)
