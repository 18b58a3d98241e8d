"""benchmarks/mla_gpu.py's arithmetic against the model radixlm builds from the same config (on the
meta device: no memory): the roofline's attention bytes are the model's attention parameters,
its expert bytes per token are top-k of the model's per-expert tensors plus the shared experts,
and DeepSeek-V2-Lite's latent KV is at most 1/6 of its expanded K/V."""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from benchmarks.mla_gpu import TINY, V2_LITE, decode_bytes, kv_bytes  # noqa: E402
from radixlm.runtime.config import ModelConfig  # noqa: E402
from radixlm.runtime.models import registry  # noqa: E402


def _meta_model(cfg: dict):
    mc = ModelConfig.from_hf(cfg)
    with torch.device("meta"):
        return registry.model_class(mc, 4096)(mc)


def _bytes(model, pred) -> int:
    return sum(p.numel() * 2 for n, p in model.named_parameters() if pred(n))


def test_decode_bytes_follow_the_model():
    for cfg in (V2_LITE, TINY):
        m = _meta_model(cfg)
        d = decode_bytes(cfg, context=100)
        attn = _bytes(m, lambda n: "self_attn" in n or "layernorm" in n)
        assert d["attention_weights"] == attn
        routed = _bytes(m, lambda n: ".experts." in n)  # all experts of all MoE layers
        assert d["routed_experts"] * cfg["n_routed_experts"] == routed * cfg["num_experts_per_tok"]
        assert d["shared_experts"] == _bytes(m, lambda n: "shared_experts" in n)
        assert d["dense_mlp"] == _bytes(m, lambda n: ".mlp." in n and "layers.0." in n)
        assert d["router_fp32"] == 2 * _bytes(m, lambda n: n.endswith("mlp.gate.weight"))
        assert d["latent_kv"] == 100 * kv_bytes(cfg)[0]
        assert d["total"] == sum(v for k, v in d.items() if k != "total")


def test_v2_lite_latent_is_at_most_a_sixth_of_expanded_kv():
    latent, expanded = kv_bytes(V2_LITE)
    assert (latent, expanded) == (27 * 576 * 2, 27 * 16 * 320 * 2)
    assert latent * 6 <= expanded
