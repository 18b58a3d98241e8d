"""Int4 weight-only checkpoints: which config.json `quantization_config`s load
(models/int4_formats.py reads the tensors, models/int4_checkpoint.py loads them, layers/
int4_linear.py runs them).

Every accepted format means the same math, per output row n and input column k:
    W[n, k] = (q[n, k] - z[n, g(k)]) * s[n, g(k)]          q, z 4-bit, s a float scale
with g(k) = k // group_size, or g_idx[k] where the checkpoint stores one (act-order).

  quant_method "awq"   AutoAWQ: bits 4, `version` "gemm" only (gemv / gemv_fast / exllama /
                       marlin / ipex layouts refused), `zero_point` true (asymmetric),
                       group_size 32 / 64 / 128; `modules_to_not_convert` layers are dense.
  quant_method "gptq"  AutoGPTQ / GPTQModel / transformers: bits 4, group_size 32 / 64 / 128 (or
                       -1: one group per row), `sym` true or false, `desc_act` true (with a
                       stored g_idx) or false; `checkpoint_format` "gptq" (v1: stored zero =
                       zero - 1) or "gptq_v2" (stored zero = zero); "marlin" / "bitblas" refused,
                       `lm_head` true, per-module `dynamic` overrides, `rotation` and `adapter`
                       refused.
  quant_method "compressed-tensors" (llm-compressor W4A16), `format` "pack-quantized": every
                       config group {weights: num_bits 4, type int, strategy group (32 / 64 /
                       128) or channel, symmetric or not, actorder null / weight / static (no
                       g_idx) or group / dynamic (stored weight_g_idx), dynamic false;
                       input_activations null}; `ignore` layers are dense.
A field this module does not know is refused with an error naming it (an unknown detail could
change the numbers); fields known to be calibration-only metadata are accepted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from radixlm.runtime.models.quant_config_common import check_keys as _check_keys
from radixlm.runtime.models.quant_config_common import compressed_tensors_groups
from radixlm.runtime.models.quant_config_common import refuse as _refuse

GROUP_SIZES = (32, 64, 128)
METHODS = ("awq", "gptq", "compressed-tensors")


@dataclass(frozen=True)
class Int4Scheme:
    method: str  # "awq" | "gptq" | "compressed-tensors"
    group_size: int  # 32 / 64 / 128; 0: one group per row (GPTQ -1, compressed-tensors channel)
    sym: bool  # symmetric: the zero is 8 (GPTQ / compressed-tensors), checked at load
    g_idx: bool  # the checkpoint stores a per-column group index (act-order)
    zero_offset: int = 0  # added to stored zeros: 1 for GPTQ v1 ("gptq") checkpoints


def _group(where: str, value: Any, per_row: tuple = ()) -> int:
    if value in per_row:
        return 0
    if value not in GROUP_SIZES:
        _refuse(where, value, f"group sizes {GROUP_SIZES} only")
    return int(value)


def _bits(where: str, value: Any) -> None:
    if value != 4:
        _refuse(where, value, "4-bit weights only")


# calibration-only metadata of transformers' AwqConfig / AutoAWQ
_AWQ_KEYS = {"quant_method", "bits", "w_bit", "group_size", "q_group_size", "zero_point",
             "version", "modules_to_not_convert", "do_fuse", "fuse_max_seq_len",
             "modules_to_fuse", "exllama_config", "backend"}


def _parse_awq(q: dict) -> Int4Scheme:
    _check_keys(q, "", _AWQ_KEYS)
    _bits("bits", q.get("bits", q.get("w_bit")))
    version = str(q.get("version", "gemm")).lower()
    if version != "gemm":
        _refuse("version", q.get("version"), "the 'gemm' layout only (qweight [in, out/8])")
    if q.get("zero_point", True) is not True:
        _refuse("zero_point", q["zero_point"], "AWQ with zero points only")
    if q.get("do_fuse"):
        _refuse("do_fuse", q["do_fuse"], "fused AWQ modules are transformers-only")
    group = _group("group_size", q.get("group_size", q.get("q_group_size")))
    return Int4Scheme("awq", group, sym=False, g_idx=False)


# calibration-only metadata of AutoGPTQ / GPTQModel / transformers' GPTQConfig
_GPTQ_KEYS = {"quant_method", "bits", "group_size", "desc_act", "sym", "checkpoint_format",
              "lm_head", "dynamic", "damp_percent", "damp_auto_increment", "true_sequential",
              "static_groups", "model_name_or_path", "model_file_base_name", "meta",
              "quantizer", "is_marlin_format", "pack_dtype", "mse", "v2", "v2_alpha",
              "tokenizer", "dataset", "use_cuda_fp16", "model_seqlen", "block_name_to_quantize",
              "module_name_preceding_first_block", "batch_size", "pad_token_id", "use_exllama",
              "max_input_length", "exllama_config", "cache_block_outputs",
              "modules_in_block_to_quantize", "backend", "format", "rotation", "hyb_act",
              "act_group_aware", "adapter", "device", "buffered_fwd", "offload_to_disk",
              "offload_to_disk_path"}


def _parse_gptq(q: dict) -> Int4Scheme:
    _check_keys(q, "", _GPTQ_KEYS)
    _bits("bits", q.get("bits"))
    group = _group("group_size", q.get("group_size"), per_row=(-1,))
    fmt = q.get("checkpoint_format", q.get("format", "gptq"))
    if fmt not in ("gptq", "gptq_v2"):
        _refuse("checkpoint_format", fmt, "'gptq' (v1) or 'gptq_v2' layouts only")
    if q.get("is_marlin_format"):
        _refuse("is_marlin_format", q["is_marlin_format"], "the Marlin layout is not read")
    if q.get("pack_dtype", "int32") not in ("int32", "torch.int32"):
        _refuse("pack_dtype", q["pack_dtype"], "int32 packing only")
    if q.get("lm_head"):
        _refuse("lm_head", q["lm_head"], "a quantized LM head is not implemented")
    if q.get("dynamic"):
        _refuse("dynamic", q["dynamic"], "per-module quantization overrides are not implemented")
    if q.get("rotation"):  # rotated weights need rotated activations (a Hadamard transform)
        _refuse("rotation", q["rotation"], "rotated (e.g. Hadamard) checkpoints are not "
                "implemented")
    if q.get("adapter"):
        _refuse("adapter", q["adapter"], "quantization-error adapters (EoRA) are not implemented")
    sym = q.get("sym", True)
    if not isinstance(sym, bool):
        _refuse("sym", sym, "true or false")
    desc_act = q.get("desc_act", False)
    if not isinstance(desc_act, bool):
        _refuse("desc_act", desc_act, "true or false")
    return Int4Scheme("gptq", group, sym=sym, g_idx=desc_act,
                      zero_offset=1 if fmt == "gptq" else 0)


_CT_ARG_KEYS = {"num_bits", "type", "symmetric", "strategy", "group_size", "block_structure",
                "dynamic", "actorder", "observer", "observer_kwargs", "scale_dtype", "zp_dtype"}


def _parse_ct_weights(a: dict, where: str) -> Int4Scheme:
    _check_keys(a, where, _CT_ARG_KEYS)
    _bits(where + "num_bits", a.get("num_bits"))
    if a.get("type", "int") != "int":
        _refuse(where + "type", a.get("type"), "integer weights only")
    if a.get("dynamic", False) is not False:
        _refuse(where + "dynamic", a["dynamic"], "weights have stored scales")
    if a.get("block_structure") is not None:
        _refuse(where + "block_structure", a["block_structure"], "group / channel scales only")
    strategy = a.get("strategy")
    if strategy == "group":
        group = _group(where + "group_size", a.get("group_size"))
    elif strategy == "channel":
        group = 0
    else:
        _refuse(where + "strategy", strategy, "'group' or 'channel' only")
    actorder = a.get("actorder")
    if actorder not in (None, False, True, "weight", "static", "group", "dynamic"):
        _refuse(where + "actorder", actorder, "null, weight, static, group or dynamic only")
    if a.get("scale_dtype") not in (None, "torch.float32", "torch.bfloat16", "torch.float16"):
        _refuse(where + "scale_dtype", a["scale_dtype"], "float scales only")
    if a.get("zp_dtype") not in (None, "torch.int8", "torch.int32"):
        _refuse(where + "zp_dtype", a["zp_dtype"], "integer zero points only")
    sym = a.get("symmetric", True)
    if not isinstance(sym, bool):
        _refuse(where + "symmetric", sym, "true or false")
    return Int4Scheme("compressed-tensors", group, sym=sym,
                      g_idx=actorder in (True, "group", "dynamic"))


def _parse_compressed_tensors(q: dict) -> Int4Scheme:
    groups = compressed_tensors_groups(q, "pack-quantized")
    schemes = set()
    for gname, g in groups.items():
        w = f"config_groups.{gname}."
        for field in ("input_activations", "output_activations"):
            if g.get(field) is not None:
                _refuse(w + field, g[field], "weight-only int4 (W4A16) only")
        if not isinstance(g.get("weights"), dict):
            _refuse(w + "weights", g.get("weights"), "needs int4 weights")
        schemes.add(_parse_ct_weights(g["weights"], w + "weights."))
    if len(schemes) > 1:
        _refuse("config_groups", sorted(groups), "groups with different int4 schemes")
    return schemes.pop()


def is_int4(q: Any) -> bool:
    """Whether a `quantization_config` is this module's to parse (fp8_config leaves it here)."""
    if not isinstance(q, dict):
        return False
    method = q.get("quant_method")
    return method in ("awq", "gptq") or (method == "compressed-tensors"
                                         and q.get("format") == "pack-quantized")


def parse(hf_config: dict) -> Optional[Int4Scheme]:
    """The int4 scheme of a checkpoint's config, None when it is not an int4 checkpoint;
    ValueError naming the field for anything this loader cannot run exactly."""
    q = hf_config.get("quantization_config")
    if not is_int4(q):
        return None
    method = q["quant_method"]
    if method == "awq":
        return _parse_awq(q)
    if method == "gptq":
        return _parse_gptq(q)
    return _parse_compressed_tensors(q)
