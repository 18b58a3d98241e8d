"""The peer benchmark's pure logic (benchmarks/peers): deterministic prompts of the right shapes,
fresh prompts per round, the result lines' ratio. Needs neither vLLM nor the model: a word-level
stand-in tokenizer and a tiny ShareGPT file keep it fast."""

import json
import os
import sys
import zlib

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from benchmarks.peers import compare  # noqa: E402
from benchmarks.peers import workloads as wl  # noqa: E402


class WordTokenizer:
    """One id per space-separated word (ids 0-2 special), like the real one for the word texts."""

    all_special_ids = [0, 1, 2]
    added_tokens_decoder: dict = {}

    def __len__(self):
        return 600

    def _id(self, word: str) -> int:
        return 3 + zlib.crc32(word.encode()) % 597

    def __call__(self, texts, add_special_tokens=False):
        return {"input_ids": [[self._id(w) for w in t.split()] for t in texts]}

    def decode(self, ids):
        return " ".join(f"w{i}" for i in ids)


@pytest.fixture(scope="module")
def tok():
    return WordTokenizer()


@pytest.fixture()
def sharegpt_file(tmp_path):
    convs = []
    for i in range(200):
        q = " ".join(f"q{i}x{j}" for j in range(5 + i % 30))
        a = " ".join(f"a{i}x{j}" for j in range(4 + (i * 37) % 400))
        convs.append({"id": str(i), "conversations": [{"from": "human", "value": q},
                                                      {"from": "gpt", "value": a}]})
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(convs))
    return str(path)


def test_round_seeds_are_distinct_and_stable():
    seeds = {(w, r): wl.round_seed(0, r, w) for w in wl.ALL for r in (1, 2, 3)}
    assert len(set(seeds.values())) == len(seeds)
    assert wl.round_seed(0, 1, "short") == seeds[("short", 1)]
    assert wl.round_seed(1, 1, "short") != seeds[("short", 1)]
    with pytest.raises(ValueError):
        wl.round_seed(0, 0, "short")


def test_sizes_presets_and_overrides():
    full = wl.sizes()
    assert (full.sp_num, full.sp_shared_len, full.sp_own_len, full.sp_output_len) == (64, 1000, 20, 32)
    assert (full.short_num, full.short_input_len, full.short_output_len) == (32, 200, 64)
    assert (full.sharegpt_num, full.sharegpt_output_cap) == (64, 256)
    assert full.fewshot_num >= 100 and full.fewshot_shots == 5 and full.chat_turns == 4
    assert wl.sizes("small", sp_num=3).sp_num == 3
    with pytest.raises(TypeError):
        wl.sizes(bogus=1)
    with pytest.raises(ValueError):
        wl.sizes("huge")


def test_shared_prefix_shapes_and_fresh_prefix_per_round(tok):
    sz = wl.sizes("small", sp_num=6, sp_shared_len=50, sp_own_len=7, sp_output_len=5)
    r1 = wl.offline_workload("shared-prefix", 1, tok, sz)
    assert len(r1.prompt_ids) == 6 and r1.output_lens == [5] * 6
    assert all(len(p) == 57 for p in r1.prompt_ids)
    assert len({tuple(p[:50]) for p in r1.prompt_ids}) == 1  # one shared prefix
    assert len({tuple(p[50:]) for p in r1.prompt_ids}) == 6  # own suffixes
    again = wl.offline_workload("shared-prefix", 1, tok, sz)
    assert again.prompt_ids == r1.prompt_ids
    r2 = wl.offline_workload("shared-prefix", 2, tok, sz)
    assert r2.prompt_ids[0][:50] != r1.prompt_ids[0][:50]  # round 2: a new shared prefix
    assert r1.summary() == {"num_prompts": 6, "total_input_tokens": 342, "total_output_tokens": 30}


def test_short_exact_lengths_no_specials_fresh_per_round(tok):
    sz = wl.sizes("small", short_num=5, short_input_len=40, short_output_len=9)
    r1 = wl.offline_workload("short", 1, tok, sz)
    assert [len(p) for p in r1.prompt_ids] == [40] * 5 and r1.output_lens == [9] * 5
    assert not any(i in tok.all_special_ids for p in r1.prompt_ids for i in p)
    assert wl.offline_workload("short", 1, tok, sz).prompt_ids == r1.prompt_ids
    r2 = wl.offline_workload("short", 2, tok, sz)
    assert not set(map(tuple, r1.prompt_ids)) & set(map(tuple, r2.prompt_ids))


