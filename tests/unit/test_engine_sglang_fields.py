"""SGLang request fields through the real scheduler (offline Engine, SmolLM2 fp32): stop_regex,
logit_bias, token_ids_logprob and a null max_new_tokens. (Embeddings, checked against HF's hidden
states, are in test_hf_parity.py, which holds HF's model.)"""

from __future__ import annotations

import json

import pytest

GREEDY = {"temperature": 0, "max_new_tokens": 24}
COUNT = "Count: 1, 2, 3,"


def test_stop_regex_keeps_the_match(engine, integrity):
    plain = engine.generate(COUNT, GREEDY)
    assert plain["text"].startswith(" 4, 5, 6")
    o = engine.generate(COUNT, {**GREEDY, "stop_regex": r"[6-7]"})
    assert o["text"] == " 4, 5, 6"  # through the token that completed the match, untrimmed
    assert o["meta_info"]["finish_reason"] == {"type": "stop", "matched": "[6-7]"}
    assert {"id", "prompt_tokens", "completion_tokens", "cached_tokens", "weight_version",
            "total_retractions"} <= set(o["meta_info"])
    assert o["output_ids"] == plain["output_ids"][: len(o["output_ids"])]
    # the frontend's defaults (every field, empty stop lists, null constraints) change nothing
    frontend = {**GREEDY, "stop": [], "stop_regex": [], "stop_token_ids": [], "n": 1,
                "regex": None, "json_schema": None, "top_k": -1, "min_p": 0.0,
                "sampling_seed": None, "custom_params": None, "logit_bias": None}
    assert engine.generate(COUNT, frontend)["output_ids"] == plain["output_ids"]
    integrity(engine)


def test_logit_bias_and_null_max_new_tokens(engine, integrity):
    tok = engine.tokenizer.encode(" banana", add_special_tokens=False)[0]
    o = engine.generate(COUNT, {**GREEDY, "max_new_tokens": 4, "logit_bias": {str(tok): 100}})
    assert o["output_ids"] == [tok] * 4
    # null max_new_tokens: no limit but the context (SGLang); a stop_regex ends it here
    o = engine.generate(COUNT, {"temperature": 0, "max_new_tokens": None, "stop_regex": r"1\d"})
    assert o["meta_info"]["finish_reason"]["type"] == "stop" and o["text"].endswith("10")
    integrity(engine)


def test_token_ids_logprob_matches_the_chosen_token_logprob(engine, integrity):
    o = engine.generate(COUNT, {**GREEDY, "max_new_tokens": 6}, return_logprob=True,
                        logprob_start_len=0, top_logprobs_num=3, token_ids_logprob=[33, 34])
    m = o["meta_info"]
    out, tops, ids_lp = m["output_token_logprobs"], m["output_top_logprobs"], m["output_token_ids_logprobs"]
    assert len(ids_lp) == len(out) == len(o["output_ids"])
    for (lp, tid, _), top, entries in zip(out, tops, ids_lp):
        assert [e[1] for e in entries] == [33, 34]
        for v, t, _ in top:  # the same distribution: top-k values agree where the ids meet
            for ev, et, _ in entries:
                if et == t:
                    assert ev == pytest.approx(v, abs=1e-5)
        assert all(ev <= top[0][0] + 1e-6 for ev, _, _ in entries)
    assert m["input_token_ids_logprobs"][0] is None  # the first prompt token is not scored
    assert len(m["input_token_ids_logprobs"]) == m["prompt_tokens"]
    # a one-token prompt: its one entry is that None (it was an empty list)
    one = engine.tokenizer.encode("Hi", add_special_tokens=False)
    assert len(one) == 1
    o = engine.generate(input_ids=one, sampling_params={**GREEDY, "max_new_tokens": 2},
                        return_logprob=True, logprob_start_len=0, top_logprobs_num=2,
                        token_ids_logprob=[33])
    m = o["meta_info"]
    assert m["prompt_tokens"] == 1 and len(m["output_token_logprobs"]) == 2
    assert [list(t) for t in m["input_token_logprobs"]] == [[None, one[0], None]]
    assert m["input_top_logprobs"] == [None] and m["input_token_ids_logprobs"] == [None]
    integrity(engine)


def test_structural_tag_constrains_the_output(engine, integrity):
    tag = {"type": "structural_tag", "format": {
        "type": "tag", "begin": "<f>", "end": "</f>",
        "content": {"type": "json_schema", "json_schema": {
            "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
            "additionalProperties": False}}}}
    o = engine.generate("Call f:", {"temperature": 0, "max_new_tokens": 40,
                                    "structural_tag": json.dumps(tag)})
    text = o["text"]
    assert text.startswith("<f>") and text.endswith("</f>"), text
    assert isinstance(json.loads(text[3:-4])["a"], int)
    assert o["meta_info"]["finish_reason"]["type"] == "stop"  # the grammar ended it
    integrity(engine)
