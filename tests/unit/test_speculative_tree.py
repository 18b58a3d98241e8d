"""Draft trees (STANDALONE and EAGLE3 with --speculative-eagle-topk > 1), fp32 on the CPU, on a
tiny random Llama with random heads (tests/tiny_models.py): the tokens equal plain decoding's; a
complete tree's accepted counts equal what its shape predicts, and penalties, min-tokens,
logprobs, cache hits, n > 1, stop tokens, regexes, chunked prefill, retraction and the adaptive
policy keep plain decoding's tokens; the KV accounting holds after every engine test. The parts
without a model: test_speculative_tree_parts.py."""

from __future__ import annotations

import pytest
import torch

from speculative_helpers import plain_tokens_under_pressure
from test_speculative_eagle3 import _prompts  # (five prompts, two sharing a prefix)

V = 256
KW = dict(skip_tokenizer_init=True, max_total_tokens=4096, context_length=512, dtype="float32")


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    from tiny_models import write_tiny_llama

    root = tmp_path_factory.mktemp("tree")
    return root, write_tiny_llama(str(root / "target"), vocab=V, heads=4, kv_heads=2,
                                  tied=False, layers=4)


@pytest.fixture(scope="module")
def plain(target):
    import radixlm

    eng = radixlm.Engine(model_path=target[1], **KW)
    yield eng
    eng.shutdown()


def _greedy(**kw) -> dict:
    return {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True, **kw}


def _predicted(out: list[int], hot: set, steps: int, topk: int, nodes: int) -> tuple:
    """(draft tokens, accepted, verifies accepting two or more) of greedy verifies of `out` by
    complete trees of every draft id (the head's vocabulary is `hot`): a verify accepts the
    leading run of hot tokens, up to its depth (`steps`, or the tokens left - 1)."""
    n, drafts, accepted, deep = 1, 0, 0, 0
    while n < len(out):
        k = min(steps, len(out) - n - 1)
        a = 0
        while a < k and out[n + a] in hot:
            a += 1
        drafts += min(nodes, topk + (k - 1) * topk * topk) if k else 0
        accepted, n, deep = accepted + a, n + a + 1, deep + (a >= 2)
    return drafts, accepted, deep


def test_complete_trees_accept_every_path_of_hot_tokens(target, plain, integrity):
    """A head of two draft ids with top-k 2 and 2 steps verifies all 6 paths of length <= 2:
    whichever order its scores give the children, a verify accepts exactly the leading run of
    those two ids in plain decoding's output (paths through second children included)."""
    import radixlm
    from tiny_models import write_tiny_eagle3

    prompts = _prompts(4)
    ref = [o["output_ids"] for o in plain.generate(input_ids=prompts, sampling_params=_greedy())]
    counts = torch.bincount(torch.tensor(sum((o[1:] for o in ref), [])), minlength=V)
    hot = sorted(counts.topk(2).indices.tolist())
    head = write_tiny_eagle3(str(target[0] / "two-ids"), vocab=V, draft_vocab=2, hot=hot)
    eng = radixlm.Engine(model_path=target[1], speculative_algorithm="EAGLE3",
                         speculative_adaptive=False, speculative_draft_model_path=head,
                         speculative_eagle_topk=2, speculative_num_steps=2,
                         speculative_num_draft_tokens=7, **KW)
    try:
        outs = eng.generate(input_ids=prompts, sampling_params=_greedy())
        assert [o["output_ids"] for o in outs] == ref
        sims = [_predicted(o, set(hot), 2, 2, 6) for o in ref]
        want = (sum(s[0] for s in sims), sum(s[1] for s in sims))
        stats = eng.get_stats()
        assert (stats["spec_draft_tokens"], stats["spec_accepted_tokens"]) == want
        assert want[1] >= 10 and sum(s[2] for s in sims) >= 3  # (whole paths of depth 2)
        # accepted paths under penalties (each row counts its path's drafts as output), a
        # min-tokens floor on a hot stop token (each row's floor counts its depth), logprobs
        # (each kept token's from its path row)
        kw = dict(return_logprob=True, top_logprobs_num=2)
        params = [_greedy(frequency_penalty=0.4, presence_penalty=0.2),
                  _greedy(repetition_penalty=1.2), _greedy(stop_token_ids=[hot[0]],
                                                           ignore_eos=False, min_new_tokens=6)]
        for p in params:
            a = plain.generate(input_ids=prompts, sampling_params=p, **kw)
            before = eng.get_stats()["spec_accepted_tokens"]
            b = eng.generate(input_ids=prompts, sampling_params=p, **kw)
            assert [x["output_ids"] for x in a] == [x["output_ids"] for x in b]
            for x, y in zip(a, b):
                for u, v in zip(x["meta_info"]["output_token_logprobs"],
                                y["meta_info"]["output_token_logprobs"]):
                    assert u[1] == v[1] and abs(u[0] - v[0]) < 2e-4
                assert ([t[1] for t in x["meta_info"]["output_top_logprobs"][-1]]
                        == [t[1] for t in y["meta_info"]["output_top_logprobs"][-1]])
            assert eng.get_stats()["spec_accepted_tokens"] > before
        # a stop token inside an accepted path: the tokens after it are dropped, their KV freed
        for o in ref:
            stop = next((t for t, u in zip(o[1:], o[2:]) if t in hot and u in hot), None)
            if stop is None:
                continue
            params = _greedy(stop_token_ids=[stop], ignore_eos=False)
            a = plain.generate(input_ids=prompts, sampling_params=params)
            b = eng.generate(input_ids=prompts, sampling_params=params)
            assert [x["output_ids"] for x in a] == [x["output_ids"] for x in b]
            break
        else:
            raise AssertionError("no two hot tokens in a row")
        integrity(eng)
    finally:
        eng.shutdown()
    # the adaptive policy choosing each step's depths (priced by the rows they add): tokens
    # equal whatever it chooses
    eng = radixlm.Engine(model_path=target[1], speculative_algorithm="EAGLE3",
                         speculative_draft_model_path=head, speculative_eagle_topk=2,
                         speculative_num_steps=2, speculative_num_draft_tokens=7, **KW)
    try:
        outs = eng.generate(input_ids=prompts, sampling_params=_greedy())
        assert [o["output_ids"] for o in outs] == ref
        assert eng.get_stats()["spec_verify_steps"] > 0  # (drafting where it pays: here
        # the head's forward and a tree's 2 + 4 rows cost more than its hits bring, so none)
        integrity(eng)
    finally:
        eng.shutdown()


