"""On a CUDA GPU, fp32: EAGLE3 (a random EAGLE-3 head) gives plain decoding's greedy tokens with
the triton backend, its verifies replay the target's decode CUDA graphs (which then also
write the captured layers), the head's chain steps replay the head's own graphs, and the KV
accounting holds. Once on a tiny Llama with a head
written to disk, once on the Llama-3.1-8B shape with `--load-format dummy` (config-only
folders; the head shaped as yuhuili/EAGLE3-LLaMA3.1-Instruct-8B: 32000-token draft
vocabulary). fp32 rather than bf16: the verify's rows run in another batch size than a plain
step, and bf16 rounding would flip near-tied argmaxes of random weights. Run with
`pytest -m gpu tests/gpu`."""

from __future__ import annotations

import json
import os

import pytest
import torch

pytestmark = pytest.mark.gpu

LLAMA_8B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256,
            "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
            "num_attention_heads": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-5,
            "rope_theta": 500000.0, "max_position_embeddings": 131072,
            "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 8192, "rope_type": "llama3"},
            "tie_word_embeddings": False, "bos_token_id": 128000, "eos_token_id": 128009}
HEAD_8B = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
           "vocab_size": 128256, "draft_vocab_size": 32000, "hidden_size": 4096,
           "intermediate_size": 14336, "num_hidden_layers": 1, "num_attention_heads": 32,
           "num_key_value_heads": 8, "rms_norm_eps": 1e-5, "max_position_embeddings": 2048,
           "tie_word_embeddings": False}


def _config_folder(path, cfg: dict) -> str:
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return str(path)


def _generate(path, prompts, max_new, **kw):
    import radixlm

    eng = radixlm.Engine(model_path=path, device="cuda", dtype="float32", skip_tokenizer_init=True,
                         context_length=1024, attention_backend="triton", **kw)
    try:
        graphs = eng.runner.graph_runner
        assert graphs is not None, "the test needs captured decode graphs"
        head = getattr(eng.scheduler.spec, "graphs", None)  # EAGLE3: the head's chain graphs
        replays, head_replays = graphs.replays, head.replays if head is not None else 0
        outs = eng.generate(input_ids=prompts, sampling_params={
            "temperature": 0, "max_new_tokens": max_new, "ignore_eos": True})
        stats = dict(eng.get_stats(), graph_replays=graphs.replays - replays,
                     head_graph_replays=(head.replays - head_replays if head is not None
                                         else None))
        eng.wait_idle()
        eng.check_integrity()
    finally:
        eng.shutdown()
    return [o["output_ids"] for o in outs], stats


def _check(ref, got, stats):
    assert got == ref
    assert stats["spec_verify_steps"] > 0 and stats["spec_draft_tokens"] > 0
    # every decode step of EAGLE3 is a verify: the graphs replayed were verifies
    assert stats["graph_replays"] >= stats["spec_verify_steps"] > 0
    # the head's chain (depths 2..k) replayed its own graphs (speculative/eagle3_graphs.py)
    assert stats["head_graph_replays"] is not None and stats["head_graph_replays"] > 0


@pytest.mark.parametrize("topk", [1, 4])
def test_eagle3_tiny_greedy_matches_plain_decoding(tiny_llama_path, tmp_path, topk):
    """Top-k 4: draft trees of 3 levels, 8 nodes; their beams' rows replay the head's graphs
    and their verify rows (a scratch req_to_token row per node) the target's."""
    from tiny_models import write_tiny_eagle3

    head = write_tiny_eagle3(str(tmp_path / "head"), vocab=512, hidden=256, heads=4,
                             kv_heads=2, inter=512, draft_vocab=200, aux_layers=[0, 1, 2])
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist()
               for n in (5, 8, 11, 90, 3, 17, 30, 64)]
    kw = dict(max_total_tokens=8192)
    ref, _ = _generate(tiny_llama_path, prompts, 40, **kw)
    tree = dict(speculative_eagle_topk=4, speculative_num_steps=3,
                speculative_num_draft_tokens=9) if topk > 1 else {}
    got, stats = _generate(tiny_llama_path, prompts, 40, speculative_algorithm="EAGLE3",
                           speculative_draft_model_path=head, speculative_adaptive=False,
                           **tree, **kw)
    _check(ref, got, stats)
    # 8 requests x 3 drafts a step: not held to the policy's 16-row probe (adaptive.PROBE_ROWS),
    # which waits for an overlapped plain step that EAGLE3 never runs
    assert stats["spec_draft_tokens"] > 16 * stats["spec_verify_steps"]


@pytest.mark.parametrize("topk", [1, 4])
def test_eagle3_llama_8b_shape_dummy_weights(tmp_path, topk):
    """Random Llama-3.1-8B (32 GB in fp32) and a random head: capture of layers 1, 15, 28 in
    the eager prefill and in the verify graphs, a 32000-token draft vocabulary (top-k 4: trees
    of 3 levels, 5 nodes, within the 16-row graphs)."""
    target = _config_folder(tmp_path / "llama-8b", LLAMA_8B)
    head = _config_folder(tmp_path / "eagle3-8b", HEAD_8B)
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(1000, 120000, (n,), generator=gen).tolist() for n in (12, 40, 200)]
    kw = dict(load_format="dummy", max_total_tokens=4096, cuda_graph_max_bs=16)
    ref, _ = _generate(target, prompts, 16, **kw)
    got, stats = _generate(target, prompts, 16, speculative_algorithm="EAGLE3",
                           speculative_draft_model_path=head, speculative_adaptive=False,
                           speculative_num_steps=3, **kw, **(dict(
                               speculative_eagle_topk=4, speculative_num_draft_tokens=6)
                               if topk > 1 else {}))
    _check(ref, got, stats)
