"""Mixtral and Qwen3-MoE against HF transformers, fp32, on tiny random checkpoints from
`save_pretrained` (per-expert tensors on disk): greedy tokens (CPU C++ and torch_native
attention), prompt logprobs, radix cache on vs off; the expert computation against HF's experts
module (grouped path and the CUDA-graph dense path); stacked (HF 5 in-memory) checkpoint names;
the bf16 CPU fp32-GEMM path; refusals."""

from __future__ import annotations

import pytest
import torch
import transformers as tf

import arch_parity as ap
from radixlm.runtime.config import ModelConfig
from radixlm.runtime.layers import cpu_linear
from radixlm.runtime.models import registry
from radixlm.runtime.models.loader import iter_weights, load_hf_config
from radixlm.runtime.models.moe import Experts, SparseMoeBlock

VOCAB = 256
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
              bos_token_id=None, eos_token_id=None)
CASES = {
    "mixtral": (tf.MixtralForCausalLM, lambda: tf.MixtralConfig(
        **COMMON, num_local_experts=6, num_experts_per_tok=2)),
    # top-3 of 8, renormalized; layer 1 dense (mlp_only_layers)
    "qwen3moe": (tf.Qwen3MoeForCausalLM, lambda: tf.Qwen3MoeConfig(
        **COMMON, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=48,
        norm_topk_prob=True, mlp_only_layers=[1])),
    # top-2 of 8 without renormalization; decoder_sparse_step 2: only layer 1 sparse
    "qwen3moe-step2": (tf.Qwen3MoeForCausalLM, lambda: tf.Qwen3MoeConfig(
        **COMMON, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48,
        decoder_sparse_step=2)),
}


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    """(name, checkpoint folder, HF model, prompts, HF greedy outputs)."""
    cls, config = CASES[request.param]
    case = ap.make_case(request.param, cls, config(), tmp_path_factory, VOCAB)
    return case


@pytest.mark.parametrize("backend", ["auto", "torch_native"])
def test_greedy_and_prompt_logprobs_match_hf(case, backend):
    name, model = case[0], case[2]

    def checks(eng):
        assert type(eng.runner.model).__name__ == model.config.architectures[0]
        sparse = [isinstance(layer.mlp, SparseMoeBlock) for layer in eng.runner.model.layers]
        assert sparse == {"mixtral": [True] * 3, "qwen3moe": [True, False, True],
                          "qwen3moe-step2": [False, True, False]}[name]
    ap.check_engine_matches_hf(case, backend, checks)


@pytest.mark.parametrize("variant", ap.VARIANTS, ids=ap.VARIANT_IDS)
def test_radix_off_and_chunked_prefill_agree(case, variant):
    ap.check_variant_matches_hf(case, **variant)


def test_dummy_weights_run(case):
    name, path, model, prompts, ref = case
    eng = ap.make_engine(path, load_format="dummy")
    try:
        outs = ap.generate(eng, prompts[:3], max_new=4)
        assert all(len(o["output_ids"]) == 4 for o in outs)
        eng.wait_idle()
        eng.check_integrity()
    finally:
        eng.shutdown()


def _ours(path: str, dtype=torch.float32):
    cfg = ModelConfig.from_hf(load_hf_config(path))
    model = registry.model_class(cfg, ap.CONTEXT)(cfg).to(dtype)
    model.rope.reset("cpu")
    return model


def test_stacked_checkpoint_names_load_the_same_weights(case):
    """HF 5 keeps experts stacked in memory (mlp.experts.gate_up_proj (E, 2I, H)); save_pretrained
    writes one tensor per expert. Both load to the same parameters."""
    name, path, model, prompts, ref = case
    stacked = model.state_dict()
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in stacked)
    a, b = _ours(path), _ours(path)
    a.load_weights(iter_weights(path))
    b.load_weights(stacked.items())
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert na == nb and torch.equal(pa, pb), na


def test_missing_expert_tensor_is_reported(case):
    name, path, model, prompts, ref = case
    weights = [(n, t) for n, t in iter_weights(path) if ".experts.3." not in n or "down" in n
               or ".w2." in n]
    with pytest.raises(ValueError, match="lacks"):
        _ours(path).load_weights(weights)