@pytest.fixture(scope="module")
def tree_engine(target):
    import radixlm
    from tiny_models import write_tiny_eagle3

    head = write_tiny_eagle3(str(target[0] / "head"), vocab=V, draft_vocab=100)
    eng = radixlm.Engine(model_path=target[1], speculative_algorithm="EAGLE3",
                         speculative_adaptive=False, speculative_draft_model_path=head,
                         speculative_eagle_topk=3, speculative_num_steps=3,
                         speculative_num_draft_tokens=8, **KW)
    yield eng, head
    eng.shutdown()


def test_tree_stop_tokens_match_plain_decoding(plain, tree_engine, integrity):
    """Stop tokens (greedy, sampling, n > 1 and abort with trees: test_speculative_eagle3.py's
    "tree" arm)."""
    eng = tree_engine[0]
    prompts = _prompts(2)[:3]
    ref = plain.generate(input_ids=prompts, sampling_params=_greedy())
    stops = [_greedy(stop_token_ids=[o["output_ids"][5]], ignore_eos=False) for o in ref]
    a = plain.generate(input_ids=prompts, sampling_params=stops)
    b = eng.generate(input_ids=prompts, sampling_params=stops)
    assert [o["output_ids"] for o in a] == [o["output_ids"] for o in b]
    assert all(len(o["output_ids"]) <= 6 for o in b)
    integrity(eng)


def test_tree_chunked_prefill_and_retraction(target, tree_engine, plain, integrity):
    """16-token prefill chunks and a pool too small for every output (retraction), with the
    default steps and tokens (3, 1 + 3 * 2)."""
    import radixlm

    eng = radixlm.Engine(model_path=target[1], speculative_algorithm="EAGLE3",
                         speculative_adaptive=False,
                         speculative_draft_model_path=tree_engine[1], speculative_eagle_topk=2,
                         **dict(KW, max_total_tokens=300), chunked_prefill_size=16,
                         schedule_conservativeness=0.05, max_running_requests=4)
    try:
        assert plain_tokens_under_pressure(eng, plain, V)["spec_draft_tokens"] > 0
        integrity(eng)
    finally:
        eng.shutdown()


