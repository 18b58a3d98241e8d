"""Int4 checkpoints (AWQ, GPTQ, compressed-tensors W4A16) through the Engine on the CPU
(models/int4_checkpoint.py): a tiny random Llama quantized and packed by tests/unit/int4_ckpt.py
in each format, against the same model with the dequantized weights written as a plain fp32
checkpoint. Exactness: both hold bit-identical fp32 weights, so the greedy tokens are equal.

  dequant   (the CPU default) weights dequantized at load
  triton    the kept-int4 layers (Int4Linear: the repacked layout, fused q/k/v and gate/up,
            act-order permutations) run by their torch emulation: the same weights again
and the checkpoints it must refuse, each with an error naming what is wrong."""

from __future__ import annotations

import json
import os

import pytest
import torch

import arch_parity as ap
import int4_ckpt as ic
from triton_interpreter import gpu_checks
from radixlm.runtime.layers import int4_linear
from radixlm.runtime.models import int4_checkpoint

# one of each format and each feature (asymmetric zeros, GPTQ v1 / v2, act-order, group sizes
# 32 / 64 / 128, per-row groups); test_int4_formats unpacks all of ic.CASES bit-exactly
_checks = gpu_checks("tests/gpu/test_int4.py")

ENGINE_CASES = ("awq-g32", "gptq-v1-asym-act-g64", "gptq-v2-sym-act-g128", "ct-asym-g32",
                "ct-sym-act-g64", "gptq-v1-row")
PROMPTS = 5  # of ap.prompts: short and long prompts, one pair sharing a prefix


@pytest.fixture(scope="module")
def base():
    model = ic.tiny_llama()
    prompts = ap.prompts(model[0]["vocab_size"])
    return model, prompts[:3] + prompts[-2:]


