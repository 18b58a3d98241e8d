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

    # (tp_size > 1 is built: the head runs on rank 0, test_tensor_parallel_engine.py)
    # (top-k > 1, draft trees, is built: test_speculative_tree.py)
    for extra, name in ((dict(speculative_eagle_topk=17), "speculative_eagle_topk"),
                        (dict(), "speculative_draft_model_path")):
        args = dict(speculative_algorithm="EAGLE3", speculative_draft_model_path="x", **extra)
        if not extra:
            args.pop("speculative_draft_model_path")
        with pytest.raises(ValueError, match=name):
            spec_config.resolve(ServerArgs(**args))
    cfg = spec_config.resolve(ServerArgs(speculative_algorithm="eagle3",
                                         speculative_draft_model_path="x"))
    assert (cfg.algorithm, cfg.max_draft, cfg.draft_model_path) == ("EAGLE3", 3, "x")


def test_rejection_with_a_heads_q_keeps_the_target_distribution():
    """Drafts from a head with a 4-id vocabulary inside an 8-id target vocabulary: q (mapped by
    to_target, then processed) is 0 on the 4 other ids, where p is not; the emitted tokens
    still follow p (the residual max(0, p - q) carries the mass q lacks)."""
    from radixlm.runtime.request import Req
    from radixlm.runtime.sampling.sampler import Sampler
    from radixlm.runtime.sampling.sampling_batch_info import SamplingBatchInfo
    from radixlm.runtime.sampling_params import SamplingParams
    from radixlm.runtime.speculative.eagle3_model import Eagle3Head
    from radixlm.runtime.speculative.rejection import accept_rows, sample_draft

    torch.manual_seed(0)
    head = Eagle3Head.__new__(Eagle3Head)
    torch.nn.Module.__init__(head)
    head.register_buffer("hot", torch.tensor([1, 2, 5, 7]))
    sp = SamplingParams(temperature=0.9, top_p=0.98, frequency_penalty=0.3)
    sp.verify(8)
    req = Req("r", [1, 2], sp)
    req.output_ids = [7, 0]
    base = SamplingBatchInfo.from_reqs([req], 8, "cpu")
    target = torch.tensor([1.0, 1.5, 0.2, 0.4, 0.8, -0.5, -1.0, 1.6])
    n = 60000
    rows = [req] * n
    mapped = head.to_target(torch.tensor([0.3, 1.2, -0.4, 0.9]).expand(n, 4), 8)
    draft, q = sample_draft(mapped, base.take([0] * n), rows, Sampler())
    assert (q[:, [0, 3, 4, 6]] == 0).all() and set(draft.unique().tolist()) <= {1, 2, 5, 7}
    x = target.view(1, -1).clone()
    info = base.take([0])
    info.apply_penalties_and_masks(x)
    p = Sampler().filtered_probs(x, info)[0]
    p = p / p.sum()
    assert p[[0, 3, 4, 6]].sum() > 0.2
    accept, token = accept_rows(target.expand(n, 8).clone(), base.take([0] * n), rows, draft,
                                Sampler(), q)
    counts = torch.bincount(torch.where(accept, draft, token), minlength=8).double()
    support = p > 0
    assert counts[~support].sum() == 0
    expected = p[support].double() * n
    chi2 = float(((counts[support] - expected) ** 2 / expected).sum())
    assert chi2 < {5: 25.75, 6: 27.86, 7: 29.88}[int(support.sum()) - 1], (chi2, counts.tolist())
