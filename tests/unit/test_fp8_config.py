"""models/fp8_checkpoint: which `quantization_config`s load (the formats vLLM, transformers and
llm-compressor write) and which are refused, with an error naming the field; and how the run
mode (scaled_mm / dequant) is picked."""

from __future__ import annotations

import copy

import pytest
import torch

import fp8_ckpt as fc
from radixlm.runtime.models import fp8_checkpoint as fck


@pytest.mark.parametrize("fmt", fc.FORMATS)
def test_accepts_the_formats_users_bring(fmt):
    method, static = fck.parse({"quantization_config": fc.quantization_config(fmt)})
    assert method == ("compressed-tensors" if fmt.startswith("ct") else "fp8")
    assert static == fmt.endswith("static")


@pytest.mark.parametrize("scheme", ["dynamic", "static"])
def test_hf_format_is_what_transformers_writes(scheme):
    """fp8_ckpt's hf-* configs are transformers' own FineGrainedFP8Config without blocks."""
    import json

    from transformers import FineGrainedFP8Config

    cfg = FineGrainedFP8Config(weight_block_size=None, activation_scheme=scheme)
    assert json.loads(cfg.to_json_string()) == fc.quantization_config(f"hf-{scheme}")


def test_accepts_more_real_variants():
    # AutoFP8 / neuralmagic (vLLM): activation_scheme static, ignored_layers
    assert fck.parse({"quantization_config": {"quant_method": "fp8", "activation_scheme":
                                              "static", "ignored_layers": ["lm_head"]}}) == \
        ("fp8", True)
    # minimal vLLM config: dynamic by default
    assert fck.parse({"quantization_config": {"quant_method": "fp8"}}) == ("fp8", False)
    # compressed-tensors dynamic per-tensor activations run per token (finer, never coarser)
    q = fc.quantization_config("ct-channel")
    q["config_groups"]["group_0"]["input_activations"]["strategy"] = "tensor"
    assert fck.parse({"quantization_config": q}) == ("compressed-tensors", False)
    assert fck.parse({"architectures": ["LlamaForCausalLM"]}) is None


def _ct(**changes):
    q = copy.deepcopy(fc.quantization_config("ct-channel"))
    g = q["config_groups"]["group_0"]
    for key, value in changes.items():
        where, _, field = key.rpartition("__")
        d = q if not where else g if where == "g" else g[where]
        d[field] = value
    return q


REFUSED = {  # quantization_config -> the field the error must name
    "block-wise fp8": ({"quant_method": "fp8", "weight_block_size": [128, 128]},
                       "weight_block_size"),
    "e5m2": ({"quant_method": "fp8", "fmt": "e5m2"}, "fmt"),
    "ue8m0 scales": ({"quant_method": "fp8", "scale_fmt": "ue8m0"}, "scale_fmt"),
    "fp8 kv cache": ({"quant_method": "fp8", "kv_cache_scheme": {"num_bits": 8}},
                     "kv_cache_scheme"),
    "bad scheme": ({"quant_method": "fp8", "activation_scheme": "per_block"},
                   "activation_scheme"),
    "unknown field": ({"quant_method": "fp8", "new_knob": 1}, "new_knob"),
    "fp4 experts": ({"quant_method": "fp8", "expert_dtype": "fp4"}, "expert_dtype"),
    "bitsandbytes": ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quant_method"),
    "ct block": (_ct(weights__strategy="block", weights__block_structure=[128, 128]),
                 "block_structure"),
    "ct group": (_ct(weights__strategy="group", weights__group_size=128), "group_size"),
    "ct int8": (_ct(weights__type="int"), "weights.type"),
    "ct 4 bit": (_ct(weights__num_bits=4), "weights.num_bits"),
    "ct asymmetric": (_ct(input_activations__symmetric=False), "input_activations.symmetric"),
    "ct weight-only": (_ct(g__input_activations=None), "input_activations"),
    "ct dynamic local": (_ct(input_activations__dynamic="local"), "input_activations"),
    "ct static token": (_ct(input_activations__dynamic=False), "input_activations"),
    "ct output acts": (_ct(g__output_activations={"num_bits": 8}), "output_activations"),
    "ct kv cache": (_ct(kv_cache_scheme={"num_bits": 8, "type": "float"}), "kv_cache_scheme"),
    "ct format": (_ct(format="naive-quantized"), "format"),
    "ct unknown group field": (_ct(g__extra=1), "extra"),
    "ct sparsity": (_ct(sparsity_config={"format": "sparse-24"}), "sparsity_config"),
}


def test_int4_configs_are_left_to_the_int4_loader():
    """awq, gptq and compressed-tensors pack-quantized are models/int4_config.py's to parse."""
    for q in ({"quant_method": "gptq", "bits": 4}, {"quant_method": "awq"},
              _ct(format="pack-quantized")):
        assert fck.parse({"quantization_config": q}) is None


@pytest.mark.parametrize("name", list(REFUSED))
def test_refuses_what_it_cannot_run_naming_the_field(name):
    q, field = REFUSED[name]
    with pytest.raises(ValueError, match=rf"quantization_config\.\S*{field}"):
        fck.parse({"quantization_config": q})


def test_mode_resolution(monkeypatch):
    cpu = torch.device("cpu")
    assert fck.resolve_mode("auto", cpu) == "dequant"  # CPU serving: dequantized at load
    assert fck.resolve_mode("scaled_mm", cpu) == "scaled_mm"  # tests: torch's CPU _scaled_mm
    assert fck.resolve_mode("auto", cpu, tp_size=2) == "dequant"
    with pytest.raises(ValueError, match="tensor parallelism"):
        fck.resolve_mode("scaled_mm", cpu, tp_size=2)
    monkeypatch.setenv(fck.ENV_VAR, "scaled_mm")
    assert fck.resolve_mode("dequant", cpu) == "scaled_mm"  # the env var wins
    monkeypatch.setenv(fck.ENV_VAR, "fast")
    with pytest.raises(ValueError, match="RADIXLM_FP8_LINEAR"):
        fck.resolve_mode("auto", cpu)
    monkeypatch.delenv(fck.ENV_VAR)
    with pytest.raises(ValueError, match="load_format='gguf'"):
        fck.plan({"quantization_config": {"quant_method": "fp8"}}, "auto", cpu, 1, "gguf")


def test_module_paths():
    assert fck.module_path("model.layers.3.self_attn.k_proj.weight") == \
        "layers.3.self_attn.qkv_proj"
    assert fck.module_path("model.layers.0.mlp.up_proj.weight") == "layers.0.mlp.gate_up_proj"
    assert fck.module_path("model.layers.0.mlp.down_proj.weight") == "layers.0.mlp.down_proj"
    assert fck.module_path("model.layers.1.self_attn.qkv_proj.weight") == \
        "layers.1.self_attn.qkv_proj"  # Phi-3's fused names
    assert fck.module_path("language_model.model.layers.2.self_attn.o_proj.weight") == \
        "layers.2.self_attn.o_proj"  # LLaVA
    assert fck.module_path("model.layers.0.mlp.experts.3.gate_proj.weight") is None  # MoE
    assert fck.module_path("lm_head.weight") is None
