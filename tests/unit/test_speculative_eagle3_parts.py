"""EAGLE3's parts on the CPU: the head's distribution mapped through d2t into the target
vocabulary, the checkpoint loader's errors (each names the tensor or the flag) and the flags'
refusals. The engines' exactness: test_speculative_eagle3.py."""

from __future__ import annotations

import json
import os

import pytest
import torch

V, DV = 256, 100
KW = dict(skip_tokenizer_init=True, max_total_tokens=4096, context_length=512, dtype="float32")
SPEC = dict(speculative_algorithm="EAGLE3", speculative_adaptive=False)


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    from tiny_models import write_tiny_llama

    root = tmp_path_factory.mktemp("eagle3-parts")
    return {"target": write_tiny_llama(str(root / "target"), vocab=V, heads=4, kv_heads=2,
                                       tied=False, layers=4), "root": root}


def test_q_is_the_heads_distribution_at_target_ids():
    """A head's logits over its 5-token vocabulary, mapped through d2t into a 12-token target
    vocabulary and processed (temperature 0.7): q at target id hot[d] is softmax(logits / 0.7)
    [d], 0 elsewhere; greedy picks hot[argmax]."""
    from radixlm.runtime.request import Req
    from radixlm.runtime.sampling.sampler import Sampler
    from radixlm.runtime.sampling.sampling_batch_info import SamplingBatchInfo
    from radixlm.runtime.sampling_params import SamplingParams
    from radixlm.runtime.speculative.eagle3_model import Eagle3Head
    from radixlm.runtime.speculative.rejection import sample_draft

    head = Eagle3Head.__new__(Eagle3Head)
    torch.nn.Module.__init__(head)
    head.register_buffer("hot", torch.tensor([2, 3, 7, 8, 11]))
    draft = torch.tensor([[0.5, -1.0, 2.0, 0.0, 1.0], [3.0, 0.0, 0.0, 0.0, 0.0]])
    sp = SamplingParams(temperature=0.7)
    sp.verify(12)
    reqs = [Req("a", [1], sp), Req("b", [1], sp)]
    info = SamplingBatchInfo.from_reqs(reqs, 12, "cpu")
    _, q = sample_draft(head.to_target(draft, 12), info, reqs, Sampler())
    want = torch.zeros(2, 12)
    want[:, head.hot] = torch.softmax(draft / 0.7, dim=-1)
    assert torch.allclose(q, want, atol=1e-6)
    greedy = SamplingParams(temperature=0)
    greedy.verify(12)
    g_reqs = [Req("c", [1], greedy)] * 2
    tok, q = sample_draft(head.to_target(draft, 12), SamplingBatchInfo.from_reqs(g_reqs, 12, "cpu"),
                          g_reqs, Sampler())
    assert q is None and tok.tolist() == [7, 2]

def test_loader_names_the_bad_tensor(paths):
    import radixlm
    from tiny_models import write_tiny_eagle3

    root = paths["root"]
    cases = [
        (dict(drop=["midlayer.hidden_norm.weight"]), "midlayer.hidden_norm.weight"),
        (dict(reshape={"fc.weight": (64, 128)}), "fc.weight"),
        (dict(reshape={"midlayer.self_attn.k_proj.weight": (32, 64)}), "k_proj"),
        (dict(drop=["d2t"]), "d2t"),
        (dict(reshape={"lm_head.weight": (DV + 1, 64)}), "lm_head.weight"),
        (dict(reshape={"t2d": (V - 1,)}), "t2d"),
        (dict(aux_layers=[0, 1, 4]), "eagle_aux_hidden_state_layer_ids"),
    ]
    for i, (kw, name) in enumerate(cases):
        head = write_tiny_eagle3(str(root / f"bad{i}"), vocab=V, draft_vocab=DV, **kw)
        with pytest.raises(ValueError, match=name):
            radixlm.Engine(model_path=paths["target"], speculative_draft_model_path=head,
                           **SPEC, **KW)
    head = write_tiny_eagle3(str(root / "bad-t2d"), vocab=V, draft_vocab=DV)
    from safetensors.torch import load_file, save_file

    w = load_file(os.path.join(head, "model.safetensors"))
    w["t2d"] = torch.roll(w["t2d"], 1)  # marks other ids than d + d2t[d]
    save_file(w, os.path.join(head, "model.safetensors"))
    with pytest.raises(ValueError, match="t2d"):
        radixlm.Engine(model_path=paths["target"], speculative_draft_model_path=head, **SPEC, **KW)
    with open(os.path.join(head, "config.json")) as f:
        cfg = json.load(f)
    cfg["architectures"] = ["LlamaForCausalLM"]
    with open(os.path.join(head, "config.json"), "w") as f:
        json.dump(cfg, f)
    with pytest.raises(ValueError, match="speculative_draft_model_path"):
        radixlm.Engine(model_path=paths["target"], speculative_draft_model_path=head, **SPEC, **KW)


def test_flags_refuse_what_is_not_built():
    from radixlm.runtime.config import ServerArgs
    from radixlm.runtime.speculative import spec_config

    for extra, name in ((dict(speculative_eagle_topk=4), "speculative_eagle_topk"),
                        (dict(tp_size=2), "tp_size"), (dict(), "speculative_draft_model_path")):
        args = dict(speculative_algorithm="EAGLE3", speculative_draft_model_path="x", **extra)
        if not extra:
            args.pop("speculative_draft_model_path")
        with pytest.raises(ValueError, match=name):
            spec_config.resolve(ServerArgs(**args))
    cfg = spec_config.resolve(ServerArgs(speculative_algorithm="eagle3",
                                         speculative_draft_model_path="x"))
    assert (cfg.algorithm, cfg.max_draft, cfg.draft_model_path) == ("EAGLE3", 3, "x")
