"""FP8 checkpoints: which config.json `quantization_config`s load (models/fp8_checkpoint.py reads
the tensors, layers/fp8_linear.py runs them).

Formats accepted (what vLLM, SGLang and transformers load; in all of them a scale MULTIPLIES:
W ~= weight.float() * weight_scale, x ~= x_q * input_scale):
  quant_method "fp8"   vLLM / AutoFP8 / transformers' FineGrainedFP8Config without blocks.
      weights  `<layer>.weight` float8_e4m3fn with a per-tensor `<layer>.weight_scale` (vLLM) or
               `<layer>.weight_scale_inv` (transformers: despite the name, the same multiplier;
               its quantizer stores amax / 448)
      `activation_scheme` "dynamic" (default), or "static" with a per-tensor `<layer>.input_scale`
               (vLLM) or `<layer>.activation_scale` (transformers)
      `ignored_layers` / `modules_to_not_convert`: those layers are stored unquantized
      refused: `weight_block_size` (DeepSeek-style 128x128 blocks), `fmt` other than e4m3,
               `scale_fmt` other than float (ue8m0), `kv_cache_scheme`, FP4 experts, ...
  quant_method "compressed-tensors" (llm-compressor), `format` "float-quantized":
      every config group: weights {num_bits 8, type float, symmetric, strategy tensor
      (`weight_scale` [1]) | channel ([out, 1])}, input_activations {num_bits 8, type float,
      symmetric, dynamic true (strategy token or tensor: run per token) | dynamic false with
      strategy tensor (`input_scale` [1])}; `ignore` lists the unquantized layers.
      refused: block / group strategies, weight-only FP8 (input_activations null), dynamic
      "local", output_activations, kv_cache_scheme, sparsity / transforms, other formats.
Int4 checkpoints (awq, gptq, compressed-tensors "pack-quantized") are models/int4_config.py's:
`parse` returns None for them. Any other quant_method (bitsandbytes, ...) and any field not
listed is refused with an error naming it: a checkpoint we cannot run exactly is refused, never
run approximately.
"""

from __future__ import annotations

from typing import Optional

from radixlm.runtime.models import int4_config
from radixlm.runtime.models.quant_config_common import check_keys as _check_keys
from radixlm.runtime.models.quant_config_common import compressed_tensors_groups
from radixlm.runtime.models.quant_config_common import refuse as _refuse


def _parse_fp8(q: dict) -> bool:
    _check_keys(q, "", {"quant_method", "activation_scheme", "ignored_layers",
                        "modules_to_not_convert", "modules_to_convert", "weight_block_size",
                        "fmt", "scale_fmt", "dequantize", "expert_dtype", "kv_cache_scheme",
                        "kv_cache_quant_method"})
    scheme = str(q.get("activation_scheme", "dynamic")).lower()
    if scheme not in ("dynamic", "static"):
        _refuse("activation_scheme", q["activation_scheme"], "dynamic or static only")
    if q.get("weight_block_size") is not None:
        _refuse("weight_block_size", q["weight_block_size"], "block-wise FP8 scales "
                "(DeepSeek-style) are not implemented; per-tensor and per-channel scales are")
    for field, ok in (("fmt", ("e4m3",)), ("scale_fmt", ("float",)), ("expert_dtype", ("fp8",))):
        if q.get(field) is not None and q[field] not in ok:
            _refuse(field, q[field], f"only {ok[0]!r}")
    if q.get("dequantize"):
        _refuse("dequantize", q["dequantize"], "use fp8_linear=dequant to dequantize at load")
    if q.get("modules_to_convert"):
        _refuse("modules_to_convert", q["modules_to_convert"], "FP8 modules other than linear "
                "layers (embedding tables) are not implemented")
    for field in ("kv_cache_scheme", "kv_cache_quant_method"):
        if q.get(field):
            _refuse(field, q[field], "an FP8 KV cache is not implemented")
    return scheme == "static"


_ARG_KEYS = {"num_bits", "type", "symmetric", "strategy", "group_size", "block_structure",
             "dynamic", "actorder", "observer", "observer_kwargs", "scale_dtype", "zp_dtype"}


def _check_fp8_args(a: dict, where: str) -> None:
    _check_keys(a, where, _ARG_KEYS)
    for field, want in (("num_bits", 8), ("type", "float"), ("symmetric", True)):
        if a.get(field, want) != want:
            _refuse(where + field, a.get(field), f"FP8 e4m3 needs {field}={want!r}")
    for field in ("group_size", "block_structure", "actorder", "zp_dtype"):
        if a.get(field) is not None:
            _refuse(where + field, a[field], "per-tensor / per-channel / per-token FP8 only")
    if a.get("scale_dtype") not in (None, "torch.float32", "torch.bfloat16", "torch.float16"):
        _refuse(where + "scale_dtype", a["scale_dtype"], "float scales only")


def _parse_compressed_tensors(q: dict) -> bool:
    if q.get("format") != "float-quantized":
        _refuse("format", q.get("format"), "FP8 checkpoints in 'float-quantized' format only")
    groups = compressed_tensors_groups(q, "float-quantized")
    statics = set()
    for gname, g in groups.items():
        w = f"config_groups.{gname}."
        if g.get("output_activations") is not None:
            _refuse(w + "output_activations", g["output_activations"], "not implemented")
        wa = g.get("weights")
        if not isinstance(wa, dict):
            _refuse(w + "weights", wa, "needs FP8 weights")
        _check_fp8_args(wa, w + "weights.")
        if wa.get("strategy") not in ("tensor", "channel"):
            _refuse(w + "weights.strategy", wa.get("strategy"), "tensor or channel scales only "
                    "(block / group scales are not implemented)")
        if wa.get("dynamic", False):
            _refuse(w + "weights.dynamic", wa["dynamic"], "weights have stored scales")
        ia = g.get("input_activations")
        if ia is None:
            _refuse(w + "input_activations", None, "weight-only FP8 (W8A16) is not implemented")
        _check_fp8_args(ia, w + "input_activations.")
        dyn = ia.get("dynamic", False)
        if dyn is True and ia.get("strategy") in ("token", "tensor"):
            statics.add(False)
        elif dyn is False and ia.get("strategy") == "tensor":
            statics.add(True)
        else:
            _refuse(w + "input_activations", {k: ia.get(k) for k in ("strategy", "dynamic")},
                    "dynamic per-token / per-tensor or static per-tensor activations only")
    if len(statics) > 1:
        _refuse("config_groups", sorted(groups), "groups mixing static and dynamic activations")
    return statics.pop()


def parse(hf_config: dict) -> Optional[tuple[str, bool]]:
    """(quant_method, static_input) of an FP8 checkpoint's config, None without a
    quantization_config; ValueError naming the field for anything this loader cannot run."""
    q = hf_config.get("quantization_config")
    if q is None:
        return None
    if not isinstance(q, dict):
        _refuse("", q, "expected a dict")
    if int4_config.is_int4(q):  # int4 weights: models/int4_checkpoint.py
        return None
    method = q.get("quant_method")
    if method == "fp8":
        return method, _parse_fp8(q)
    if method == "compressed-tensors":
        return method, _parse_compressed_tensors(q)
    _refuse("quant_method", method, "supported: fp8, compressed-tensors (FP8 e4m3 or int4 "
            "pack-quantized weights), awq and gptq (GGUF files load with --load-format gguf)")


