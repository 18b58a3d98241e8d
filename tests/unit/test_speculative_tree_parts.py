"""Draft trees' parts without a model (speculative/tree.py, tree_verify.py, draft_tree.py,
grammar_drafts.py): the multi-candidate acceptance keeps the target's distribution (chi-square
on a tiny vocabulary, every sampling parameter on), greedy rows take the argmax's child, each
row counts its own path for penalties and min-tokens, the tree's nodes are the best and closed
under parents, grammars prune and mask per node, tree sizes stay within the rows, the flags.
Engines: test_speculative_tree.py."""

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