def test_sharegpt_caps_outputs_and_rounds_differ(tok, sharegpt_file):
    sz = wl.sizes("small", sharegpt_num=10, sharegpt_output_cap=64)
    r1 = wl.offline_workload("sharegpt", 1, tok, sz, sharegpt_path=sharegpt_file)
    assert len(r1.prompt_ids) == 10
    assert all(4 <= n <= 64 for n in r1.output_lens)
    assert any(n == 64 for n in r1.output_lens)  # some replies are longer than the cap
    assert wl.offline_workload("sharegpt", 1, tok, sz, sharegpt_path=sharegpt_file).prompt_ids == r1.prompt_ids
    r2 = wl.offline_workload("sharegpt", 2, tok, sz, sharegpt_path=sharegpt_file)
    assert r2.prompt_ids != r1.prompt_ids


def test_unknown_offline_workload(tok):
    with pytest.raises(ValueError):
        wl.offline_workload("few-shot", 1, tok)


def test_offline_file_round_trip(tok, tmp_path):
    sz = wl.sizes("small", short_num=2, short_input_len=8, short_output_len=3)
    ws = [wl.offline_workload("short", r, tok, sz) for r in (1, 2)]
    path = str(tmp_path / "w.json")
    wl.write_offline(path, ws)
    back = wl.read_offline(path)
    assert [w.to_json() for w in back] == [w.to_json() for w in ws]


def test_fewshot_args_shared_shots_and_correct_answers():
    sz = wl.sizes("small", fewshot_num=12)
    shots, qs = wl.fewshot_args(1, sz)
    assert shots.count("\nAnswer: ") == 5 and len(qs) == 12
    assert all(q["question"].endswith("\nAnswer:") and q["question"].count("\n") == 5 for q in qs)
    assert wl.fewshot_args(1, sz) == (shots, qs)
    shots2, qs2 = wl.fewshot_args(2, sz)
    assert shots2 != shots and qs2 != qs
    # every shot's answer letter points at the right number
    for block in shots.split("\n\n")[1:-1]:
        lines = block.split("\n")
        stem, opts, ans = lines[0], lines[1:5], lines[5]
        value = dict(o.split(". ", 1) for o in opts)[ans.split(": ")[1]]
        expr = stem.rsplit("What is ", 1)[-1].rstrip("?") if "What is" in stem else None
        if expr is not None:
            assert int(value) == eval(expr.replace(" x ", " * "))  # noqa: S307 (generated digits)
        else:
            nums = [int(x) for x in stem.rsplit("largest of ", 1)[1].rstrip("?").split(", ")]
            assert int(value) == max(nums)


def test_chat_and_tot_args():
    sz = wl.sizes("small", chat_num=3, chat_turns=4, chat_user_words=10, tot_num=5)
    chats = wl.chat_args(1, sz)
    assert len(chats) == 3 and all(len(c["turns"]) == 4 for c in chats)
    assert all(len(t.split()) == 10 for c in chats for t in c["turns"])
    assert wl.chat_args(1, sz) == chats and wl.chat_args(2, sz) != chats
    tots = wl.tot_args(1, sz)
    assert len(tots) == 5 and wl.tot_args(1, sz) == tots and wl.tot_args(2, sz) != tots


def test_compare_lines_ratio_and_agreement():
    def side(elapsed, outs, startup):
        return {"version": "x", "torch": "t", "startup_s": startup, "results": [
            {"workload": "short", "round": 1, "elapsed_s": elapsed, "num_prompts": 2,
             "total_input_tokens": 10, "total_output_tokens": 6, "completion_tokens": 6,
             "cached_tokens": 0, "output_ids": outs}]}
    rl = side(2.0, [[1, 2, 3], [4, 5, 6]], 10.0)
    v = side(5.0, [[1, 2, 3], [4, 9, 6]], 100.0)
    (line,) = compare.offline_lines(rl, v)
    assert line["ratio"] == 2.5 and line["radixlm_s"] == 2.0 and line["vllm_s"] == 5.0
    assert line["identical_outputs"] == 1 and line["mean_agreeing_prefix_tokens"] == 2.0
    assert line["vllm_startup_s"] == 100.0

    prl = {"startup_s": 3, "results": [
        {"workload": "few-shot", "round": 1, "backend": "openai", "elapsed_s": 4.0,
         "num_programs": 8, "num_gens": 8, "generated_tokens": 8},
        {"workload": "few-shot", "round": 1, "backend": "radixlm", "elapsed_s": 2.0,
         "num_programs": 8, "num_gens": 8, "generated_tokens": 8}]}
    pv = {"startup_s": 90, "results": [
        {"workload": "few-shot", "round": 1, "backend": "openai", "elapsed_s": 6.0,
         "num_programs": 8, "num_gens": 8, "generated_tokens": 8}]}
    (pl,) = compare.program_lines(prl, pv)
    assert pl["ratio"] == 1.5 and pl["radixlm_native_s"] == 2.0 and pl["native_ratio"] == 3.0
