"""EAGLE3 (an EAGLE-3 head drafting over the target's features), fp32 on the CPU, on a tiny
random 4-layer Llama (tests/tiny_models.py; SGLang's default layers 1, L // 2 - 1, L - 4 are
1, 1, 0 there) and random heads (write_tiny_eagle3, a 100-token draft vocabulary).

Greedy tokens equal plain decoding's (penalties, cache hits, chunked prefill, retraction, a
batch, n > 1); the head's drafts equal an independent reference (HF transformers' hidden states
+ the head in plain torch); d2t is what maps drafts to target ids (a head that always drafts
its id 0 is accepted exactly where the target emits d2t's target id); q is 0 outside the draft
vocabulary; loader errors name the tensor; the KV accounting holds after every test."""

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
    from tiny_models import write_tiny_eagle3, write_tiny_llama

    root = tmp_path_factory.mktemp("eagle3")
    return {"target": write_tiny_llama(str(root / "target"), vocab=V, heads=4, kv_heads=2,
                                       tied=False, layers=4),
            "head": write_tiny_eagle3(str(root / "head"), vocab=V, draft_vocab=DV),
            "root": root}


@pytest.fixture(scope="module")
def engines(paths):
    import radixlm

    made = {"off": radixlm.Engine(model_path=paths["target"], **KW),
            "on": radixlm.Engine(model_path=paths["target"], **SPEC, **KW,
                                 speculative_draft_model_path=paths["head"])}
    yield made
    for eng in made.values():
        eng.shutdown()


