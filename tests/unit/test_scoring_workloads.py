"""The peer benchmark's scoring workloads (benchmarks/peers/scoring_workloads.py) and the pairing
of the two servers' answers (run_scoring.agreement): deterministic prompts of the right shapes,
fresh per round. Needs neither a server nor the model: a word-level stand-in tokenizer and a tiny
ShareGPT file keep it fast."""

import json
import os
import sys
import zlib

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from benchmarks.peers import run_scoring as rs  # noqa: E402
from benchmarks.peers import scoring_workloads as sw  # noqa: E402
from benchmarks.peers import workloads as wl  # noqa: E402


class WordTokenizer:
    """One id per space-separated word (ids 0-2 special); blank text is one separator id 3."""

    all_special_ids = [0, 1, 2]
    added_tokens_decoder: dict = {}

    def __call__(self, texts, add_special_tokens=False):
        return {"input_ids": [[4 + zlib.crc32(w.encode()) % 996 for w in t.split()] or [3]
                              for t in texts]}


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    convs = []
    for i in range(300):
        a = " ".join(f"a{i}x{j}" for j in range(70 + (i * 37) % 300))
        convs.append({"id": str(i), "conversations": [{"from": "human", "value": f"q{i}"},
                                                      {"from": "gpt", "value": a}]})
    path = tmp_path_factory.mktemp("sg") / "sharegpt.json"
    path.write_text(json.dumps(convs))
    return sw.TextPool(WordTokenizer(), num_passages=300, path=str(path))


def test_hellaswag_shapes(pool):
    sz = wl.sizes("full", hs_num=8)
    w = sw.hellaswag_workload(1, pool, sz)
    assert len(w.prompts) == len(w.cont_lens) == len(w.groups) == 8 * sz.hs_endings
    assert w.groups == [q for q in range(8) for _ in range(sz.hs_endings)]
    assert len(w.answers) == 8 and all(0 <= a < sz.hs_endings for a in w.answers)
    shared = w.prompts[0][:sz.hs_shared_len]
    assert shared[-1:] == pool.sep
    for p, n in zip(w.prompts, w.cont_lens):
        assert p[:sz.hs_shared_len] == shared  # one few-shot context for every question
        assert sz.hs_ending_len[0] <= n <= sz.hs_ending_len[1]
        ctx = len(p) - sz.hs_shared_len - n
        assert sz.hs_ctx_len[0] <= ctx <= sz.hs_ctx_len[1]
    for q in range(8):  # a question's endings share its context and differ from each other
        ps = [(p, n) for p, n, g in zip(w.prompts, w.cont_lens, w.groups) if g == q]
        assert len({tuple(p[:len(p) - n]) for p, n in ps}) == 1
        assert len({tuple(p[len(p) - n:]) for p, n in ps}) == sz.hs_endings
    assert w.summary()["scored_tokens"] == sum(w.cont_lens)


def test_scoring_shapes(pool):
    sz = wl.sizes("full", sc_num_contexts=3, sc_context_len=400)
    w = sw.scoring_workload(1, pool, sz)
    assert len(w.prompts) == 3 * sz.sc_continuations and w.answers == []
    for g in range(3):
        ps = [(p, n) for p, n, gg in zip(w.prompts, w.cont_lens, w.groups) if gg == g]
        assert {tuple(p[:len(p) - n]) for p, n in ps} == {tuple(ps[0][0][:400])}
        assert all(len(p) - n == 400 for p, n in ps)
    assert all(0 not in p and 1 not in p and 2 not in p for p in w.prompts)  # no special ids


def test_deterministic_and_fresh_per_round(pool):
    sz = wl.sizes("small")
    a = sw.scoring_workloads(["hellaswag-style", "scoring"], [1, 2], pool, sz)
    b = sw.scoring_workloads(["hellaswag-style", "scoring"], [1, 2], pool, sz)
    assert [x.to_json() for x in a] == [x.to_json() for x in b]
    assert a[0].prompts[0][:sz.hs_shared_len] != a[1].prompts[0][:sz.hs_shared_len]
    assert a[2].prompts[0] != a[3].prompts[0]
    assert set(wl.SCORING) <= set(wl.ALL)
    with pytest.raises(ValueError):
        sw.scoring_workloads(["nope"], [1], pool, sz)


def test_agreement_counts_choices_and_differences():
    w = sw.ScoringWorkload("hellaswag-style", 1, 0, prompts=[[5]] * 4, cont_lens=[2] * 4,
                           groups=[0, 0, 1, 1], answers=[1, 0])
    a = [[-1.0, -2.0], [-0.5, -0.5], [-3.0, -1.0], [-2.0, -1.0]]
    b = [[-1.1, -2.0], [-0.5, -0.6], [-1.0, -1.0], [-2.0, -1.5]]
    res = rs.agreement(w, a, b)
    assert res["logprobs_compared"] == 8 and res["max_abs_diff"] == pytest.approx(2.0)
    assert res["num_choices"] == 2 and res["same_choice"] == 1
    assert res["radixlm_correct"] == 1 and res["vllm_correct"] == 2
