"""Speculative decoding with a draft model (STANDALONE), fp32 on the CPU, on tiny random
checkpoints (tests/tiny_models.py): a 2-layer target, the target itself as its own draft (every
draft accepted) and a perturbed copy (weights + N(0, 0.01^2): part of the drafts accepted).

Greedy tokens and logprobs equal plain decoding's, with penalties, cache hits, chunked prefill,
retraction, stop strings and grammars; for sampled requests each verify row is handed the q its
draft was drawn from (the rejection math itself: test_speculative_parts.py, chi-square); both KV
pools balance after every test (the integrity fixture checks the draft's pool too:
scheduler.check_integrity -> speculator)."""

from __future__ import annotations

import os
import re
import shutil

import pytest
import torch

from speculative_helpers import plain_tokens_under_pressure

V = 256
KW = dict(skip_tokenizer_init=True, max_total_tokens=4096, context_length=512, dtype="float32")
SPEC = dict(speculative_algorithm="STANDALONE", speculative_adaptive=False)


def _perturbed(src: str, dst: str, sigma: float, seed: int = 7) -> str:
    """A copy of the checkpoint at `src` with N(0, sigma^2) added to every weight."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("model.safetensors"))
    w = load_file(os.path.join(src, "model.safetensors"))
    g = torch.Generator().manual_seed(seed)
    save_file({k: v + torch.randn(v.shape, generator=g) * sigma for k, v in w.items()},
              os.path.join(dst, "model.safetensors"))
    return dst


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    from tiny_models import write_tiny_llama

    root = tmp_path_factory.mktemp("standalone")
    target = write_tiny_llama(str(root / "target"), vocab=V, heads=4, kv_heads=2, tied=False)
    return {"target": target, "draft": _perturbed(target, str(root / "draft"), 0.01),
            "vocab300": write_tiny_llama(str(root / "v300"), vocab=300, heads=4, kv_heads=2,
                                         tied=False)}


@pytest.fixture(scope="module")
def engines(paths):
    import radixlm

    t = paths["target"]
    made = {"off": radixlm.Engine(model_path=t, **KW),
            "self": radixlm.Engine(model_path=t, speculative_draft_model_path=t, **SPEC, **KW),
            "other": radixlm.Engine(model_path=t, speculative_draft_model_path=paths["draft"],
                                    speculative_num_steps=4, **SPEC, **KW)}
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


def _same(a: dict, b: dict, lp_tol: float = 2e-4) -> None:
    assert a["output_ids"] == b["output_ids"]
    assert a["meta_info"]["finish_reason"] == b["meta_info"]["finish_reason"]
    for x, y in zip(a["meta_info"].get("output_token_logprobs", []),
                    b["meta_info"].get("output_token_logprobs", [])):
        assert x[1] == y[1] and abs(x[0] - y[0]) < lp_tol, (x, y)
    for x, y in zip(a["meta_info"].get("output_top_logprobs", []),
                    b["meta_info"].get("output_top_logprobs", [])):
        assert [t for _, t, _ in x] == [t for _, t, _ in y]


def _delta(eng, before: dict) -> dict:
    after = eng.get_stats()
    return {k: after[k] - before[k] for k in ("spec_draft_tokens", "spec_accepted_tokens",
                                              "spec_verify_tokens", "spec_verify_reqs")}


def test_greedy_tokens_and_logprobs_match_plain_decoding(engines, integrity):
    prompts = _prompts()
    params = [_greedy(), _greedy(frequency_penalty=0.5, presence_penalty=0.3),
              _greedy(repetition_penalty=1.3, logit_bias={"7": 3.0}),
              _greedy(min_new_tokens=8, max_new_tokens=20), _greedy(max_new_tokens=9)]
    kw = dict(return_logprob=True, top_logprobs_num=2)
    ref = engines["off"].generate(input_ids=prompts, sampling_params=params, **kw)
    for name in ("self", "other"):
        eng = engines[name]
        for round_ in range(2):  # round 2: the target's radix cache serves the prompts
            before = eng.get_stats()
            outs = eng.generate(input_ids=prompts, sampling_params=params, **kw)
            for a, b in zip(ref, outs):
                _same(a, b)
            d = _delta(eng, before)
            assert d["spec_verify_tokens"] == d["spec_accepted_tokens"] + d["spec_verify_reqs"]
            if name == "self":  # the target as its own draft: every draft passes
                assert d["spec_accepted_tokens"] == d["spec_draft_tokens"] > 0
            else:
                assert 0.05 < d["spec_accepted_tokens"] / d["spec_draft_tokens"] < 0.95, d
        if round_ == 1:
            assert all(o["meta_info"]["cached_tokens"] > 0 for o in outs)
        integrity(eng)
    # a stop token inside a chain: the drafts after it are cut, the request ends there
    tok = ref[0]["output_ids"][12]
    stop = _greedy(stop_token_ids=[tok])
    stop_ref = engines["off"].generate(input_ids=prompts[0], sampling_params=stop)
    assert stop_ref["meta_info"]["finish_reason"] == {"type": "stop", "matched": tok}
    for name in ("self", "other"):
        _same(stop_ref, engines[name].generate(input_ids=prompts[0], sampling_params=stop))
        integrity(engines[name])


def test_adaptive_policy_keeps_plain_decodings_tokens(paths, engines, integrity):
    """Adaptive on (the default): a draft as large as the target soon stops paying; whichever
    steps draft, the tokens are plain decoding's and both pools balance."""
    import radixlm

    eng = radixlm.Engine(model_path=paths["target"], speculative_algorithm="STANDALONE",
                         speculative_draft_model_path=paths["draft"], **KW)
    try:
        prompts, params = _prompts(6), _greedy(max_new_tokens=40)
        ref = engines["off"].generate(input_ids=prompts, sampling_params=params)
        for a, b in zip(ref, eng.generate(input_ids=prompts, sampling_params=params)):
            assert a["output_ids"] == b["output_ids"]
        assert eng.get_stats()["spec_draft_forwards"] > 0  # the first steps measure the draft
        integrity(eng)
    finally:
        eng.shutdown()