def _prompts(seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    ids = lambda n: torch.randint(0, V, (n,), generator=g).tolist()  # noqa: E731
    shared = ids(30)
    return [ids(n) for n in (3, 17, 60)] + [shared + ids(5), shared + ids(40)]


def _greedy(**kw) -> dict:
    return {"temperature": 0, "max_new_tokens": 32, "ignore_eos": True, **kw}


def test_greedy_tokens_match_plain_decoding(engines, integrity):
    prompts = _prompts()
    params = [_greedy(), _greedy(frequency_penalty=0.5, presence_penalty=0.3),
              _greedy(repetition_penalty=1.3, logit_bias={"7": 3.0}),
              _greedy(min_new_tokens=8, max_new_tokens=20), _greedy(max_new_tokens=9)]
    kw = dict(return_logprob=True, top_logprobs_num=2)
    ref = engines["off"].generate(input_ids=prompts, sampling_params=params, **kw)
    eng = engines["on"]
    for round_ in range(2):  # round 2: the radix cache serves the prompts (and the head's rows)
        before = eng.get_stats()
        outs = eng.generate(input_ids=prompts, sampling_params=params, **kw)
        for a, b in zip(ref, outs):
            assert a["output_ids"] == b["output_ids"]
            for x, y in zip(a["meta_info"]["output_token_logprobs"],
                            b["meta_info"]["output_token_logprobs"]):
                assert x[1] == y[1] and abs(x[0] - y[0]) < 2e-4
        after = eng.get_stats()
        assert after["spec_draft_tokens"] - before["spec_draft_tokens"] > 100
        if round_ == 1:
            assert all(o["meta_info"]["cached_tokens"] > 0 for o in outs)
    plain = engines["off"].generate(input_ids=prompts[1], sampling_params=_greedy())
    n2 = eng.generate(input_ids=prompts[1], sampling_params=_greedy(n=2))
    assert [o["output_ids"] for o in n2] == [plain["output_ids"]] * 2
    integrity(eng)


def test_chunked_prefill_and_retraction_match_plain_decoding(paths, engines, integrity):
    """16-token prefill chunks (a head row per chunk boundary comes from the chunk after) and
    a pool too small for every output (retraction, re-admission from the tree)."""
    import radixlm

    eng = radixlm.Engine(model_path=paths["target"], speculative_draft_model_path=paths["head"],
                         **SPEC, **dict(KW, max_total_tokens=260), chunked_prefill_size=16,
                         schedule_conservativeness=0.05, max_running_requests=4)
    try:
        g = torch.Generator().manual_seed(3)
        ids = lambda n: torch.randint(0, V, (n,), generator=g).tolist()  # noqa: E731
        shared = ids(60)
        prompts = [shared + ids(n) for n in (4, 9, 13)] + [ids(90), ids(20)]
        params = _greedy(max_new_tokens=40)
        on = eng.generate(input_ids=prompts, sampling_params=params)
        off = engines["off"].generate(input_ids=prompts, sampling_params=params)
        for a, b in zip(off, on):
            assert a["output_ids"] == b["output_ids"]
        stats = eng.get_stats()
        assert stats["retractions"] > 0 and stats["spec_draft_tokens"] > 0
        integrity(eng)
    finally:
        eng.shutdown()


def test_sampling_seeds_n_and_abort(engines, integrity):
    eng = engines["on"]
    prompts = _prompts(2)[:3]
    params = {"temperature": 0.9, "top_k": 40, "top_p": 0.95, "min_p": 0.01,
              "frequency_penalty": 0.2, "max_new_tokens": 24, "ignore_eos": True, "seed": 11}
    first = eng.generate(input_ids=prompts, sampling_params=params)
    again = eng.generate(input_ids=prompts[::-1], sampling_params=params)[::-1]
    assert [o["output_ids"] for o in first] == [o["output_ids"] for o in again]
    outs = eng.generate(input_ids=prompts[:1], sampling_params=dict(params, n=3, seed=None))
    assert len(outs) == 3 and all(len(o["output_ids"]) == 24 for o in outs)
    stream = eng.generate(input_ids=prompts[2], sampling_params=_greedy(max_new_tokens=400),
                          stream=True, rid="to-abort")
    next(stream)
    eng.abort_request("to-abort")
    assert list(stream)[-1]["meta_info"]["finish_reason"]["type"] == "abort"
    integrity(eng)


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


def _simulate(out: list[int], token: int, max_draft: int) -> tuple[int, int]:
    """(drafts, accepted) of greedy verifies of `out` when every draft is `token`: the first
    token comes from the prefill; each verify drafts min(max_draft, tokens left - 1)."""
    n, drafts, accepted = 1, 0, 0
    while n < len(out):
        k = min(max_draft, len(out) - n - 1)
        a = 0
        while a < k and out[n + a] == token:
            a += 1
        drafts, accepted, n = drafts + k, accepted + a, n + a + 1
    return drafts, accepted


def test_d2t_maps_the_drafts_to_target_ids(paths, engines, integrity):
    """A head whose norm weight is 0 has all-zero logits: it always drafts its id 0, i.e.
    target id d2t[0] (the smallest target id of its vocabulary). Its accepted drafts are then
    exactly the verifies' leading runs of that token in plain decoding's output; with d2t
    ignored it would draft target id 0 and be accepted elsewhere."""
    import radixlm
    from safetensors.torch import load_file, save_file
    from tiny_models import write_tiny_eagle3

    prompts = _prompts(4)[:3]
    params = _greedy(max_new_tokens=40)
    ref = [o["output_ids"] for o in engines["off"].generate(input_ids=prompts,
                                                            sampling_params=params)]
    counts = torch.bincount(torch.tensor(sum((o[1:] for o in ref), [])), minlength=V)
    counts[V - 8 :] = 0  # (room for the 8-token vocabulary above it)
    token = int(counts.argmax())
    assert token != 0 and counts[token] >= 4
    path = write_tiny_eagle3(str(paths["root"] / "zero-norm"), vocab=V, draft_vocab=8,
                             hot=list(range(token, token + 8)))
    w = load_file(os.path.join(path, "model.safetensors"))
    w["norm.weight"] = torch.zeros_like(w["norm.weight"])
    save_file(w, os.path.join(path, "model.safetensors"))
    eng = radixlm.Engine(model_path=paths["target"], speculative_draft_model_path=path,
                         speculative_num_steps=3, **SPEC, **KW)
    try:
        outs = eng.generate(input_ids=prompts, sampling_params=params)
        assert [o["output_ids"] for o in outs] == ref
        stats = eng.get_stats()
        sims = [_simulate(o, token, 3) for o in ref]
        want = (sum(s[0] for s in sims), sum(s[1] for s in sims))
        assert (stats["spec_draft_tokens"], stats["spec_accepted_tokens"]) == want
        assert want[1] > 0 and want[1] != sum(_simulate(o, 0, 3)[1] for o in ref)
        integrity(eng)
    finally:
        eng.shutdown()


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


def test_dummy_weights_and_refusals(paths, integrity):
    import radixlm
    from radixlm.runtime.config import ServerArgs
    from radixlm.runtime.speculative import spec_config

    kw = dict(KW, load_format="dummy")
    off = radixlm.Engine(model_path=paths["target"], **kw)
    on = radixlm.Engine(model_path=paths["target"], speculative_draft_model_path=paths["head"],
                        **SPEC, **kw)
    try:
        prompts, params = _prompts(7)[:2], _greedy(max_new_tokens=16)
        ref = off.generate(input_ids=prompts, sampling_params=params)
        got = on.generate(input_ids=prompts, sampling_params=params)
        assert [o["output_ids"] for o in ref] == [o["output_ids"] for o in got]
        assert on.get_stats()["spec_draft_tokens"] > 0
        integrity(on)
    finally:
        off.shutdown()
        on.shutdown()
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
