"""Draft trees (EAGLE3, --speculative-eagle-topk > 1), fp32 on the CPU: the multi-candidate
acceptance keeps the target's distribution (chi-square on a tiny vocabulary, every sampling
parameter on), the tree's nodes are the best and closed under parents, and on a tiny random
Llama with random heads (tests/tiny_models.py) the tokens equal plain decoding's: a complete
tree's accepted counts equal what its shape predicts, and penalties, logprobs, cache hits,
n > 1, stop tokens, regexes, chunked prefill and retraction keep plain decoding's tokens; the
KV accounting holds after every engine test."""

from __future__ import annotations

import pytest
import torch

from radixlm.runtime.config import ServerArgs
from radixlm.runtime.request import Req
from radixlm.runtime.sampling.sampler import Sampler
from radixlm.runtime.sampling.sampling_batch_info import SamplingBatchInfo
from radixlm.runtime.sampling_params import SamplingParams
from radixlm.runtime.speculative import spec_config
from radixlm.runtime.speculative.tree import DraftTree, accept_tree_rows, select_tree

VS = 8  # the acceptance tests' vocabulary
CHI2_9999 = {1: 15.14, 2: 18.42, 3: 21.11, 4: 23.51, 5: 25.75, 6: 27.86, 7: 29.88}


def _req(**params) -> Req:
    sp = SamplingParams(**params)
    sp.verify(VS)
    req = Req("r", [1, 2, 3], sp)
    req.output_ids = [7, 7, 0]
    return req


@pytest.mark.parametrize("children", [[7, 0], [3, 7, 1], [5, 6, 4, 2], [0, 1, 2, 3, 4, 5, 6, 7]])
def test_multi_candidate_acceptance_keeps_the_target_distribution(children):
    """Children tried in order (top token first, tokens outside top-k / top-p, all of them):
    the emitted token, an accepted child's or the residual's draw, follows p."""
    torch.manual_seed(0)
    logits = torch.tensor([2.0, 1.5, 1.0, 0.4, 0.0, -0.5, -1.0, 2.6])
    req = _req(temperature=0.8, top_k=5, top_p=0.97, min_p=0.03, frequency_penalty=0.5,
               presence_penalty=0.1, logit_bias={"3": 1.0})
    base = SamplingBatchInfo.from_reqs([req], VS, "cpu")
    ref = logits.view(1, -1).clone()
    base.take([0]).apply_penalties_and_masks(ref)
    p = Sampler().filtered_probs(ref, base)[0]
    p = p / p.sum()
    support = p > 0
    n = 40000
    kids = torch.tensor(children + [-1] * (VS - len(children))).expand(n, VS).clone()
    choice, token = accept_tree_rows(logits.expand(n, VS).clone(), base.take([0] * n),
                                     [req] * n, kids, Sampler())
    emitted = torch.where(choice >= 0, kids.gather(1, choice.clamp(min=0).view(-1, 1)).view(-1),
                          token)
    assert (choice < len(children)).all()
    counts = torch.bincount(emitted, minlength=VS).double()
    assert counts[~support].sum() == 0
    expected = p[support].double() * n
    chi2 = float(((counts[support] - expected) ** 2 / expected).sum())
    assert chi2 < CHI2_9999[int(support.sum()) - 1], (chi2, counts.tolist())


def test_greedy_rows_take_the_child_holding_the_argmax():
    logits = torch.tensor([[0.0, 3.0, 1.0, 0, 0, 0, 0, 0], [5.0, 0, 1.0, 0, 0, 0, 0, 0]] * 2)
    kids = torch.tensor([[2, 1], [2, 1], [-1, -1], [1, 2]])
    req = _req(temperature=0)
    info = SamplingBatchInfo.from_reqs([req] * 4, VS, "cpu")
    choice, token = accept_tree_rows(logits, info, [req] * 4, kids, Sampler())
    assert choice.tolist() == [1, -1, -1, -1] and token.tolist() == [1, 0, 1, 0]


def test_tree_rows_count_their_paths_drafts_for_min_tokens_and_penalties():
    """verify_tree on a hand-made plan, one request, a chain-shaped tree root -> a -> b: with
    2 tokens to go before its stop token may come, the root's row and a's (depth 1) mask it and
    b's (depth 2) does not; a frequency penalty counts each row's path (b's row sees a and b)."""
    from radixlm.runtime.speculative.tree_verify import TreePlan, verify_tree

    req = _req(temperature=0, min_new_tokens=5, frequency_penalty=2.0)
    req.stop_token_ids = {6}
    info = SamplingBatchInfo.from_reqs([req], VS, "cpu")  # 3 outputs so far: 2 to go
    logits = torch.tensor([[0, 0, 0, 0, 4.0, 2.0, 9.0, 0],  # stop masked: 4 (a)
                           [0, 0, 0, 0, 4.0, 3.5, 9.0, 0],  # stop masked; 4 penalized: 5 (b)
                           [0, 0, 0, 0, 4.0, 3.5, 9.0, 0]])  # the stop token, allowed now
    dev = {"row_b": torch.zeros(3, dtype=torch.int64), "depth": torch.tensor([0, 1, 2]),
           "info_row": torch.zeros(3, dtype=torch.int64),
           "children": torch.tensor([[4], [5], [-1]]),
           "ancestors": torch.tensor([[-1, -1], [4, -1], [4, 5]])}
    plan = TreePlan([req], [0], [[4, 5]], [0], [10], torch.arange(3), [0, 0, 0], dev,
                    children=[[1], [2], []])
    res = verify_tree(logits, plan, info, Sampler(), lambda x: None, False, 0)
    assert res.tokens == [[4, 5, 6]] and res.accepted == [2] and res.paths == [[0, 1, 2]]


