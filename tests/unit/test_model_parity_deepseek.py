"""DeepSeek-V2 / V3 (MLA + MoE) against HF transformers, fp32, on tiny random checkpoints written
with `save_pretrained`: greedy tokens (cold and from the radix cache) and prompt logprobs; radix
cache off and chunked prefill give the same tokens; the KV pool holds the latent only; the
multi-token-prediction layer's tensors are skipped. Every engine test ends with the KV integrity
check (free + cached + in use == capacity)."""

from __future__ import annotations

import pytest
import torch
import transformers as tf

import arch_parity as ap
from radixlm.runtime.executor import model_runner
from radixlm.runtime.mem_cache.kv_pool import MLAKVPool
from radixlm.runtime.models.deepseek_moe import DeepseekMoE

VOCAB, MAX_NEW = 256, 8
MLA = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
           num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16,
           qk_rope_head_dim=8, v_head_dim=12, max_position_embeddings=512, bos_token_id=None,
           eos_token_id=None)
# YaRN past position 128 (the longest prompt is 150 tokens): mscale != mscale_all_dim makes the
# cos/sin attention factor != 1 as well as the softmax-scale mscale**2
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": 128, "mscale": 0.707, "mscale_all_dim": 1.0}
CASES = {
    # V2-Lite's shape: no q LoRA, greedy top-2 of 8, 2 shared experts, layer 0 dense, YaRN
    "v2-lite": (tf.DeepseekV2ForCausalLM, lambda: tf.DeepseekV2Config(
        **MLA, q_lora_rank=None, n_routed_experts=8, n_shared_experts=2, num_experts_per_tok=2,
        first_k_dense_replace=1, topk_method="greedy", rope_parameters=YARN)),
    # V2's shape: q LoRA, group-limited greedy (2 of 4 groups), routed_scaling_factor, plain
    # rope; with attention_bias (q_a / kv_a / o projections) as a config may state it
    "v2": (tf.DeepseekV2ForCausalLM, lambda: tf.DeepseekV2Config(
        **MLA, q_lora_rank=24, attention_bias=True, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=3,
        first_k_dense_replace=0, topk_method="group_limited_greedy", n_group=4, topk_group=2,
        routed_scaling_factor=2.0)),
    # V3's shape: q LoRA, sigmoid scores with the correction bias, grouped top-3, renormalized,
    # scaled; layer 0 dense; YaRN with mscale == mscale_all_dim (V3's own config)
    "v3": (tf.DeepseekV3ForCausalLM, lambda: tf.DeepseekV3Config(
        **MLA, q_lora_rank=24, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=3,
        first_k_dense_replace=1, n_group=4, topk_group=2, norm_topk_prob=True,
        routed_scaling_factor=2.5, rope_parameters={**YARN, "mscale": 1.0})),
}
SPARSE = {"v2-lite": [False, True, True], "v2": [True] * 3, "v3": [False, True, True]}


def prompts(seed: int = 1) -> list[list[int]]:
    """Short, long (past YaRN's original 128 positions) and two sharing a 40-token prefix."""
    g = torch.Generator().manual_seed(seed)
    ids = lambda n: torch.randint(0, VOCAB, (n,), generator=g).tolist()  # noqa: E731
    shared = ids(40)
    return [ids(1), ids(9), ids(150), shared + ids(3), shared + ids(25)]


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    """(name, checkpoint folder, HF model, prompts, HF greedy outputs)."""
    cls, config = CASES[request.param]
    path = tmp_path_factory.mktemp(request.param)
    model = ap.save_tiny(cls, config(), path)
    if request.param == "v3":  # a correction bias that changes the choice (a buffer: not random)
        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.e_score_correction_bias.uniform_(-0.3, 0.3)
        model.save_pretrained(path)
    ids = prompts()
    return request.param, str(path), model, ids, ap.hf_greedy(model, ids, MAX_NEW)


def check_greedy(eng, ids, ref) -> None:
    """Batch greedy equals HF cold, then again with the prompts in the radix cache."""
    for round_ in range(2):
        outs = ap.generate(eng, ids, MAX_NEW)
        assert [o["output_ids"] for o in outs] == ref, f"round {round_}"
        if round_ == 1 and not eng.server_args.disable_radix_cache:
            assert all(o["meta_info"]["cached_tokens"] > 0 for o in outs[1:])
    eng.wait_idle()
    eng.check_integrity()


def test_greedy_and_prompt_logprobs_match_hf(case):
    name, path, model, ids, ref = case
    eng = ap.make_engine(path)  # auto: the MLA backend's torch decode on the CPU
    try:
        runner = eng.runner
        assert type(runner.model).__name__ == model.config.architectures[0]
        assert runner.attention_backend_name == "mla_torch"
        assert isinstance(runner.kv_pool, MLAKVPool)
        assert [isinstance(layer.mlp, DeepseekMoE) for layer in runner.model.layers] == SPARSE[name]
        check_greedy(eng, ids, ref)
        ap.check_prompt_logprobs(eng, model, ids)  # ends with the integrity check
    finally:
        eng.shutdown()


