"""EAGLE3 (an EAGLE-3 head drafting over the target's features), fp32 on the CPU, on a tiny
random 4-layer Llama (tests/tiny_models.py; SGLang's default layers 1, L // 2 - 1, L - 4 are
1, 1, 0 there) and random heads (write_tiny_eagle3, a 100-token draft vocabulary).

Greedy tokens equal plain decoding's (penalties, cache hits, chunked prefill, retraction, a
batch, n > 1, adaptive lengths, stop strings, regexes and jump-forward; greedy and sampled
requests with draft trees too: the "tree" arm); d2t is what maps
drafts to target ids (a head that always drafts its id 0 is accepted exactly where the target
emits d2t's target id); the KV accounting holds after every test. Elsewhere: the head's drafts
against a plain-torch reference (test_speculative_eagle3_reference.py); q, 0 outside the draft
vocabulary, and the loader's errors (test_speculative_eagle3_parts.py)."""

from __future__ import annotations

import os
import re

import pytest
import torch

from speculative_helpers import plain_tokens_under_pressure

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
                                 speculative_draft_model_path=paths["head"]),
            # draft trees: top-k 3, 3 levels, 7 nodes (test_speculative_tree.py has the rest)
            "tree": radixlm.Engine(model_path=paths["target"], **SPEC, **KW,
                                   speculative_draft_model_path=paths["head"],
                                   speculative_eagle_topk=3, speculative_num_steps=3,
                                   speculative_num_draft_tokens=8)}
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


@pytest.mark.parametrize("arm", ["on", "tree"])
def test_greedy_tokens_match_plain_decoding(engines, integrity, arm):
    prompts = _prompts()
    params = [_greedy(), _greedy(frequency_penalty=0.5, presence_penalty=0.3),
              _greedy(repetition_penalty=1.3, logit_bias={"7": 3.0}),
              _greedy(min_new_tokens=8, max_new_tokens=20), _greedy(max_new_tokens=9)]
    kw = dict(return_logprob=True, top_logprobs_num=2)
    ref = engines["off"].generate(input_ids=prompts, sampling_params=params, **kw)
    eng = engines[arm]
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
        assert plain_tokens_under_pressure(eng, engines["off"], V)["spec_draft_tokens"] > 0
        integrity(eng)
    finally:
        eng.shutdown()


def test_adaptive_policy_keeps_plain_decodings_tokens(paths, engines, integrity):
    """Adaptive on (the default): whatever lengths it picks (0 included: a verify of the last
    tokens alone, so the head still gets every row's features), the tokens are plain's."""
    import radixlm

    eng = radixlm.Engine(model_path=paths["target"], speculative_algorithm="EAGLE3",
                         speculative_draft_model_path=paths["head"], **KW)
    try:
        prompts, params = _prompts(6), _greedy(max_new_tokens=40)
        ref = engines["off"].generate(input_ids=prompts, sampling_params=params)
        for a, b in zip(ref, eng.generate(input_ids=prompts, sampling_params=params)):
            assert a["output_ids"] == b["output_ids"]
        assert eng.get_stats()["spec_draft_forwards"] > 0
        integrity(eng)
    finally:
        eng.shutdown()


@pytest.mark.parametrize("arm", ["on", "tree"])
def test_sampling_seeds_n_and_abort(engines, integrity, arm):
    eng = engines[arm]
    prompts = _prompts(2)[:3]
    params = {"temperature": 0.9, "top_k": 40, "top_p": 0.95, "min_p": 0.01,
              "frequency_penalty": 0.2, "max_new_tokens": 24, "ignore_eos": True, "seed": 11}
    first = eng.generate(input_ids=prompts, sampling_params=params)
    again = eng.generate(input_ids=prompts[::-1], sampling_params=params)[::-1]
    assert [o["output_ids"] for o in first] == [o["output_ids"] for o in again]
    outs = eng.generate(input_ids=prompts[:1], sampling_params=dict(params, n=3, seed=None))
    assert len(outs) == 3 and all(len(o["output_ids"]) == 24 for o in outs)
    stream = eng.generate(input_ids=prompts[2], sampling_params=_greedy(max_new_tokens=400),
                          stream=True, rid=f"to-abort-{arm}")
    next(stream)
    eng.abort_request(f"to-abort-{arm}")
    assert list(stream)[-1]["meta_info"]["finish_reason"]["type"] == "abort"
    integrity(eng)



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



def test_dummy_weights_match_plain_decoding(paths, integrity):
    import radixlm

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
        # SGLang's default layers of a 4-layer target; the plain engine captures nothing
        assert (on.runner.capture_layers, off.runner.capture_layers) == ((1, 1, 0), ())
        integrity(on)
    finally:
        off.shutdown()
        on.shutdown()


def test_stop_strings_and_grammar_match_plain_decoding(tiny_chat_path, tmp_path, integrity):
    """Text and a tokenizer (SmolLM2's, vocab 49152; the head drafts 2000 odd ids): stop strings
    inside accepted drafts, regexes whose masks apply to the head's q and the target's p alike
    (a mask that allows none of the head's ids leaves q on the allowed others)."""
    import radixlm
    from tiny_models import write_tiny_eagle3

    head = write_tiny_eagle3(str(tmp_path / "chat-head"), vocab=49152, hidden=96, heads=6,
                             kv_heads=3, inter=192, draft_vocab=2000, aux_layers=[0, 1, 1])
    kw = dict(dtype="float32", max_total_tokens=4096, context_length=1024)
    off = radixlm.Engine(model_path=tiny_chat_path, **kw)
    on = radixlm.Engine(model_path=tiny_chat_path, speculative_draft_model_path=head, **SPEC, **kw)
    try:
        prompts = ["Name three fruits:", "Count: one two three", "Write a date:"]
        text = off.generate(prompts[0], _greedy(max_new_tokens=24))["text"]
        stop = next(text[i : i + 5] for i in range(30, len(text))
                    if text.find(text[i : i + 5]) == i)
        params = [_greedy(stop=[stop]), _greedy(regex=r"[a-z ]{4,30}\."),
                  _greedy(regex=r"(19|20)[0-9]{2}-[01][0-9]-[0-3][0-9]")]
        for a, b in zip(off.generate(prompts, params), on.generate(prompts, params)):
            assert a["output_ids"] == b["output_ids"] and a["text"] == b["text"]
        sampled = on.generate(prompts[1:], [dict(p, temperature=1.0, seed=5) for p in params[1:]])
        assert re.fullmatch(r"[a-z ]{4,30}\.", sampled[0]["text"])
        assert re.fullmatch(r"(19|20)[0-9]{2}-[01][0-9]-[0-3][0-9]", sampled[1]["text"])
        stats = on.get_stats()  # (the date's forced "-" go through jump-forward's splice)
        assert stats["spec_draft_tokens"] > 0 and stats["jump_forward_tokens"] > 0
        integrity(on)
    finally:
        off.shutdown()
        on.shutdown()