@pytest.fixture(scope="module", params=ENGINE_CASES)
def case(request, base, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    plain = tmp_path_factory.mktemp(request.param + "-plain")
    ic.write_int4(base[0], str(path), ic.CASES[request.param], plain_path=str(plain))
    return request.param, str(path), _ref_tokens(str(plain), base[1]), base[1]


def _ref_tokens(path: str, prompts) -> list[list[int]]:
    """Greedy tokens of a (plain) checkpoint's engine, which also ends with the integrity check."""
    eng = ap.make_engine(path)
    try:
        out = [o["output_ids"] for o in ap.generate(eng, prompts)]
        eng.wait_idle()
        eng.check_integrity()
        return out
    finally:
        eng.shutdown()


def _int4_modules(eng) -> list:
    return [m for m in eng.runner.model.modules() if isinstance(m, int4_linear.Int4Linear)]


@pytest.mark.parametrize("mode", ["auto", "triton"])
def test_engine_equals_the_dequantized_checkpoint(case, mode):
    name, path, ref, prompts = case
    eng = ap.make_engine(path, int4_linear=mode)
    try:
        mods = _int4_modules(eng)
        if mode == "auto":  # the CPU: dequantized at load
            assert eng.runner.int4.mode == "dequant" and not mods
        else:
            assert len(mods) == 8  # 2 layers x (qkv, o, gate_up, down)
            # act-order: permuted columns where a layer has more than one group (a K of one
            # group needs no permutation: every column is in group 0)
            perms = [m.perm is not None for m in mods]
            assert any(perms) if ic.CASES[name].act else not any(perms)
        ap.check_greedy(eng, prompts, ref)  # ends with the integrity check
    finally:
        eng.shutdown()


@pytest.mark.parametrize("mode", ["dequant", "triton"])
def test_qwen2_biases(tmp_path, mode):
    """q/k/v biases (Qwen2-AWQ / -GPTQ checkpoints): loaded by the model into Int4Linear's bias
    rows, added after the int4 matmul."""
    model = ic.tiny_llama(base=ic.QWEN2)
    ic.write_int4(model, str(tmp_path / "q"), ic.CASES["gptq-v1-asym-act-g64"],
                  plain_path=str(tmp_path / "p"))
    prompts = ap.prompts(model[0]["vocab_size"])[:5]
    ref = _ref_tokens(str(tmp_path / "p"), prompts)
    eng = ap.make_engine(str(tmp_path / "q"), int4_linear=mode)
    try:
        qkv = eng.runner.model.layers[0].self_attn.qkv_proj
        assert qkv.bias is not None and bool(qkv.bias.abs().sum() > 0)
        assert isinstance(qkv, int4_linear.Int4Linear) == (mode == "triton")
        ap.check_greedy(eng, prompts, ref)
    finally:
        eng.shutdown()


def test_dequant_load_logs_one_line(base, tmp_path, caplog):
    ic.write_int4(base[0], str(tmp_path), ic.CASES["awq-g128"])
    with caplog.at_level("INFO", logger="radixlm.runtime.models.int4_checkpoint"):
        eng = ap.make_engine(str(tmp_path))
    try:
        lines = [r.getMessage() for r in caplog.records if "int4" in r.getMessage()]
        assert len(lines) == 1 and "dequantized at load" in lines[0], lines
        eng.wait_idle()
        eng.check_integrity()
    finally:
        eng.shutdown()


def test_unquantized_layers_stay_dense(base, tmp_path):
    """Layers a checkpoint leaves dense (AWQ modules_to_not_convert, compressed-tensors ignore)
    load dense; a fused projection with a dense piece is refused when kept int4."""
    plain = tmp_path / "plain"
    ic.write_int4(base[0], str(tmp_path / "a"), ic.CASES["ct-asym-g32"], plain_path=str(plain),
                  skip=("down_proj",))
    ref = _ref_tokens(str(plain), base[1])
    eng = ap.make_engine(str(tmp_path / "a"), int4_linear="triton")
    try:
        assert len(_int4_modules(eng)) == 6
        assert all(isinstance(layer.mlp.down_proj, torch.nn.Linear)
                   for layer in eng.runner.model.layers)
        ap.check_greedy(eng, base[1], ref)
    finally:
        eng.shutdown()
    ic.write_int4(base[0], str(tmp_path / "b"), ic.CASES["ct-asym-g32"], skip=("k_proj",))
    with pytest.raises(ValueError, match="k_proj are not int4"):
        ap.make_engine(str(tmp_path / "b"), int4_linear="triton")


def test_refused_checkpoints(base, tmp_path):
    c = ic.CASES["gptq-v2-asym-g128"]
    ic.write_int4(base[0], str(tmp_path), c)
    ic.set_quant(str(tmp_path), {**ic.quantization_config(c), "sym": True})
    with pytest.raises(ValueError, match="sym"):  # the zeros are not 8
        ap.make_engine(str(tmp_path))
    ic.set_quant(str(tmp_path), {**ic.quantization_config(c), "bits": 3})
    with pytest.raises(ValueError, match=r"quantization_config\.bits"):
        ap.make_engine(str(tmp_path))
    ic.set_quant(str(tmp_path), {**ic.quantization_config(c), "quant_method": "awq"})
    with pytest.raises(ValueError, match=r"quantization_config\.\w+"):  # AWQ field names
        ap.make_engine(str(tmp_path))
    ic.set_quant(str(tmp_path), {"quant_method": "bitsandbytes"})
    with pytest.raises(ValueError, match=r"quantization_config\.quant_method"):
        ap.make_engine(str(tmp_path))


def test_torch_int4_kernels_cpu():
    """int4_linear=torch's repack and (scale, zero) mapping through torch's CPU int4 kernel
    (the CUDA op's uint8 packing: tests/gpu/test_int4.py)."""
    _checks.check_int4_torch("cpu")


def test_engine_on_torch_int4_kernels(case):
    """bf16 activations and bf16 scales: not the exact weights, so most, not all, greedy
    sequences equal the dequantized reference's."""
    name, path, ref, prompts = case
    if ic.CASES[name].group == 0:
        pytest.skip("one group per row: torch's kernel takes groups of 32-256 only")
    eng = ap.make_engine(path, int4_linear="torch")
    try:
        mods = _int4_modules(eng)
        assert len(mods) == 8 and all(m.torch_packed is not None for m in mods)
        outs = [o["output_ids"] for o in ap.generate(eng, prompts)]
        assert sum(o == r for o, r in zip(outs, ref)) >= len(prompts) - 2, (outs, ref)
        eng.wait_idle()
        eng.check_integrity()
    finally:
        eng.shutdown()


@pytest.mark.parametrize("mode", ["dequant", "triton"])
def test_reload_weights_in_place(base, tmp_path, mode):
    """update_weights_from_disk's path (scheduler_control): an int4 checkpoint in the same scheme
    replaces the weights in place (packed buffers and act-order permutations for kept layers);
    one in another scheme is refused before anything is written."""
    c = ic.CASES["gptq-v1-asym-act-g64"]
    ic.write_int4(base[0], str(tmp_path / "a"), c)
    ic.write_int4(ic.tiny_llama(seed=1), str(tmp_path / "b"), c, plain_path=str(tmp_path / "p"))
    ic.write_int4(base[0], str(tmp_path / "other"), ic.CASES["awq-g32"])
    prompts = base[1]
    want = _ref_tokens(str(tmp_path / "p"), prompts)
    eng = ap.make_engine(str(tmp_path / "a"), int4_linear=mode)
    try:
        model, plan = eng.runner.model, eng.runner.int4
        load = lambda p: int4_checkpoint.reload_weights(  # noqa: E731
            model, p, "safetensors", json.load(open(os.path.join(p, "config.json"))),
            torch.float32, plan)
        with pytest.raises(ValueError, match="awq"):
            load(str(tmp_path / "other"))
        load(str(tmp_path / "b"))
        assert [o["output_ids"] for o in ap.generate(eng, prompts)] == want
        eng.wait_idle()
        eng.check_integrity()
    finally:
        eng.shutdown()
