"""MLA attention over the latent pool (attention/mla_backend.py) against attention on explicitly
expanded K/V: the absorbed and the expanded extend forms, torch decode, the Triton decode kernel
(interpreted on the CPU); DeepSeek's routers and YaRN tables against HF's modules; the
refusals of what cannot run on a latent pool."""

from __future__ import annotations

import pytest
import torch

from triton_interpreter import import_interpreted  # tests/unit is on sys.path

(triton_mla_decode,) = import_interpreted("radixlm.runtime.attention.triton_mla_decode",
                                          gpu_tests="tests/gpu/test_gpu_mla.py")
from radixlm.runtime.attention.mla_backend import MLAAttention, check_mla_args  # noqa: E402
from radixlm.runtime.config import ModelConfig, ServerArgs  # noqa: E402
from radixlm.runtime.executor.forward_batch import ForwardBatch, ForwardMode  # noqa: E402
from radixlm.runtime.mem_cache.kv_pool import MLAKVPool  # noqa: E402

H, DN, DR, DV, R = 4, 16, 8, 12, 32
SCALE = 0.3


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _setup(lens, seed=0):
    """A pool with random latents for requests of `lens` tokens (pool row 2i+1 for request i,
    slots shuffled), the per-head up-projections, and the backend."""
    g = torch.Generator().manual_seed(seed)
    cap = sum(lens) + 8
    pool = MLAKVPool(cap, 1, R, DR, torch.float32, "cpu")
    pool.latent_buffers[0].copy_(torch.randn(cap + 1, 1, R + DR, generator=g))
    rt = torch.zeros(2 * len(lens) + 2, 128, dtype=torch.int64)
    slots = (torch.randperm(cap, generator=g) + 1).tolist()
    for i, n in enumerate(lens):
        rt[2 * i + 1, :n] = torch.tensor(slots[:n])
        slots = slots[n:]
    w_uk, w_uv = torch.randn(H, DN, R, generator=g) * 0.2, torch.randn(H, DV, R, generator=g) * 0.2
    return pool, rt, w_uk, w_uv, MLAAttention(pool, rt, SCALE, max_context_len=128), g


def _reference(q_nope, q_pe, lat, w_uk, w_uv, n_keys):
    """Row i attends to lat[:n_keys[i]] with K/V expanded per head. -> (T, H, DV)."""
    c, pe = lat[:, :R], lat[:, R:]
    k = torch.cat((torch.einsum("sr,hdr->hsd", c, w_uk), pe.expand(H, -1, -1)), -1)
    v = torch.einsum("sr,hvr->hsv", c, w_uv)
    q = torch.cat((q_nope, q_pe), -1)  # (T, H, DN + DR)
    out = []
    for i, n in enumerate(n_keys):
        s = torch.einsum("hd,hsd->hs", q[i], k[:, :n]) * SCALE
        out.append(torch.einsum("hs,hsv->hv", s.softmax(-1), v[:, :n]))
    return torch.stack(out)


def _extend_batch(backend, rt, prefix, ext):
    fb = ForwardBatch(mode=ForwardMode.EXTEND, input_ids=torch.zeros(ext, dtype=torch.long),
                      positions=torch.arange(prefix, prefix + ext),
                      out_cache_loc=rt[1, prefix : prefix + ext].clone(),
                      req_pool_indices=torch.tensor([1]), seq_lens=torch.tensor([prefix + ext]),
                      logits_indices=torch.tensor([ext - 1]), seq_lens_cpu=[prefix + ext],
                      extend_prefix_lens_cpu=[prefix], extend_lens_cpu=[ext])
    backend.init_forward_metadata(fb)
    return fb


@pytest.mark.parametrize("absorbed", [True, False], ids=["absorbed", "expanded"])
@pytest.mark.parametrize("prefix,ext", [(0, 9), (20, 5)])
def test_extend_forms_match_expanded_reference(monkeypatch, absorbed, prefix, ext):
    pool, rt, w_uk, w_uv, backend, g = _setup([prefix + ext])
    monkeypatch.setattr(MLAAttention, "_absorb_extend", lambda self, *a: absorbed)
    fb = _extend_batch(backend, rt, prefix, ext)
    new_lat = torch.randn(ext, R + DR, generator=g)
    q_nope, q_pe = torch.randn(ext, H, DN, generator=g), torch.randn(ext, H, DR, generator=g)
    out = backend.forward_mla(q_nope, q_pe, new_lat, 0, fb, w_uk, w_uv)
    lat = pool.latent_buffers[0][rt[1, : prefix + ext], 0]
    torch.testing.assert_close(lat[prefix:], new_lat)  # the new latents were stored in place
    ref = _reference(q_nope, q_pe, lat, w_uk, w_uv, range(prefix + 1, prefix + ext + 1))
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_extend_form_choice_follows_the_cost():
    backend = _setup([4])[4]
    assert not backend._absorb_extend(100, 100, DN, DV)  # a fresh prompt: expanded
    assert backend._absorb_extend(2, 100, DN, DV)  # a few tokens after a long prefix: absorbed
    # DeepSeek-V3's dims: absorbed below ~170 new tokens per request
    backend.r, backend.kv_pool.rope_dim = 512, 64
    assert backend._absorb_extend(150, 4000, 128, 128)
    assert not backend._absorb_extend(200, 4000, 128, 128)