def test_tree_stop_strings_and_regexes_match_plain_decoding(tiny_chat_path, tmp_path, integrity):
    """Text (SmolLM2's tokenizer): a stop string inside a tree's accepted path, and regex
    requests beside tree-drafting ones (a constrained request drafts no tree: its verify row is
    its last token's, masked as in plain decoding; jump-forward still splices)."""
    import radixlm
    from tiny_models import write_tiny_eagle3

    head = write_tiny_eagle3(str(tmp_path / "chat-head"), vocab=49152, hidden=96, heads=6,
                             kv_heads=3, inter=192, draft_vocab=2000, aux_layers=[0, 1, 1])
    kw = dict(dtype="float32", max_total_tokens=4096, context_length=1024)
    off = radixlm.Engine(model_path=tiny_chat_path, **kw)
    on = radixlm.Engine(model_path=tiny_chat_path, speculative_algorithm="EAGLE3",
                        speculative_adaptive=False, speculative_draft_model_path=head,
                        speculative_eagle_topk=4, speculative_num_steps=2, **kw)
    try:
        prompts = ["Name three fruits:", "Count: one two three", "Write a date:", "Hello"]
        text = off.generate(prompts[0], _greedy(max_new_tokens=24))["text"]
        stop = next(text[i : i + 5] for i in range(30, len(text))
                    if text.find(text[i : i + 5]) == i)
        params = [_greedy(stop=[stop]), _greedy(regex=r"[a-z ]{4,30}\."),
                  _greedy(regex=r"(19|20)[0-9]{2}-[01][0-9]-[0-3][0-9]"), _greedy()]
        for a, b in zip(off.generate(prompts, params), on.generate(prompts, params)):
            assert a["output_ids"] == b["output_ids"] and a["text"] == b["text"]
        stats = on.get_stats()
        assert stats["spec_draft_tokens"] > 0 and stats["jump_forward_tokens"] > 0
        integrity(on)
    finally:
        off.shutdown()
        on.shutdown()


def test_standalone_trees_match_plain_decoding(target, plain, integrity):
    """A draft model's trees (top-k 2, 2 steps, all 6 nodes): with the target as its own draft
    each verify accepts a whole path of the tree's depth (the greedy path is in every complete
    tree), so the accepted tokens are what the depths predict; with a
    perturbed copy as the draft, part of them. Tokens, logprobs and both KV pools as plain
    decoding's; the draft keeps none of a tree's KV (its next catch-up computes the kept
    tokens)."""
    import radixlm

    from test_speculative_standalone import _perturbed

    other = _perturbed(target[1], str(target[0] / "perturbed"), 0.01)
    prompts = _prompts(5)
    kw = dict(return_logprob=True, top_logprobs_num=2)
    params = [_greedy(), _greedy(max_new_tokens=9), _greedy(max_new_tokens=20)]
    ref = plain.generate(input_ids=prompts[:3], sampling_params=params, **kw)
    # (penalties apply in the verify, not to the draft's scores: its greedy path is then no
    # longer always in the tree)
    penalized = dict(input_ids=prompts[3:], sampling_params=_greedy(frequency_penalty=0.3))
    ref_penalized = plain.generate(**penalized)
    for draft in (target[1], other):
        eng = radixlm.Engine(model_path=target[1], speculative_algorithm="STANDALONE",
                             speculative_adaptive=False, speculative_draft_model_path=draft,
                             speculative_eagle_topk=2, speculative_num_steps=2,
                             speculative_num_draft_tokens=7, **KW)
        try:
            outs = eng.generate(input_ids=prompts[:3], sampling_params=params, **kw)
            for a, b in zip(ref, outs):
                assert a["output_ids"] == b["output_ids"]
                for x, y in zip(a["meta_info"]["output_token_logprobs"],
                                b["meta_info"]["output_token_logprobs"]):
                    assert x[1] == y[1] and abs(x[0] - y[0]) < 2e-4
            stats = eng.get_stats()
            if draft == target[1]:  # (room: min(2, tokens left - 1) a verify)
                want = sum(_predicted(o["output_ids"], set(range(V)), 2, 2, 6)[1] for o in ref)
                assert stats["spec_accepted_tokens"] == want
            else:
                assert 0 < stats["spec_accepted_tokens"] < stats["spec_draft_tokens"]
            assert ([o["output_ids"] for o in eng.generate(**penalized)]
                    == [o["output_ids"] for o in ref_penalized])
            integrity(eng)
        finally:
            eng.shutdown()
