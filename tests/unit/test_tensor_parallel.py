"""Tensor parallelism on the CPU (gloo): TP=2 ranks in spawned processes against TP=1, fp32.

Each case runs tp_harness's fixed batches (EXTEND, EXTEND with a cached prefix and a decode tail,
two DECODEs; each step's inputs are the previous step's argmax) and compares rank 0's and rank
1's logits with the TP=1 runner's: greedy tokens identical, logits within 1e-4 absolute (the
row-parallel all-reduce and split GEMMs sum the same products in another order; measured max
|diff| is printed). The TP=2 side of every case runs on one pair of spawned ranks (`tp_runs`),
one case after another: a rank's start costs ~2.5 CPU-s, and five pairs cost ~20 CPU-s more."""

from __future__ import annotations

import pytest
import torch

import tp_harness as th
from radixlm.runtime.config import ModelConfig
from radixlm.runtime.distributed import sharding
from radixlm.runtime.models import loader

ATOL = 1e-4


@pytest.fixture(autouse=True, scope="module")
def _dense_gguf():
    """TP splits dense weights only (a GGUF model keeps its quantized blocks at tp_size=1 when
    the quantized CPU GEMM is available): both sides of every comparison run dense."""
    with pytest.MonkeyPatch.context() as mp_:
        mp_.setenv("RADIXLM_GGUF_KEEP_QUANTIZED", "off")
        yield


def _compare(ref: list[torch.Tensor], ranks: list[dict]) -> float:
    worst = 0.0
    for res in ranks:
        assert len(res["logits"]) == len(ref)
        for step, (want, got) in enumerate(zip(ref, res["logits"])):
            assert got.shape == want.shape, step
            assert torch.equal(got.argmax(-1), want.argmax(-1)), f"step {step}: greedy tokens differ"
            worst = max(worst, (got - want).abs().max().item())
    assert worst < ATOL, worst
    print(f"max |logit diff| TP vs TP=1: {worst:.3g}")
    return worst


TINY_GQA = {  # (kv_heads, tied, bias, vocab)
    # KV heads split 1 per rank; untied head; o_proj bias; odd vocab (padded)
    "kv2": (2, False, True, 251),
    "kv1": (1, True, False, 256),  # 1 KV head < 2 ranks: replicated; tied head
}
FAMILIES = ("qwen3", "phi3")


@pytest.fixture(scope="module")
def tp_runs(tmp_path_factory):
    """{case: (model path, vocab, every TP=2 rank's results)} for every case of this module."""
    root = tmp_path_factory.mktemp("tp")
    cases = {}
    for name, (kv_heads, tied, bias, vocab) in TINY_GQA.items():
        cases[name] = (th.write_tiny_llama(str(root / name), vocab=vocab, heads=4,
                                           kv_heads=kv_heads, tied=tied, bias=bias), vocab)
    for arch in FAMILIES:
        cases[arch] = (th.write_tiny_llama(str(root / arch), vocab=128, heads=4, kv_heads=2,
                                           tied=False, arch=arch), 128)
    smol = loader.default_model_path()
    cases["smollm2"] = (smol, ModelConfig.from_hf(loader.load_hf_config(smol)).vocab_size)
    runs = th.run_tp_cases(2, [({"model_path": p}, v) for p, v in cases.values()], str(root))
    return {name: (p, v, ranks) for (name, (p, v)), ranks in zip(cases.items(), runs)}


@pytest.mark.parametrize("case", list(TINY_GQA))
def test_tp2_matches_tp1_tiny_gqa(tp_runs, case):
    path, vocab, ranks = tp_runs[case]
    ref = th.run_fixed_batches(th.make_runner({"model_path": path}), vocab)
    assert [r["kv_heads"] for r in ranks] == [1, 1]
    _compare(ref, ranks)


@pytest.mark.parametrize("arch", FAMILIES)
def test_tp2_matches_tp1_other_families(tp_runs, arch):
    """Qwen3 (per-head q/k norms) and Phi-3 (partial rotary, sliding window, fused checkpoint)."""
    path, vocab, ranks = tp_runs[arch]
    _compare(th.run_fixed_batches(th.make_runner({"model_path": path}), vocab), ranks)


def test_tp2_matches_tp1_smollm2(tp_runs):
    """The bundled SmolLM2-135M (9 q heads, 3 KV heads): whole GQA groups per rank, 2 and 1."""
    path, vocab, ranks = tp_runs["smollm2"]
    runner = th.make_runner({"model_path": path})
    assert vocab == runner.model_config.vocab_size  # the ranks' batches drew from this vocabulary
    ref = th.run_fixed_batches(runner, vocab)
    del runner
    assert [r["kv_heads"] for r in ranks] == [2, 1]
    _compare(ref, ranks)


def test_tp_refusals():
    base = dict(architecture="LlamaForCausalLM", vocab_size=10, hidden_size=64,
                intermediate_size=96, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16,
                rms_norm_eps=1e-5, rope_theta=1e4, max_position_embeddings=64,
                tie_word_embeddings=True)
    with pytest.raises(ValueError, match="no TP sharding"):
        sharding.check_tp_supported(ModelConfig(**base), 2, "Gemma2ForCausalLM")
    with pytest.raises(ValueError, match="replicated"):
        sharding.check_tp_supported(ModelConfig(**{**base, "num_heads": 6, "num_kv_heads": 2}), 4)
    with pytest.raises(ValueError, match="intermediate_size"):
        sharding.check_tp_supported(ModelConfig(**{**base, "intermediate_size": 95}), 2)
    with pytest.raises(ValueError, match="init_distributed"):
        th.make_runner({"load_format": "dummy", "tp_size": 2})