@pytest.mark.parametrize("name", ["mixtral", "qwen3moe"])
def test_experts_match_hf_experts_module(name):
    """Our grouped expert computation, and the dense one CUDA graph capture uses, against HF's
    experts module on the same routing (ties and repeated experts included)."""
    torch.manual_seed(0)
    cfg = CASES[name][1]()
    hf_block = CASES[name][0](cfg).model.layers[0].mlp.float().eval()
    with torch.no_grad():
        for p in hf_block.parameters():
            p.normal_(0, 0.1)
    e = hf_block.experts.num_experts
    ours = Experts(e, cfg.hidden_size, hf_block.experts.intermediate_dim)
    ours.load_state_dict({"gate_up_proj": hf_block.experts.gate_up_proj,
                          "down_proj": hf_block.experts.down_proj})
    x = torch.randn(37, cfg.hidden_size)
    k = cfg.num_experts_per_tok
    idx = torch.stack([torch.randperm(e)[:k] for _ in range(37)])
    idx[:5] = torch.arange(k)  # several tokens on the same experts
    w = torch.rand(37, k)
    with torch.no_grad():
        ref = hf_block.experts(x, idx, w)
        torch.testing.assert_close(ours(x, idx, w), ref, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(ours._dense(x, *_sorted(idx, w)), ref, atol=1e-6, rtol=1e-5)
        # the whole block (router included) equals HF's sparse block
        block = SparseMoeBlock(cfg.hidden_size, hf_block.experts.intermediate_dim, e, k,
                               renormalize=name == "mixtral" or cfg.norm_topk_prob,
                               weights_in_model_dtype=name != "mixtral")
        block.gate.weight.copy_(hf_block.gate.weight)
        block.experts.load_state_dict(ours.state_dict())
        torch.testing.assert_close(block(x), hf_block(x[None])[0], atol=1e-6, rtol=1e-5)


def _sorted(idx, w):
    idx, perm = idx.sort(dim=-1)
    return idx, w.gather(-1, perm)


def test_bf16_cpu_fp32_gemm_path_converts_the_dense_layers_only(case):
    """bf16 on the CPU fp32-GEMM path: attention / dense MLP projections become fp32 GEMMs; the
    stacked experts and the router stay bf16 (exact bf16 math). It computes what the plain bf16
    path computes up to summation order."""
    name, path, model, prompts, ref = case
    lps = {}
    for setting in ("on", "off"):
        eng = ap.make_engine(path, dtype="bfloat16", cpu_fp32_gemm=setting)
        try:
            m = eng.runner.model
            moe = next(layer.mlp for layer in m.layers if isinstance(layer.mlp, SparseMoeBlock))
            assert moe.experts.gate_up_proj.dtype == moe.gate.weight.dtype == torch.bfloat16
            converted = isinstance(m.layers[0].self_attn.qkv_proj, cpu_linear.Fp32GemmLinear)
            assert converted == (setting == "on")
            o = eng.generate(input_ids=prompts[4], sampling_params={"max_new_tokens": 0},
                             return_logprob=True, logprob_start_len=0)
            got = o["meta_info"]["input_token_logprobs"][1:]
            lps[setting] = torch.tensor([lp for lp, _, _ in got])
            eng.wait_idle()
            eng.check_integrity()
        finally:
            eng.shutdown()
    torch.testing.assert_close(lps["on"], lps["off"], atol=0.1, rtol=0)


# ---------------------------------------------------------------------------------- refusals

def _cfg(arch: str, **extra) -> ModelConfig:
    base = {"MixtralForCausalLM": dict(model_type="mixtral", num_local_experts=4,
                                       num_experts_per_tok=2),
            "Qwen3MoeForCausalLM": dict(model_type="qwen3_moe", num_experts=4,
                                        num_experts_per_tok=2, moe_intermediate_size=32)}[arch]
    return ModelConfig.from_hf({**COMMON, "architectures": [arch], **base, **extra})


@pytest.mark.parametrize("arch,extra,match", [
    ("MixtralForCausalLM", dict(num_experts_per_tok=5), "num_experts_per_tok=5"),
    ("MixtralForCausalLM", dict(hidden_act="gelu"), "hidden_act='gelu'"),
    ("Qwen3MoeForCausalLM", dict(decoder_sparse_step=0), "decoder_sparse_step=0"),
    ("Qwen3MoeForCausalLM", dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}),
     "rope_type='yarn'"),
])
def test_refused_configs_name_the_field(arch, extra, match):
    with pytest.raises(ValueError, match=match):
        registry.model_class(_cfg(arch, **extra), ap.CONTEXT)


def test_accepted_configs():
    # every layer windowed; Qwen3-MoE's window only with use_sliding_window
    for arch, extra, windows in [
            ("MixtralForCausalLM", dict(sliding_window=100), (100,) * 3),
            ("Qwen3MoeForCausalLM", dict(sliding_window=16), ()),
            ("Qwen3MoeForCausalLM", dict(sliding_window=16, use_sliding_window=True), (16,) * 3)]:
        cfg = _cfg(arch, **extra)
        assert registry.model_class(cfg, ap.CONTEXT).attention_spec(cfg).windows == windows
    # HF 5 writes num_local_experts for Qwen3-MoE (attribute_map of num_experts)
    hf = {**_cfg("Qwen3MoeForCausalLM").hf, "num_local_experts": 4}
    del hf["num_experts"]
    cfg = ModelConfig.from_hf(hf)
    model = registry.model_class(cfg, ap.CONTEXT)(cfg)
    assert model.layers[0].mlp.experts.gate_up_proj.shape == (4, 64, 64)
