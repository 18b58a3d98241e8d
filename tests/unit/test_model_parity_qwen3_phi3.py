"""Qwen3 and Phi-3 against HF transformers, fp32, on tiny random checkpoints from `save_pretrained`:
greedy tokens (CPU C++ and torch_native attention), prompt logprobs, radix cache on vs off, and
the configurations these models refuse."""

from __future__ import annotations

import pytest
import torch
import transformers as tf

import arch_parity as ap
from radixlm.runtime.config import ModelConfig
from radixlm.runtime.models import registry
from radixlm.runtime.models.phi3 import Phi3Rope, Phi3RotaryEmbedding

VOCAB = 256
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, bos_token_id=None, eos_token_id=None)
PHI3 = dict(COMMON, pad_token_id=0)
LONGROPE = {"type": "longrope", "short_factor": [1.0 + 0.3 * i for i in range(8)],
            "long_factor": [4.0 + 0.5 * i for i in range(8)]}
CASES = {
    # head_dim 24 != hidden / heads (Qwen3 reads head_dim from the config)
    "qwen3": (tf.Qwen3ForCausalLM, lambda: tf.Qwen3Config(**COMMON, head_dim=24,
                                                          max_position_embeddings=512)),
    # Phi-3-mini-128k / Phi-3.5 style: LongRoPE, factor 1024 / 256 -> cos/sin times 1.118
    "phi3-longrope": (tf.Phi3ForCausalLM, lambda: tf.Phi3Config(
        **PHI3, max_position_embeddings=1024, original_max_position_embeddings=ap.CONTEXT,
        rope_scaling=dict(LONGROPE))),
    # Phi-4-mini style: partial rotary, tied embeddings
    "phi3-partial": (tf.Phi3ForCausalLM, lambda: tf.Phi3Config(
        **PHI3, max_position_embeddings=512, partial_rotary_factor=0.5, tie_word_embeddings=True)),
}


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    """(name, checkpoint folder, HF model, prompts, HF greedy outputs)."""
    cls, config = CASES[request.param]
    case = ap.make_case(request.param, cls, config(), tmp_path_factory, VOCAB)
    return case


@pytest.mark.parametrize("backend", ["auto", "torch_native"])
def test_greedy_and_prompt_logprobs_match_hf(case, backend):
    def checks(eng):
        assert type(eng.runner.model).__name__ == case[2].config.architectures[0]
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


# ------------------------------------------------------------------------------------- rotary

def test_phi3_tables_match_hf_from_a_legacy_config():
    """Pre-5 config.json style (rope_scaling, top-level rope_theta / partial_rotary_factor /
    original_max_position_embeddings, explicit factor): our tables equal HF's cos/sin."""
    d = dict(PHI3, architectures=["Phi3ForCausalLM"], model_type="phi3", num_attention_heads=2,
             rope_theta=5000.0, partial_rotary_factor=0.75, max_position_embeddings=2048,
             original_max_position_embeddings=128,
             rope_scaling={"type": "longrope", "factor": 6.0, "short_factor": [1.5] * 12,
                           "long_factor": [3.0] * 12})
    hf_rope = tf.models.phi3.modeling_phi3.Phi3RotaryEmbedding(tf.Phi3Config(**d))
    pos = torch.arange(128)[None]
    cos, sin = hf_rope(torch.zeros(1, dtype=torch.float32), pos)
    rope = Phi3Rope.from_config(ModelConfig.from_hf(d))
    assert (rope.rotary_dim, rope.original_max, rope.theta) == (24, 128, 5000.0)
    ours = Phi3RotaryEmbedding(rope, 128)
    # HF multiplies position * inv_freq in fp32 (angles up to ~85 rad: ulp ~8e-6), we in fp64
    torch.testing.assert_close(ours.cos, cos[0], atol=2e-5, rtol=0)
    torch.testing.assert_close(ours.sin, sin[0], atol=2e-5, rtol=0)
    assert hf_rope.attention_scaling == pytest.approx(rope.attention_factor) != 1.0


# ---------------------------------------------------------------------------------- refusals