def test_sampling_seeds_n_and_abort(engines, integrity):
    eng = engines["other"]
    prompts = _prompts(2)[:3]
    params = {"temperature": 0.9, "top_k": 40, "top_p": 0.95, "min_p": 0.01,
              "frequency_penalty": 0.2, "max_new_tokens": 24, "ignore_eos": True, "seed": 11}
    first = eng.generate(input_ids=prompts, sampling_params=params)
    again = eng.generate(input_ids=prompts[::-1], sampling_params=params)[::-1]
    # a seeded request draws its drafts and acceptances from its own generator
    assert [o["output_ids"] for o in first] == [o["output_ids"] for o in again]
    assert all(len(o["output_ids"]) == 24 for o in first)
    outs = eng.generate(input_ids=prompts[:1], sampling_params=dict(params, n=3, seed=None))
    assert len(outs) == 3 and all(len(o["output_ids"]) == 24 for o in outs)
    stream = eng.generate(input_ids=prompts[2], sampling_params=_greedy(max_new_tokens=400),
                          stream=True, rid="to-abort")
    next(stream)
    eng.abort_request("to-abort")
    assert list(stream)[-1]["meta_info"]["finish_reason"]["type"] == "abort"
    integrity(eng)


def test_each_verify_row_gets_the_q_its_draft_was_drawn_from(engines, monkeypatch, integrity):
    """The glue between the chain and the verify, for sampled requests: with the target as its
    own draft, the q handed to the acceptance for row (request, j) is the target's processed p
    at that row (same request, same depth; penalties counting the drafts before it, bias,
    min-tokens, top-k/p, min-p), and gives its draft token positive mass. A q of another row or
    request, or processed without the drafts before it, differs from p there."""
    from radixlm.runtime.speculative import verify as verify_mod

    seen = []
    original = verify_mod.accept_rows

    def spy(logits, info, reqs, draft, sampler, draft_probs=None):
        x = logits.clone()
        info.apply_penalties_and_masks(x)
        p = sampler.filtered_probs(x, info)
        seen.append((p / p.sum(dim=-1, keepdim=True), draft.clone(), draft_probs))
        return original(logits, info, reqs, draft, sampler, draft_probs)

    monkeypatch.setattr(verify_mod, "accept_rows", spy)
    base = {"max_new_tokens": 16, "ignore_eos": True}
    params = [dict(base, temperature=0.8, frequency_penalty=0.6, presence_penalty=0.2),
              dict(base, temperature=1.2, top_k=20, top_p=0.9, logit_bias={"9": 2.0}),
              dict(base, temperature=0.6, min_p=0.05, repetition_penalty=1.2,
                   min_new_tokens=6, seed=4)]
    engines["self"].generate(input_ids=_prompts(5)[:3], sampling_params=params)
    rows = 0
    for p, draft, q in seen:
        has = draft >= 0
        assert q is not None
        assert torch.allclose(q[has], p[has], atol=1e-5), (q[has] - p[has]).abs().max()
        assert (q[has].gather(1, draft[has].view(-1, 1)) > 0).all()
        rows += int(has.sum())
    assert rows > 20
    integrity(engines["self"])