@pytest.mark.parametrize("kernel", ["torch", "triton"])
def test_decode_matches_expanded_reference(kernel):
    lens = [1, 37, 70]
    pool, rt, w_uk, w_uv, backend, g = _setup(lens, seed=1)
    backend.decode_kernel = kernel
    b = len(lens)
    fb = ForwardBatch(mode=ForwardMode.DECODE, input_ids=torch.zeros(b, dtype=torch.long),
                      positions=torch.tensor(lens) - 1,
                      out_cache_loc=torch.stack([rt[2 * i + 1, n - 1] for i, n in enumerate(lens)]),
                      req_pool_indices=torch.tensor([1, 3, 5]), seq_lens=torch.tensor(lens),
                      logits_indices=torch.arange(b), seq_lens_cpu=lens)
    backend.init_forward_metadata(fb)
    new_lat = torch.randn(b, R + DR, generator=g)
    q_nope, q_pe = torch.randn(b, H, DN, generator=g), torch.randn(b, H, DR, generator=g)
    out = backend.forward_mla(q_nope, q_pe, new_lat, 0, fb, w_uk, w_uv)
    for i, n in enumerate(lens):
        lat = pool.latent_buffers[0][rt[2 * i + 1, :n], 0]
        ref = _reference(q_nope[i : i + 1], q_pe[i : i + 1], lat, w_uk, w_uv, [n])
        torch.testing.assert_close(out[i : i + 1], ref, atol=1e-5, rtol=1e-5)


def test_router_matches_hf():
    """V2 group-limited greedy and V3's bias-corrected grouped sigmoid routing: the same experts
    and weights as HF's router modules on random tokens."""
    import transformers as tf
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    from radixlm.runtime.models.deepseek_moe import Router

    common = dict(hidden_size=32, n_routed_experts=16, num_experts_per_tok=4, n_group=4,
                  topk_group=2, routed_scaling_factor=2.5)
    for hf_cfg, hf_cls, sigmoid in [
            (tf.DeepseekV2Config(**common, topk_method="group_limited_greedy"),
             DeepseekV2TopkRouter, False),
            (tf.DeepseekV3Config(**common, norm_topk_prob=True), DeepseekV3TopkRouter, True)]:
        torch.manual_seed(0)
        ref = hf_cls(hf_cfg)
        ref.weight.data.normal_()
        ours = Router(ModelConfig.from_hf({**hf_cfg.to_dict(), "intermediate_size": 64,
                                            "num_hidden_layers": 1, "vocab_size": 8}), sigmoid)
        ours.weight.data.copy_(ref.weight)
        if sigmoid:
            ref.e_score_correction_bias.uniform_(-0.5, 0.5)
            ours.e_score_correction_bias.copy_(ref.e_score_correction_bias)
        x = torch.randn(50, 32)
        ids, w = ours(x)
        _, ref_w, ref_ids = ref(x)
        ids, order = ids.sort(-1)
        ref_ids, ref_order = ref_ids.sort(-1)
        assert torch.equal(ids, ref_ids)
        torch.testing.assert_close(w.gather(1, order), ref_w.gather(1, ref_order))


def test_yarn_tables_match_hf():
    import transformers as tf
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding

    from radixlm.runtime.models.deepseek_rope import DeepseekRope, softmax_scale

    yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "beta_fast": 32,
            "beta_slow": 1, "original_max_position_embeddings": 4096, "mscale": 0.707,
            "mscale_all_dim": 1.0}
    hf_cfg = tf.DeepseekV3Config(hidden_size=64, num_attention_heads=4, qk_rope_head_dim=64,
                                 max_position_embeddings=8192, rope_parameters=yarn)
    cfg = ModelConfig.from_hf(hf_cfg.to_dict())
    ours = DeepseekRope(cfg)
    ours.reset("cpu")
    pos = torch.tensor([[0, 1, 100, 4095, 8000]])
    cos, sin = DeepseekV3RotaryEmbedding(hf_cfg)(torch.zeros(1), pos)
    c, s = ours(pos[0])
    torch.testing.assert_close(c[:, 0], cos[0, :, :32])
    torch.testing.assert_close(s[:, 0], sin[0, :, :32])
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention
    assert softmax_scale(cfg) == pytest.approx(DeepseekV3Attention(hf_cfg, 0).scaling)