def _cfg(arch: str, **extra) -> ModelConfig:
    kinds = {"Qwen3ForCausalLM": "qwen3", "Phi3ForCausalLM": "phi3"}
    return ModelConfig.from_hf({**COMMON, "architectures": [arch], "model_type": kinds[arch],
                                "max_position_embeddings": 1024, **extra})


@pytest.mark.parametrize("arch,extra,ctx,match", [
    ("Qwen3ForCausalLM", dict(use_sliding_window=False, sliding_window=64,
                              layer_types=["full_attention", "sliding_attention"]),
     256, "no sliding_window applies"),
    ("Qwen3ForCausalLM", dict(layer_types=["full_attention", "chunked_attention"]), 256,
     "layer_types"),
    ("Qwen3ForCausalLM", dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), 256,
     "rope_type='yarn'"),
    ("Qwen3ForCausalLM", dict(hidden_act="gelu"), 256, "hidden_act='gelu'"),
    ("Phi3ForCausalLM", dict(rope_scaling=LONGROPE, original_max_position_embeddings=256), 257,
     "original_max_position_embeddings=256"),
    ("Phi3ForCausalLM", dict(rope_scaling={**LONGROPE, "short_factor": [1.0] * 3},
                             original_max_position_embeddings=256), 256, "short_factor has 3"),
    ("Phi3ForCausalLM", dict(partial_rotary_factor=0.2), 256, "partial_rotary_factor"),
    ("Phi3ForCausalLM", dict(rope_scaling={"type": "dynamic", "factor": 2.0}), 256,
     "rope_type='dynamic'"),
])
def test_refused_configs_name_the_field(arch, extra, ctx, match):
    with pytest.raises(ValueError, match=match):
        registry.model_class(_cfg(arch, **extra), ctx)


@pytest.mark.parametrize("arch,extra,ctx", [
    # Qwen3's window exists but every layer is below max_window_layers: full attention in HF
    ("Qwen3ForCausalLM", dict(use_sliding_window=True, sliding_window=64, max_window_layers=2),
     256),
    ("Qwen3ForCausalLM", dict(use_sliding_window=False, sliding_window=64), 256),
    ("Phi3ForCausalLM", dict(rope_scaling=LONGROPE, original_max_position_embeddings=256), 256),
    ("Phi3ForCausalLM", dict(sliding_window=2047), 4096),
])
def test_accepted_configs(arch, extra, ctx):
    assert registry.model_class(_cfg(arch, **extra), ctx).__name__ == arch


@pytest.mark.parametrize("arch,extra,windows", [
    ("Qwen3ForCausalLM", dict(use_sliding_window=True, sliding_window=64, max_window_layers=1),
     (None, 64)),
    ("Qwen3ForCausalLM", dict(use_sliding_window=True, sliding_window=64, max_window_layers=2), ()),
    ("Qwen3ForCausalLM", dict(sliding_window=64), ()),  # no use_sliding_window: HF drops it
    # no sliding_window in config.json: Qwen3Config's default 4096
    ("Qwen3ForCausalLM", dict(use_sliding_window=True, max_window_layers=0), (4096, 4096)),
    ("Qwen3ForCausalLM", dict(use_sliding_window=True, sliding_window=64,
                              layer_types=["sliding_attention", "full_attention"]), (64, None)),
    ("Phi3ForCausalLM", dict(sliding_window=2047), (2047, 2047)),
    ("Phi3ForCausalLM", dict(sliding_window=None), ()),
])
def test_attention_spec_windows(arch, extra, windows):
    cfg = _cfg(arch, **extra)
    spec = registry.model_class(cfg, 4096).attention_spec(cfg)
    assert spec.windows == windows and spec.scale == cfg.head_dim ** -0.5


def test_engine_refuses_longrope_past_the_original_context(tmp_path):
    config = CASES["phi3-longrope"][1]()
    config.architectures = ["Phi3ForCausalLM"]
    config.save_pretrained(tmp_path)  # config.json only: dummy weights
    with pytest.raises(ValueError, match="original_max_position_embeddings=256"):
        ap.make_engine(str(tmp_path), load_format="dummy", context_length=ap.CONTEXT + 1)
