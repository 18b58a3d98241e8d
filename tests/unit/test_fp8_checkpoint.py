"""FP8 checkpoints through the Engine on the CPU (models/fp8_checkpoint.py, layers/fp8_linear.py):
tiny random-weight Llamas quantized to e4m3 in the formats users bring (tests/unit/fp8_ckpt.py),
against HF transformers in fp32 on the dequantized weights.

  dequant    (the CPU default) weights dequantized at load: the reference itself, HF's greedy
             tokens and prompt log-probs within 1e-3
  scaled_mm  the GPU path run by torch's CPU _scaled_mm: within the stated tolerance of the
             dequantized reference (fp8_ckpt.LP_MEAN_TOL / LP_MAX_TOL), the same greedy tokens
             where the reference's margin is clear, and the same greedy tokens as the reference
             with e4m3 activations emulated (HF + hooks)
and the checkpoints it must refuse, each with an error naming what is wrong."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

import arch_parity as ap
import fp8_ckpt as fc
from radixlm.runtime.layers import fp8_linear
from radixlm.runtime.models import fp8_checkpoint

E4M3 = torch.float8_e4m3fn


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    from transformers import LlamaForCausalLM

    cfg = fc.llama_config()
    model = ap.save_tiny(LlamaForCausalLM, cfg, tmp_path_factory.mktemp("fp8-base"))
    return cfg, model, ap.prompts(fc.VOCAB)


def _write(base, path, fmt, **kw):
    from transformers import LlamaForCausalLM

    cfg, model, prompts = base
    deq = fc.write_fp8(model, str(path), fmt, calib_prompts=prompts[:4], **kw)
    return fc.reference_model(LlamaForCausalLM, cfg, deq)


@pytest.fixture(scope="module", params=fc.FORMATS)
def case(request, base, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    ref = _write(base, path, request.param)
    return request.param, str(path), ref, base[2]


def _fp8_modules(eng) -> list:
    return [m for m in eng.runner.model.modules() if isinstance(m, fp8_linear.Fp8Linear)]


def test_dequant_path_is_the_reference(case):
    fmt, path, ref, prompts = case
    eng = ap.make_engine(path)  # auto on the CPU: dequantized at load
    try:
        assert eng.runner.fp8.mode == "dequant" and not _fp8_modules(eng)
        ap.check_greedy(eng, prompts, ap.hf_greedy(ref, prompts))
        ap.check_prompt_logprobs(eng, ref, prompts)
    finally:
        eng.shutdown()


def test_scaled_mm_path_within_tolerance(case):
    fmt, path, ref, prompts = case
    eng = ap.make_engine(path, fp8_linear="scaled_mm")
    try:
        mods = _fp8_modules(eng)
        assert len(mods) == 8 and all(m.weight.dtype == E4M3 for m in mods)
        assert all((m.input_scale is not None) == fmt.endswith("static") for m in mods)
        fc.check_fp8_engine(eng, ref, prompts)
        # greedy tokens of the reference with e4m3 activations emulated: the same computation up
        # to fp32 summation order, which can still flip an e4m3 rounding now and then (one step
        # moves a log-prob by up to ~0.08 here, more than some margins): 8 of 9 prompts at least
        scales = fc.input_scales(path) if fmt.endswith("static") else None
        with fc.Fp8Emulation(ref, scales):
            emu = ap.hf_greedy(ref, prompts)
        outs = ap.generate(eng, prompts)
        same = sum(o["output_ids"] == e for o, e in zip(outs, emu))
        assert same >= len(prompts) - 1, same
    finally:
        eng.shutdown()


def test_bf16_scaled_mm_within_tolerance(base, tmp_path):
    ref = _write(base, tmp_path, "ct-channel")
    eng = ap.make_engine(str(tmp_path), fp8_linear="scaled_mm", dtype="bfloat16")
    try:
        assert len(_fp8_modules(eng)) == 8
        fc.check_fp8_engine(eng, ref, base[2])
    finally:
        eng.shutdown()


def test_unquantized_layers_stay_dense(base, tmp_path):
    """Layers a checkpoint leaves unquantized (compressed-tensors `ignore`, vLLM
    `ignored_layers`) load dense; the rest keep e4m3."""
    ref = _write(base, tmp_path, "fp8-dynamic", skip=("down_proj",))
    eng = ap.make_engine(str(tmp_path), fp8_linear="scaled_mm")
    try:
        assert len(_fp8_modules(eng)) == 6
        assert all(isinstance(layer.mlp.down_proj, torch.nn.Linear)
                   for layer in eng.runner.model.layers)
        fc.check_fp8_engine(eng, ref, base[2])
    finally:
        eng.shutdown()


def test_qwen2_biases(tmp_path):
    """q/k/v biases (Qwen2) with FP8 weights: added in the model dtype after _scaled_mm."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=fc.VOCAB, hidden_size=128, intermediate_size=256,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=512, tie_word_embeddings=False)
    model = ap.save_tiny(Qwen2ForCausalLM, cfg, tmp_path / "src")
    deq = fc.write_fp8(model, str(tmp_path / "fp8"), "ct-channel")
    ref = fc.reference_model(Qwen2ForCausalLM, cfg, deq)
    eng = ap.make_engine(str(tmp_path / "fp8"), fp8_linear="scaled_mm")
    try:
        assert eng.runner.model.layers[0].self_attn.qkv_proj.bias is not None
        fc.check_fp8_engine(eng, ref, ap.prompts(fc.VOCAB))
    finally:
        eng.shutdown()