def test_features_without_latent_support_are_refused():
    for kw, what in [(dict(attention_backend="cpu"), "attention_backend 'cpu'"),
                     (dict(enable_hierarchical_cache=True), "hierarchical-cache"),
                     (dict(speculative_algorithm="NGRAM"), "speculative"),
                     (dict(disaggregation_mode="decode"), "disaggregation-mode")]:
        with pytest.raises(ValueError, match=what):
            check_mla_args(ServerArgs(**kw))
    with pytest.raises(ValueError, match="FP8"):
        check_mla_args(ServerArgs(), fp8_checkpoint=True)
    with pytest.raises(ValueError, match="int4"):
        check_mla_args(ServerArgs(), int4_checkpoint=True)
    check_mla_args(ServerArgs())  # the defaults run
    backend = _setup([3])[4]
    with pytest.raises(TypeError, match="forward_mla"):
        backend.forward(None, None, None, 0, None)
    with pytest.raises(ValueError, match="sliding windows"):
        MLAAttention(backend.kv_pool, backend.req_to_token, SCALE, windows=[8])


def test_configs_without_a_reference_are_refused():
    from radixlm.runtime.distributed.sharding import check_tp_supported
    from radixlm.runtime.models import registry

    base = dict(architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2", vocab_size=64,
                hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
                n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
    ok = ModelConfig.from_hf(base)
    registry.model_class(ok, 256)
    for extra, what in [(dict(norm_topk_prob=True), "norm_topk_prob"),
                        (dict(rope_scaling={"type": "linear", "factor": 2.0}), "rope_type"),
                        (dict(topk_method="noaux_tc"), "topk_method"),
                        (dict(hidden_act="gelu"), "hidden_act"),
                        (dict(mlp_bias=True), "mlp_bias"),
                        (dict(topk_method="group_limited_greedy"), "n_group")]:
        with pytest.raises(ValueError, match=what):
            registry.model_class(ModelConfig.from_hf({**base, **extra}), 256)
    v3 = {**base, "architectures": ["DeepseekV3ForCausalLM"], "n_group": 2, "topk_group": 1,
          "topk_method": "greedy"}
    with pytest.raises(ValueError, match="noaux_tc"):
        registry.model_class(ModelConfig.from_hf(v3), 256)
    with pytest.raises(ValueError, match="no TP sharding"):
        check_tp_supported(ok, 2, "DeepseekV2ForCausalLM")


def test_dense_layers_and_config_defaults():
    """Layer i is MoE when i >= first_k_dense_replace and i % moe_layer_freq == 0 (DeepSeek's
    rule); a field config.json omits takes HF's default for the architecture."""
    from radixlm.runtime.models.deepseek import is_moe_layer
    from radixlm.runtime.models.deepseek_config import fields

    base = dict(architectures=["DeepseekV3ForCausalLM"], vocab_size=64, hidden_size=32,
                intermediate_size=64, num_hidden_layers=6, num_attention_heads=4)
    v3 = ModelConfig.from_hf(base)
    assert [is_moe_layer(v3, i) for i in range(6)] == [False] * 3 + [True] * 3
    f = fields(v3)
    assert (f["routed_scaling_factor"], f["q_lora_rank"], f["n_group"], f["norm_topk_prob"]) == (
        2.5, 1536, 8, True)
    v2 = ModelConfig.from_hf({**base, "architectures": ["DeepseekV2ForCausalLM"],
                              "first_k_dense_replace": 1, "moe_layer_freq": 2,
                              "q_lora_rank": None})
    assert [is_moe_layer(v2, i) for i in range(6)] == [False, False, True, False, True, False]
    assert fields(v2)["q_lora_rank"] is None and fields(v2)["routed_scaling_factor"] == 1.0


def test_mixed_step_decode_tail_triton_equals_torch():
    """An extend step with decode requests mixed in (num_decode_tail): the triton decode's
    metadata for the tail (device views of the tail's rows) gives the torch decode's output."""
    lens = [14, 7, 30]  # request 0 extends 4 tokens after a 10-token prefix; 1 and 2 decode
    outs = []
    for kernel in ("torch", "triton"):
        pool, rt, w_uk, w_uv, backend, g = _setup(lens, seed=4)
        backend.decode_kernel = kernel
        backend.supports_cuda_graph = kernel == "triton"
        loc = torch.cat((rt[1, 10:14], rt[3, 6:7], rt[5, 29:30]))
        fb = ForwardBatch(mode=ForwardMode.EXTEND, input_ids=torch.zeros(6, dtype=torch.long),
                          positions=torch.tensor([10, 11, 12, 13, 6, 29]), out_cache_loc=loc,
                          req_pool_indices=torch.tensor([1, 3, 5]),
                          seq_lens=torch.tensor(lens), logits_indices=torch.tensor([3, 4, 5]),
                          seq_lens_cpu=lens, extend_prefix_lens_cpu=[10, 6, 29],
                          extend_lens_cpu=[4, 1, 1], num_decode_tail=2)
        backend.init_forward_metadata(fb)
        new_lat = torch.randn(6, R + DR, generator=g)
        q_nope, q_pe = torch.randn(6, H, DN, generator=g), torch.randn(6, H, DR, generator=g)
        outs.append(backend.forward_mla(q_nope, q_pe, new_lat, 0, fb, w_uk, w_uv))
    torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)
    assert outs[0][-2:].abs().sum() > 0