def test_select_tree_takes_the_best_nodes_parents_first():
    # level 1: a (-0.1), b (-1.0); level 2 below a: c (-0.3), d (-0.1: a tie with its parent)
    tree = select_tree([-0.1, -1.0, -0.3, -0.1], [10, 11, 12, 13], [-1, -1, 0, 0], [1, 1, 2, 2],
                       n=3, max_depth=2)
    assert tree == DraftTree([10, 13, 12], [-1, 0, 0]) and tree.depth == 2
    assert tree.depths() == [1, 2, 2]
    shallow = select_tree([-0.1, -1.0, -0.3, -0.1], [10, 11, 12, 13], [-1, -1, 0, 0],
                          [1, 1, 2, 2], n=3, max_depth=1)
    assert shallow == DraftTree([10, 11], [-1, -1])


class EvenTokens:
    """A grammar matcher over even token ids, ending after 3 tokens (or at token 0)."""

    def __init__(self):
        self.toks: list[int] = []

    def is_terminated(self) -> bool:
        return len(self.toks) == 3 or (bool(self.toks) and self.toks[-1] == 0)

    def accept_token(self, t: int) -> bool:
        if self.is_terminated() or t % 2:
            return False
        self.toks.append(t)
        return True

    def rollback(self, n: int) -> None:
        del self.toks[len(self.toks) - n :]

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row] = len(self.toks)  # (which state the row's mask was filled in)


def test_grammar_prunes_and_masks_a_tree_along_each_path():
    from radixlm.runtime.speculative.grammar_drafts import fill_tree_rows, prune_tree

    #      root -> 2 -> 4 -> 6          (6: the grammar's third token, it ends there)
    #           |    `-> 5              (odd: pruned)
    #           |-> 3 -> 8              (odd 3 pruned, its child with it)
    #           `-> 0 -> 2              (0 ends the grammar: its child pruned)
    tree = DraftTree([2, 3, 0, 4, 5, 8, 2, 6], [-1, -1, -1, 0, 0, 1, 2, 3])
    req = _req()
    req.stop_token_ids = set()
    req.grammar = EvenTokens()
    req.grammar.toks = []
    pruned = prune_tree(req, tree)
    assert pruned == DraftTree([2, 0, 4, 6], [-1, -1, 0, 2]) and req.grammar.toks == []
    bitmask = torch.full((5, 1), -1, dtype=torch.int32)
    rows = fill_tree_rows(req, pruned, 0, bitmask)
    # root: state 0; node 2 (path [2]): 1; node 0 ended the grammar, node 4 (path [2, 4]): 2;
    # node 6 ended it (three tokens): unfilled, never kept
    assert rows == [0, 1, 3] and bitmask.view(-1).tolist() == [0, 1, -1, 2, -1]
    assert req.grammar.toks == []
    req.grammar, req.stop_token_ids = None, {4}  # no grammar: nothing below a stop token
    assert prune_tree(req, tree) == DraftTree([2, 3, 0, 4, 5, 8, 2], [-1, -1, -1, 0, 0, 1, 2])


def test_tree_sizes_stay_within_the_verify_rows_and_the_scratch_rows():
    from radixlm.runtime.speculative.draft_tree import tree_sizes

    cfg = spec_config.resolve(ServerArgs(speculative_algorithm="EAGLE3", speculative_eagle_topk=2,
                                         speculative_draft_model_path="x"))  # 6 nodes at most
    ks = [3, 1, 0, 2]
    assert tree_sizes(cfg, 128, None, ks) == [6, 2, 0, 6] and ks == [3, 1, 0, 2]
    ks = [3, 3, 3]  # 3 rows + 6 + 6 fit 16 verify rows; a third tree does not
    assert tree_sizes(cfg, 128, 16, ks) == [6, 6, 0] and ks == [3, 3, 0]
    ks = [3, 1, 2]  # 8 scratch rows: 6 nodes, then 2 more; a third tree's nodes would not fit
    assert tree_sizes(cfg, 8, None, ks) == [6, 2, 0] and ks == [3, 1, 0]