@pytest.mark.parametrize("arch,fmt", [("qwen3", "fp8-static"), ("phi3-partial", "fp8-dynamic")])
def test_other_architectures(arch, fmt, tmp_path):
    """Qwen3 (q/k norms after the FP8 qkv) and Phi-3 (checkpoint names already fused: one
    per-tensor scale for all of qkv_proj, split into rows by phi3.py's loader)."""
    import test_model_parity_qwen3_phi3 as dense

    cls, config = dense.CASES[arch]
    cfg = config()
    model = ap.save_tiny(cls, cfg, tmp_path / "src")
    prompts = ap.prompts(fc.VOCAB)
    deq = fc.write_fp8(model, str(tmp_path / "fp8"), fmt, calib_prompts=prompts[:4])
    ref = fc.reference_model(cls, cfg, deq)
    eng = ap.make_engine(str(tmp_path / "fp8"), fp8_linear="scaled_mm")
    try:
        assert len(_fp8_modules(eng)) == 8
        fc.check_fp8_engine(eng, ref, prompts)
    finally:
        eng.shutdown()


def test_dummy_weights_with_fp8_config(base, tmp_path):
    """--load-format dummy with an FP8 config (benchmarks): random e4m3 projections."""
    _write(base, tmp_path / "ck", "fp8-dynamic")
    os.makedirs(tmp_path / "cfg")
    shutil.copy(tmp_path / "ck" / "config.json", tmp_path / "cfg" / "config.json")
    eng = ap.make_engine(str(tmp_path / "cfg"), load_format="dummy", fp8_linear="scaled_mm")
    try:
        assert len(_fp8_modules(eng)) == 8
        out = eng.generate(input_ids=[[1, 2, 3]], sampling_params={"max_new_tokens": 4,
                                                                   "ignore_eos": True})
        assert len(out[0]["output_ids"]) == 4
    finally:
        eng.shutdown()