@pytest.mark.parametrize("variant", ap.VARIANTS, ids=ap.VARIANT_IDS)
def test_radix_off_and_chunked_prefill_agree(case, variant):
    """No cache, and prefill in chunks of 16 (later chunks attend over the earlier ones' latent
    in the absorbed form): HF's tokens still."""
    _, path, _, ids, ref = case
    eng = ap.make_engine(path, **variant)
    try:
        check_greedy(eng, ids, ref)
    finally:
        eng.shutdown()


def test_kv_bytes_per_token_are_the_latent_only(case, monkeypatch):
    """(kv_lora_rank + qk_rope_head_dim) * layers * dtype bytes per token, and the capacity a
    memory budget buys is sized by that (not by expanded K/V heads)."""
    _, path, model, ids, _ = case
    c = model.config
    bpt = (c.kv_lora_rank + c.qk_rope_head_dim) * c.num_hidden_layers * 4  # fp32
    assert MLAKVPool.bytes_per_token(c.num_hidden_layers, c.kv_lora_rank, c.qk_rope_head_dim,
                                     torch.float32) == bpt == 480
    monkeypatch.setattr(model_runner, "CPU_KV_BUDGET_BYTES", 480 * 1000)
    import radixlm

    eng = radixlm.Engine(model_path=path, skip_tokenizer_init=True, dtype="float32",
                         context_length=ap.CONTEXT)  # no max_total_tokens: from the budget
    try:
        pool = eng.runner.kv_pool
        assert eng.runner.capacity == 1000
        held = sum(b.numel() * b.element_size() for b in pool.latent_buffers)
        assert held == (eng.runner.capacity + 1) * bpt
        assert not hasattr(pool, "k_buffers") and not hasattr(pool, "v_buffers")
        outs = ap.generate(eng, ids[:2], 2)
        assert all(len(o["output_ids"]) == 2 for o in outs)
        eng.wait_idle()
        eng.check_integrity()
    finally:
        eng.shutdown()


def test_rotate_half_rope_matches_hf(tmp_path):
    """V3 with rope_interleave false rotates (x_i, x_{i + d/2}) instead of adjacent pairs."""
    cfg = CASES["v3"][1]()
    cfg.rope_interleave = False
    model = ap.save_tiny(tf.DeepseekV3ForCausalLM, cfg, tmp_path)
    eng = ap.make_engine(str(tmp_path))
    try:
        ap.check_prompt_logprobs(eng, model, prompts()[1:3])
    finally:
        eng.shutdown()


def test_mtp_layer_is_skipped_and_a_missing_tensor_is_reported(case):
    """V3 checkpoints carry the multi-token-prediction layer as layer num_hidden_layers: its
    tensors (experts included) are skipped; stacked expert names load the same weights; a
    missing tensor is named."""
    from radixlm.runtime.config import ModelConfig
    from radixlm.runtime.models import registry
    from radixlm.runtime.models.loader import iter_weights, load_hf_config

    name, path, model, _, _ = case
    cfg = ModelConfig.from_hf(load_hf_config(path))
    weights = list(iter_weights(path))
    n = cfg.num_layers
    last = [(w.replace(f"layers.{n - 1}.", f"layers.{n}."), t) for w, t in weights
            if f"layers.{n - 1}." in w]
    ours = registry.model_class(cfg, ap.CONTEXT)(cfg).float()
    ours.rope.reset("cpu")
    ours.load_weights(weights + last)
    torch.testing.assert_close(ours.layers[0].self_attn.kv_b_proj.weight,
                               model.model.layers[0].self_attn.kv_b_proj.weight)
    # HF 5's in-memory names (experts stacked: mlp.experts.gate_up_proj (E, 2I, H)) load alike
    stacked = registry.model_class(cfg, ap.CONTEXT)(cfg).float()
    stacked.load_weights(model.state_dict().items())
    for (na, pa), (nb, pb) in zip(ours.state_dict().items(), stacked.state_dict().items()):
        assert na == nb and torch.equal(pa, pb), na
    gone = [(w, t) for w, t in weights if "kv_a_layernorm" not in w]
    with pytest.raises(ValueError, match="lacks.*kv_a_layernorm"):
        registry.model_class(cfg, ap.CONTEXT)(cfg).float().load_weights(gone)


@pytest.mark.parametrize("kw,what", [(dict(attention_backend="cpu"), "attention_backend 'cpu'"),
                                     (dict(enable_hierarchical_cache=True), "hierarchical-cache")],
                         ids=["cpu-backend", "hicache"])
def test_engine_refuses_what_needs_kv_heads(case, kw, what):
    """Refused at start-up, before the weights load, naming the flag."""
    with pytest.raises(ValueError, match=what):
        ap.make_engine(case[1], **kw)