def test_tree_flags():
    def resolve(**kw):
        return spec_config.resolve(ServerArgs(speculative_algorithm="EAGLE3",
                                              speculative_draft_model_path="x", **kw))

    cfg = resolve(speculative_eagle_topk=4, speculative_num_steps=3,
                  speculative_num_draft_tokens=12)
    assert (cfg.topk, cfg.steps, cfg.max_draft, cfg.tree_candidates(3)) == (4, 3, 11, 36)
    assert resolve(speculative_eagle_topk=2).max_draft == 6  # 3 steps, 1 + 3 * 2 tokens
    assert resolve(speculative_eagle_topk=1).topk == 1
    for kw, name in (({"speculative_eagle_topk": 0}, "speculative_eagle_topk"),
                     ({"speculative_eagle_topk": 2, "speculative_num_steps": 1,
                       "speculative_num_draft_tokens": 4}, "speculative_num_draft_tokens")):
        with pytest.raises(ValueError, match=name):
            resolve(**kw)
    with pytest.raises(ValueError, match="speculative_eagle_topk=2: draft trees are built"):
        spec_config.resolve(ServerArgs(speculative_algorithm="NGRAM", speculative_eagle_topk=2))


# --- engines -------------------------------------------------------------------------------------
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


def _prompts(seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    ids = lambda n: torch.randint(0, V, (n,), generator=g).tolist()  # noqa: E731
    shared = ids(30)
    return [ids(n) for n in (3, 17, 60)] + [shared + ids(5), shared + ids(40)]


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


def test_tree_greedy_tokens_match_plain_decoding(plain, tree_engine, integrity):
    eng = tree_engine[0]
    prompts = _prompts(1)
    params = [_greedy(), _greedy(frequency_penalty=0.5, presence_penalty=0.3),
              _greedy(repetition_penalty=1.3, logit_bias={"7": 3.0}),
              _greedy(min_new_tokens=8, max_new_tokens=20), _greedy(max_new_tokens=9)]
    kw = dict(return_logprob=True, top_logprobs_num=2)
    ref = plain.generate(input_ids=prompts, sampling_params=params, **kw)
    for round_ in range(2):  # round 2: the radix cache serves the prompts (and the head's rows)
        before = eng.get_stats()
        outs = eng.generate(input_ids=prompts, sampling_params=params, **kw)
        for a, b in zip(ref, outs):
            assert a["output_ids"] == b["output_ids"]
            for x, y in zip(a["meta_info"]["output_token_logprobs"],
                            b["meta_info"]["output_token_logprobs"]):
                assert x[1] == y[1] and abs(x[0] - y[0]) < 2e-4
            assert a["meta_info"]["output_top_logprobs"][-1][1][1] == \
                b["meta_info"]["output_top_logprobs"][-1][1][1]
        assert eng.get_stats()["spec_draft_tokens"] - before["spec_draft_tokens"] > 300
        if round_ == 1:
            assert all(o["meta_info"]["cached_tokens"] > 0 for o in outs)
    one = plain.generate(input_ids=prompts[1], sampling_params=_greedy())
    n2 = eng.generate(input_ids=prompts[1], sampling_params=_greedy(n=2))
    assert [o["output_ids"] for o in n2] == [one["output_ids"]] * 2
    integrity(eng)


def test_tree_stop_tokens_sampling_seeds_and_abort(plain, tree_engine, integrity):
    eng = tree_engine[0]
    prompts = _prompts(2)[:3]
    ref = plain.generate(input_ids=prompts, sampling_params=_greedy())
    stops = [_greedy(stop_token_ids=[o["output_ids"][5]], ignore_eos=False) for o in ref]
    a = plain.generate(input_ids=prompts, sampling_params=stops)
    b = eng.generate(input_ids=prompts, sampling_params=stops)
    assert [o["output_ids"] for o in a] == [o["output_ids"] for o in b]
    assert all(len(o["output_ids"]) <= 6 for o in b)
    params = {"temperature": 0.9, "top_k": 40, "top_p": 0.95, "min_p": 0.01,
              "frequency_penalty": 0.2, "max_new_tokens": 24, "ignore_eos": True, "seed": 11}
    first = eng.generate(input_ids=prompts, sampling_params=params)
    again = eng.generate(input_ids=prompts[::-1], sampling_params=params)[::-1]
    assert [o["output_ids"] for o in first] == [o["output_ids"] for o in again]
    outs = eng.generate(input_ids=prompts[:1], sampling_params=dict(params, n=3, seed=None))
    assert len(outs) == 3 and all(len(o["output_ids"]) == 24 for o in outs)
    stream = eng.generate(input_ids=prompts[2], sampling_params=_greedy(max_new_tokens=400),
                          stream=True, rid="tree-abort")
    next(stream)
    eng.abort_request("tree-abort")
    assert list(stream)[-1]["meta_info"]["finish_reason"]["type"] == "abort"
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
        g = torch.Generator().manual_seed(3)
        ids = lambda n: torch.randint(0, V, (n,), generator=g).tolist()  # noqa: E731
        shared = ids(60)
        prompts = [shared + ids(n) for n in (4, 9, 13)] + [ids(90), ids(20)]
        params = _greedy(max_new_tokens=40)
        on = eng.generate(input_ids=prompts, sampling_params=params)
        off = plain.generate(input_ids=prompts, sampling_params=params)
        assert [o["output_ids"] for o in on] == [o["output_ids"] for o in off]
        stats = eng.get_stats()
        assert stats["retractions"] > 0 and stats["spec_draft_tokens"] > 0
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
