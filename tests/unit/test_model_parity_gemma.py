"""Gemma 2 and Gemma 3 (text) against HF transformers 5.23 in fp32 on tiny `save_pretrained`
checkpoints: greedy tokens (C++ CPU and torch_native attention) and prompt logprobs, radix cache on
= off and chunked prefill = unchunked, with sliding layers interleaved with global ones, a window
far shorter than the prompts, query_pre_attn_scalar != head_dim, attention and final logit
soft-caps (Gemma 2), q/k norms and a separate local rope theta (Gemma 3); each of those features
changes HF's output here, so the parity pins it. Plus legacy config fields and the refusals."""

from __future__ import annotations

import pytest
import torch
import transformers as tf

import arch_parity as ap
from radixlm.runtime.config import ModelConfig
from radixlm.runtime.models import gemma, registry

VOCAB = 256
WINDOW = 8
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24,
              max_position_embeddings=512, sliding_window=WINDOW, bos_token_id=None,
              eos_token_id=None, pad_token_id=0)
CASES = {
    "gemma2": (tf.Gemma2ForCausalLM, lambda **kw: tf.Gemma2Config(**{
        **COMMON, "attn_logit_softcapping": 3.0, "final_logit_softcapping": 8.0, **kw})),
    # every second layer global; the global layers' rope theta 1e6, the local ones' 1e4
    "gemma3": (tf.Gemma3ForCausalLM, lambda **kw: tf.Gemma3TextConfig(**{
        **COMMON, "sliding_window_pattern": 2, "final_logit_softcapping": 8.0, **kw})),
}
# config changes that must each change HF's logprobs (else the parity could not see them)
ABLATIONS = {
    "gemma2": [dict(attn_logit_softcapping=None), dict(final_logit_softcapping=None),
               dict(sliding_window=WINDOW + 1), dict(query_pre_attn_scalar=16)],
    "gemma3": [dict(sliding_window=WINDOW - 1), dict(query_pre_attn_scalar=16),
               dict(final_logit_softcapping=None),
               dict(rope_parameters={"full_attention": {"rope_type": "default",
                                                        "rope_theta": 1e4},
                                     "sliding_attention": {"rope_type": "default",
                                                           "rope_theta": 1e4}})],
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
        spec = eng.runner.attention_spec
        assert spec.scale == 24 ** -0.5 and spec.windows == (WINDOW, None, WINDOW, None)
        assert spec.logit_softcap == (3.0 if name == "gemma2" else None)
    ap.check_engine_matches_hf(case, backend, checks)


@pytest.mark.parametrize("variant", ap.VARIANTS, ids=ap.VARIANT_IDS)
def test_radix_off_and_chunked_prefill_agree(case, variant):
    ap.check_variant_matches_hf(case, **variant)


def test_each_feature_changes_hf_output(case):
    name, path, model, prompts, _ = case
    cls, config = CASES[name]
    ids = torch.tensor([prompts[4]])  # 97 tokens
    with torch.no_grad():
        base = torch.log_softmax(model(ids).logits[0].float(), -1)
        for change in ABLATIONS[name]:
            other = cls(config(**change)).float().eval()
            other.load_state_dict(model.state_dict())
            diff = (torch.log_softmax(other(ids).logits[0].float(), -1) - base).abs().max()
            assert diff > 1e-2, (change, float(diff))


def _legacy(model_type: str, **kw) -> dict:
    arch = {"gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM"}[model_type]
    d = {k: v for k, v in COMMON.items() if k != "sliding_window"}
    return {**d, "num_hidden_layers": 7, "sliding_window": WINDOW, "model_type": model_type,
            "architectures": [arch], **kw}


@pytest.mark.parametrize("hf_cls, legacy", [
    (tf.Gemma3TextConfig, _legacy("gemma3_text", rope_theta=5e5, rope_local_base_freq=2e4,
                                  sliding_window_pattern=3)),
    (tf.Gemma3TextConfig, _legacy("gemma3_text", rope_theta=5e5, sliding_window_pattern=3,
                                  rope_scaling={"rope_type": "linear", "factor": 8.0})),
    (tf.Gemma3TextConfig, _legacy("gemma3_text")),
    (tf.Gemma2Config, _legacy("gemma2", rope_theta=2e4)),
])
def test_legacy_config_fields_read_as_hf_reads_them(hf_cls, legacy):
    """Hub configs from before transformers 5 (rope_theta / rope_local_base_freq / rope_scaling /
    sliding_window_pattern, no layer_types): the layer types and rope parameters HF derives."""
    hf = hf_cls(**{k: v for k, v in legacy.items() if k not in ("model_type", "architectures")})
    cfg = ModelConfig.from_hf(legacy)
    assert gemma.layer_types(cfg) == hf.layer_types
    full, local = gemma.rope_params(cfg)
    hf_rope = hf.rope_parameters
    if legacy["model_type"] == "gemma2":
        hf_rope = {"full_attention": hf_rope, "sliding_attention": hf_rope}
    for (theta, scaling), kind in ((full, "full_attention"), (local, "sliding_attention")):
        assert theta == hf_rope[kind]["rope_theta"]
        hf_type = hf_rope[kind]["rope_type"]
        assert (scaling or {}).get("rope_type", "default") == hf_type
        if scaling:
            assert scaling["factor"] == hf_rope[kind]["factor"]


@pytest.mark.parametrize("extra, match", [
    (dict(use_bidirectional_attention=True), "use_bidirectional_attention"),
    (dict(hidden_activation="gelu"), "hidden_activation='gelu'"),
    (dict(rope_parameters={"full_attention": {"rope_type": "yarn", "rope_theta": 1e6,
                                              "factor": 4.0},
                           "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
     "rope_type 'yarn'"),
    (dict(layer_types=["sliding_attention", "chunked_attention"] * 2), "layer_types"),
])
def test_refused_configs(extra, match):
    cfg = ModelConfig.from_hf({**_legacy("gemma3_text"), "num_hidden_layers": 4, **extra})
    with pytest.raises(ValueError, match=match):
        registry.model_class(cfg, 256)


@pytest.mark.parametrize("hf_cls, model_type", [(tf.Gemma2Config, "gemma2"),
                                                (tf.Gemma3TextConfig, "gemma3_text")])
def test_omitted_fields_take_hf_defaults(hf_cls, model_type):
    """Older hub configs omit fields whose HF default is not the generic one (tie_word_embeddings
    True, Gemma 2's soft-caps 50 / 30, query_pre_attn_scalar 256, window 4096)."""
    omit = ("query_pre_attn_scalar", "sliding_window", "tie_word_embeddings",
            "attn_logit_softcapping", "final_logit_softcapping")
    legacy = {k: v for k, v in _legacy(model_type).items() if k not in omit}
    legacy["head_dim"] = 256
    hf = hf_cls(**{k: v for k, v in legacy.items() if k not in ("model_type", "architectures")})
    cfg = ModelConfig.from_hf(legacy)
    cls = registry.model_class(cfg, 256)
    spec = cls.attention_spec(cfg)
    assert spec.scale == hf.query_pre_attn_scalar ** -0.5
    assert spec.windows[0] == hf.sliding_window == 4096
    assert spec.logit_softcap == (hf.attn_logit_softcapping if model_type == "gemma2" else None)
    with torch.device("meta"):
        model = cls(cfg)
    assert model.final_softcap == hf.final_logit_softcapping
    assert hf.tie_word_embeddings is True and model.lm_head is None
    # no head_dim, and HF's 256 is not hidden / heads: refused, not loaded with other shapes
    with pytest.raises(ValueError, match="no head_dim"):
        registry.model_class(ModelConfig.from_hf({k: v for k, v in legacy.items()
                                                  if k != "head_dim"}), 256)