def test_retraction_and_chunked_prefill_match_plain_decoding(paths, engines, integrity):
    """A target pool too small for every output (retraction) and 16-token prefill chunks: the
    draft catches a 90-token prompt up in 16-token parts. Prompts sharing a 60-token prefix
    (the target's tree holds it once, the draft once per request) overflow the draft's pool
    (the target's 260 tokens + a chain per request): the idle requests' draft KV goes first."""
    import radixlm

    eng = radixlm.Engine(model_path=paths["target"], speculative_draft_model_path=paths["draft"],
                         **SPEC, **dict(KW, max_total_tokens=260), chunked_prefill_size=16,
                         schedule_conservativeness=0.05, max_running_requests=4)
    try:
        stats = plain_tokens_under_pressure(eng, engines["off"], V)
        assert stats["spec_accepted_tokens"] > 0 and stats["spec_draft_kv_short"] > 0
        integrity(eng)
    finally:
        eng.shutdown()


def test_stop_strings_and_grammar_match_plain_decoding(tiny_chat_path, tmp_path, integrity):
    """Text, a tokenizer (SmolLM2's, vocab 49152): stop strings inside accepted drafts, and a
    regex whose mask applies to the draft's q and the target's p alike."""
    import radixlm

    draft = _perturbed(tiny_chat_path, str(tmp_path / "chat-draft"), 0.01)
    kw = dict(dtype="float32", max_total_tokens=4096, context_length=1024)
    off = radixlm.Engine(model_path=tiny_chat_path, **kw)
    on = radixlm.Engine(model_path=tiny_chat_path, speculative_draft_model_path=draft,
                        **SPEC, **kw)
    try:
        prompts = ["Name three fruits:", "Count: one two three", "Write a date:"]
        out_off = off.generate(prompts[0], _greedy(max_new_tokens=24))
        text = out_off["text"]  # a stop string the greedy output first reaches some way in
        stop = next(text[i : i + 5] for i in range(30, len(text))
                    if text.find(text[i : i + 5]) == i)
        params = [_greedy(stop=[stop]), _greedy(regex=r"[a-z ]{4,30}\."),
                  _greedy(regex=r"(19|20)[0-9]{2}-[01][0-9]-[0-3][0-9]")]
        ref = off.generate(prompts, params)
        got = on.generate(prompts, params)
        for a, b in zip(ref, got):
            _same(a, b)
            assert a["text"] == b["text"]
        assert got[0]["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
        assert re.fullmatch(r"[a-z ]{4,30}\.", got[1]["text"])
        assert all(o["meta_info"]["spec_verify_steps"] > 0 for o in got)
        sampled = on.generate(prompts[1:], [dict(p, temperature=1.0, seed=5)
                                            for p in params[1:]])
        assert re.fullmatch(r"[a-z ]{4,30}\.", sampled[0]["text"])
        assert re.fullmatch(r"(19|20)[0-9]{2}-[01][0-9]-[0-3][0-9]", sampled[1]["text"])
        assert on.get_stats()["spec_accepted_tokens"] > 0
        integrity(on)
    finally:
        off.shutdown()
        on.shutdown()


def test_refusals_name_the_flag(paths):
    import radixlm

    from radixlm.runtime.config import ServerArgs
    from radixlm.runtime.speculative import spec_config

    with pytest.raises(ValueError, match="speculative_draft_model_path"):
        radixlm.Engine(model_path=paths["target"], speculative_draft_model_path=paths["vocab300"],
                       **SPEC, **KW)
    # (top-k > 1, draft trees, is built: test_speculative_tree.py)
    for kw, name in ((dict(), "speculative_draft_model_path"),
                     (dict(speculative_draft_model_path="x", speculative_eagle_topk=0),
                      "speculative_eagle_topk")):
        with pytest.raises(ValueError, match=name):
            spec_config.resolve(ServerArgs(speculative_algorithm="STANDALONE", **kw))
    # a draft model or an EAGLE-3 head under TP runs whole on rank 0
    # (test_tensor_parallel_engine.py)
    for algo in ("STANDALONE", "EAGLE3"):
        spec_config.resolve(ServerArgs(speculative_algorithm=algo,
                                       speculative_draft_model_path="x", tp_size=2))
    cfg = spec_config.resolve(ServerArgs(speculative_algorithm="standalone",
                                         speculative_draft_model_path="x"))
    assert (cfg.algorithm, cfg.max_draft, cfg.draft_model_path) == ("STANDALONE", 3, "x")
