"""The CPU fp32-GEMM path for bf16 models (layers/cpu_linear.py): the switch, and that it computes
what the plain bf16 path computes up to summation order (bf16 tolerance, greedy ties)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from radixlm.runtime.layers import cpu_linear, cpu_packed

CPU = torch.device("cpu")
PROMPTS = ["The quick brown fox", "def fibonacci(n):\n    ", "Once upon a time, in a small village,",
           "1, 2, 3, 4, 5,", "Paris is the capital of", "Q: What color is the sky?\nA:"]
MAX_NEW = 16
# bf16 logits near 16 are spaced 0.125 apart: two paths that differ only in summation order may
# round a near-tie either way. A greedy divergence is accepted only at such a near-tie.
NEAR_TIE = 0.26


# ------------------------------------------------------------------------------------ the switch

@pytest.fixture
def no_env(monkeypatch):
    monkeypatch.delenv(cpu_linear.ENV_VAR, raising=False)
    return monkeypatch


def test_auto_follows_the_cpu(no_env):
    no_env.setattr(cpu_linear, "cpu_has_native_bf16_matmul", lambda: False)
    assert cpu_linear.use_fp32_gemm("auto", CPU, torch.bfloat16)
    assert cpu_linear.use_fp32_gemm("auto", CPU, torch.float16)
    assert not cpu_linear.use_fp32_gemm("auto", CPU, torch.float32)  # nothing to widen
    no_env.setattr(cpu_linear, "cpu_has_native_bf16_matmul", lambda: True)
    assert not cpu_linear.use_fp32_gemm("auto", CPU, torch.bfloat16)
    assert cpu_linear.use_fp32_gemm("on", CPU, torch.bfloat16)


def test_never_on_cuda_and_off_wins(no_env):
    no_env.setattr(cpu_linear, "cpu_has_native_bf16_matmul", lambda: False)
    assert not cpu_linear.use_fp32_gemm("on", torch.device("cuda"), torch.bfloat16)
    assert not cpu_linear.use_fp32_gemm("off", CPU, torch.bfloat16)


def test_env_var_overrides_the_argument(no_env):
    no_env.setattr(cpu_linear, "cpu_has_native_bf16_matmul", lambda: False)
    no_env.setenv(cpu_linear.ENV_VAR, "off")
    assert not cpu_linear.use_fp32_gemm("on", CPU, torch.bfloat16)
    no_env.setenv(cpu_linear.ENV_VAR, "ON")
    assert cpu_linear.use_fp32_gemm("off", CPU, torch.bfloat16)
    no_env.setenv(cpu_linear.ENV_VAR, "sometimes")
    with pytest.raises(ValueError, match="RADIXLM_CPU_FP32_GEMM"):
        cpu_linear.use_fp32_gemm("auto", CPU, torch.bfloat16)


def test_native_bf16_detection_reads_cpu_flags():
    with open("/proc/cpuinfo") as f:
        flags = next((set(line.split(":", 1)[1].split()) for line in f
                      if line.startswith("flags")), set())
    assert cpu_linear.cpu_has_native_bf16_matmul() == bool(flags & {"avx512_bf16", "amx_bf16"})


# ------------------------------------------------------------------------------------ one layer

@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_bf16_linear(bias):
    torch.manual_seed(0)
    lin = nn.Linear(576, 960, bias=bias).to(torch.bfloat16)
    fast = cpu_linear.Fp32GemmLinear(lin)
    assert fast.weight.dtype == torch.float32
    assert torch.equal(fast.weight.to(torch.bfloat16), lin.weight)  # the exact bf16 values
    x = torch.randn(37, 576).to(torch.bfloat16)
    y, ref = fast(x), lin(x)
    assert y.dtype == torch.bfloat16 and y.shape == ref.shape
    exact = nn.functional.linear(x.double(), lin.weight.double(),
                                 None if lin.bias is None else lin.bias.double())
    # both round an fp32 sum once: each is within one bf16 step (2^-8 relative) of the exact sum
    for out in (y, ref):
        torch.testing.assert_close(out.double(), exact, rtol=2 ** -8, atol=1e-3)


# ------------------------------------------------------------------------- the engine, SmolLM2

def _run(smol_path, mode: str):
    import radixlm

    kw = {"dtype": "float32"} if mode == "fp32" else {"dtype": "bfloat16", "cpu_fp32_gemm": mode}
    # the dense path under test: auto would keep the GGUF's blocks (layers/quantized_linear.py)
    eng = radixlm.Engine(model_path=smol_path, max_total_tokens=4000, context_length=1024,
                         gguf_keep_quantized="off", **kw)
    try:
        runner = eng.runner
        outs = eng.generate(PROMPTS, {"temperature": 0, "max_new_tokens": MAX_NEW},
                            return_logprob=True, logprob_start_len=0, top_logprobs_num=3)
        projs = [type(m) for layer in runner.model.layers
                 for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                           layer.mlp.gate_up_proj, layer.mlp.down_proj)]
        return {"fp32_gemm": runner.fp32_gemm, "projs": projs,
                "head32": runner.model.lm_head_fp32, "outs": outs}
    finally:
        eng.shutdown()


@pytest.fixture(scope="module")
def runs(smol_path):
    mp = pytest.MonkeyPatch()
    mp.delenv(cpu_linear.ENV_VAR, raising=False)
    try:
        return {mode: _run(smol_path, mode) for mode in ("on", "off", "fp32")}
    finally:
        mp.undo()


def test_switch_is_honoured(runs):
    on, off = runs["on"], runs["off"]
    assert on["fp32_gemm"] and set(on["projs"]) == {cpu_linear.Fp32GemmLinear}
    assert on["head32"] is not None and on["head32"].dtype == torch.float32
    assert not off["fp32_gemm"] and off["head32"] is None
    # llama.Linear / nn.Linear, or prepacked for oneDNN on CPUs with bf16 matmul
    assert all(issubclass(t, (nn.Linear, cpu_packed.PackedLinear)) for t in off["projs"])
    assert not runs["fp32"]["fp32_gemm"]


def _prompt_logprobs(outs) -> list[float]:
    return [t[0] for o in outs for t in o["meta_info"]["input_token_logprobs"] if t[0] is not None]


def test_prompt_logprobs_within_bf16_tolerance(runs):
    on, off, ref = (_prompt_logprobs(runs[m]["outs"]) for m in ("on", "off", "fp32"))
    assert len(on) == len(off) == len(ref) > 30
    d = torch.tensor(on, dtype=torch.float64) - torch.tensor(off, dtype=torch.float64)
    assert d.abs().max() < 0.4 and d.abs().mean() < 0.08, (d.abs().max(), d.abs().mean())
    # and no further from the fp32 model than the plain bf16 path is
    err_on = (torch.tensor(on) - torch.tensor(ref)).abs().mean()
    err_off = (torch.tensor(off) - torch.tensor(ref)).abs().mean()
    assert err_on < 1.5 * err_off + 0.01, (err_on, err_off)


def test_greedy_tokens_match_up_to_bf16_ties(runs):
    identical = 0
    for i, (a, b) in enumerate(zip(runs["on"]["outs"], runs["off"]["outs"])):
        x, y = a["output_ids"], b["output_ids"]
        assert len(x) == len(y) == MAX_NEW
        k = next((j for j in range(MAX_NEW) if x[j] != y[j]), None)
        if k is None:
            identical += 1
            continue
        # diverged: in both paths the other path's token is a near-tie of the chosen one
        for o, mine, other in ((a, x[k], y[k]), (b, y[k], x[k])):
            top = {t: lp for lp, t, _ in o["meta_info"]["output_top_logprobs"][k]}
            assert other in top, f"prompt {i} step {k}: {other} not in top-3 {top}"
            assert top[mine] - top[other] <= NEAR_TIE, f"prompt {i} step {k}: {top}"
    assert identical >= 1