def test_reload_weights_in_place(base, tmp_path):
    """update_weights_from_disk's path (scheduler_control): an FP8 checkpoint in the same scheme
    replaces the weights and scales in place; one in another scheme is refused."""
    from transformers import LlamaForCausalLM

    cfg = fc.llama_config()
    other = ap.save_tiny(LlamaForCausalLM, cfg, tmp_path / "src2", seed=1)
    _write(base, tmp_path / "a", "ct-channel")
    fc.write_fp8(other, str(tmp_path / "b"), "ct-channel")
    _write(base, tmp_path / "static", "ct-tensor-static")
    prompts = base[2][:4]
    fresh = ap.make_engine(str(tmp_path / "b"), fp8_linear="scaled_mm")
    try:
        want = [o["output_ids"] for o in ap.generate(fresh, prompts)]
    finally:
        fresh.shutdown()
    eng = ap.make_engine(str(tmp_path / "a"), fp8_linear="scaled_mm")
    try:
        model, plan = eng.runner.model, eng.runner.fp8
        load = lambda p: fp8_checkpoint.reload_weights(  # noqa: E731
            model, p, "safetensors", json.load(open(os.path.join(p, "config.json"))),
            torch.float32, plan)
        with pytest.raises(ValueError, match="static activations"):
            load(str(tmp_path / "static"))
        load(str(tmp_path / "b"))
        assert [o["output_ids"] for o in ap.generate(eng, prompts)] == want
    finally:
        eng.shutdown()


# --- refusals ---------------------------------------------------------------------------------
def _engine_error(path, **kw) -> str:
    with pytest.raises(ValueError) as e:
        eng = ap.make_engine(str(path), **kw)
        eng.shutdown()
    return str(e.value)


def _edit_tensors(path, fn) -> None:
    from safetensors.torch import load_file, save_file

    f = os.path.join(path, "model.safetensors")
    tensors = load_file(f)
    fn(tensors)
    save_file(tensors, f)


def test_refuses_fp8_tensors_without_quantization_config(base, tmp_path):
    _write(base, tmp_path, "fp8-dynamic")
    fc.set_quant(str(tmp_path), None)
    assert "quantization_config" in _engine_error(tmp_path)


def test_refuses_block_wise_checkpoints(base, tmp_path):
    _write(base, tmp_path, "fp8-dynamic")
    fc.set_quant(str(tmp_path), {"quant_method": "fp8", "activation_scheme": "dynamic",
                                 "weight_block_size": [128, 128]})
    assert "weight_block_size" in _engine_error(tmp_path)
    # a 2-D scale grid under a config that claims per-tensor scales is refused as well
    fc.set_quant(str(tmp_path), fc.quantization_config("fp8-dynamic"))
    name = "model.layers.0.mlp.gate_proj.weight_scale"
    _edit_tensors(tmp_path, lambda t: t.__setitem__(name, torch.ones(2, 1) * t[name]))
    assert "block-wise" in _engine_error(tmp_path, fp8_linear="scaled_mm")


def test_refuses_inconsistent_tensors(base, tmp_path):
    _write(base, tmp_path / "mixed", "fp8-dynamic", skip=("k_proj",))
    # q and v in e4m3, k not: no fused qkv in one format (dequantizing at load still works)
    assert "fuses" in _engine_error(tmp_path / "mixed", fp8_linear="scaled_mm")
    eng = ap.make_engine(str(tmp_path / "mixed"))
    eng.shutdown()
    _write(base, tmp_path / "noscale", "fp8-dynamic")
    _edit_tensors(tmp_path / "noscale",
                  lambda t: t.pop("model.layers.1.mlp.up_proj.weight_scale"))
    assert "no weight_scale" in _engine_error(tmp_path / "noscale")
    _write(base, tmp_path / "static", "fp8-static")
    _edit_tensors(tmp_path / "static",
                  lambda t: t.pop("model.layers.0.self_attn.o_proj.input_scale"))
    assert "no input_scale" in _engine_error(tmp_path / "static", fp8_linear="scaled_mm")
    _write(base, tmp_path / "e5m2", "fp8-dynamic")
    name = "model.layers.0.mlp.down_proj.weight"
    _edit_tensors(tmp_path / "e5m2",
                  lambda t: t.__setitem__(name, t[name].float().to(torch.float8_e5m2)))
    assert "F8_E5M2" in _engine_error(tmp_path / "e5m2")
