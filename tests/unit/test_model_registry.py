"""Architecture lookup and the refusal of configurations a model class cannot run exactly."""

from __future__ import annotations

import pytest

from radixlm.runtime.config import ModelConfig
from radixlm.runtime.models import registry


def _cfg(**extra) -> ModelConfig:
    base = {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "vocab_size": 64,
            "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256}
    return ModelConfig.from_hf({**base, **extra})


def test_unknown_architecture_is_refused_naming_the_supported_ones():
    with pytest.raises(ValueError, match="'GPT2LMHeadModel' is not supported.*LlamaForCausalLM"):
        registry.model_class(_cfg(architectures=["GPT2LMHeadModel"]), 256)


def test_config_keeps_the_hf_dict_out_of_equality():
    a, b = _cfg(sliding_window=16), _cfg(sliding_window=32)
    assert a == b and a.hf["sliding_window"] == 16 and hash(a) == hash(b)


def _spec(**extra):
    cfg = _cfg(**extra)
    return registry.model_class(cfg, 256).attention_spec(cfg)


def test_qwen2_window_counts_only_with_use_sliding_window():
    qwen = dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", sliding_window=16,
                max_window_layers=0)
    assert _spec(**qwen).windows == ()
    assert _spec(**qwen, use_sliding_window=True).windows == (16, 16)


def test_mistral_window_runs_on_every_layer():
    assert _spec(sliding_window=16).windows == (16, 16)
    assert _spec(sliding_window=None).windows == ()
    # config.json without the field: MistralConfig's default window (4096) applies
    cfg = ModelConfig.from_hf({k: v for k, v in _cfg().hf.items() if k != "sliding_window"})
    assert registry.model_class(cfg, 8192).attention_spec(cfg).windows == (4096, 4096)
    # LlamaModel ignores a sliding_window field
    assert _spec(architectures=["LlamaForCausalLM"], model_type="llama",
                 sliding_window=16).windows == ()


def test_qwen2_windows_follow_layer_types_or_max_window_layers():
    qwen = dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", sliding_window=16,
                num_hidden_layers=3)
    assert _spec(**qwen).windows == ()  # use_sliding_window false
    # a config from before transformers 5: no layer_types, layers >= max_window_layers
    assert _spec(**qwen, use_sliding_window=True, max_window_layers=1).windows == (None, 16, 16)
    assert _spec(**qwen, use_sliding_window=True, max_window_layers=1,
                 layer_types=["sliding_attention", "full_attention", "full_attention"]
                 ).windows == (16, None, None)


@pytest.mark.parametrize("extra, match", [
    (dict(layer_types=["chunked_attention", "full_attention"]), "layer_types"),
    (dict(layer_types=["full_attention"]), "layer_types"),  # one per layer
    # HF refuses to build the sliding mask without a window
    (dict(layer_types=["sliding_attention", "full_attention"]), "no sliding_window applies"),
])
def test_qwen2_layer_types_it_cannot_run_are_refused(extra, match):
    cfg = _cfg(architectures=["Qwen2ForCausalLM"], model_type="qwen2", sliding_window=16,
               **extra)
    with pytest.raises(ValueError, match=match):
        registry.model_class(cfg, 256)
