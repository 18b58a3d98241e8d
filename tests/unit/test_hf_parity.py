"""Correctness against the reference: HF transformers on the same GGUF weights, fp32, greedy."""

from __future__ import annotations

import pytest
import torch

CHAT_QUESTIONS = [
    "What is the capital of France?",
    "What is 12 + 7? Answer briefly.",
    "Write a haiku about the sea.",
    "List three primary colors.",
    "Translate 'good morning' into Spanish.",
    "Explain what a CPU does in one sentence.",
    "Give me a synonym for 'happy'.",
    "Who wrote Romeo and Juliet?",
    "What is the boiling point of water in Celsius?",
    "Name a mammal that can fly.",
]
RAW_PROMPTS = [
    "The quick brown fox",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village,",
    "1, 2, 3, 4, 5,",
    "The three laws of thermodynamics are",
    "Paris is the capital of",
    "import numpy as np\n\nx = np.",
    "Q: What color is the sky?\nA:",
    "In 1969, the first humans",
    "<html>\n  <head>\n    <title>",
]
MAX_NEW = 24


@pytest.fixture(scope="module")
def prompts_ids(engine):
    tok = engine.tokenizer
    chat = [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                    add_generation_prompt=True) for q in CHAT_QUESTIONS]
    return [tok.encode(p) for p in chat + RAW_PROMPTS]


@pytest.fixture(scope="module")
def hf_outputs(hf_smol, prompts_ids):
    outs = []
    for ids in prompts_ids:
        x = torch.tensor([ids])
        with torch.no_grad():
            y = hf_smol.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=MAX_NEW,
                                 do_sample=False, eos_token_id=2, pad_token_id=2)
        outs.append(y[0, len(ids):].tolist())
    return outs


def test_greedy_matches_hf_one_batch(engine, prompts_ids, hf_outputs, integrity):
    assert len(prompts_ids) >= 20
    outs = engine.generate(input_ids=prompts_ids,
                           sampling_params={"temperature": 0, "max_new_tokens": MAX_NEW})
    for i, (o, ref) in enumerate(zip(outs, hf_outputs)):
        assert o["output_ids"] == ref, f"prompt {i}: {o['text']!r}"
    integrity(engine)


def test_greedy_matches_hf_one_at_a_time(engine, prompts_ids, hf_outputs, integrity):
    engine.flush_cache()
    for ids, ref in zip(prompts_ids, hf_outputs):
        o = engine.generate(input_ids=ids, sampling_params={"temperature": 0, "max_new_tokens": MAX_NEW})
        assert o["output_ids"] == ref
    integrity(engine)


def test_chat_answer_text(engine, integrity):
    tok = engine.tokenizer
    p = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                tokenize=False, add_generation_prompt=True)
    o = engine.generate(p, {"temperature": 0, "max_new_tokens": 30})
    assert o["text"] == "The capital of France is Paris."
    assert o["meta_info"]["finish_reason"] == {"type": "stop", "matched": 2}
    integrity(engine)


@pytest.mark.parametrize("start", [0, 5])
def test_prompt_logprobs_match_hf(engine, hf_smol, prompts_ids, start, integrity):
    for ids in prompts_ids[:4] + prompts_ids[10:14]:
        if len(ids) <= start + 1:
            continue
        o = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 0},
                            return_logprob=True, logprob_start_len=start, top_logprobs_num=3)
        with torch.no_grad():
            logits = hf_smol(torch.tensor([ids])).logits[0].float()
        ref = torch.log_softmax(logits, -1)[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
        got = o["meta_info"]["input_token_logprobs"]
        assert len(got) == len(ids) - start
        assert [t for _, t, _ in got] == ids[start:]
        if start == 0:
            assert got[0][0] is None  # the first token has nothing to be scored against
        vals = torch.tensor([lp for lp, _, _ in got[1 if start == 0 else 0:]])
        torch.testing.assert_close(vals, ref[max(start, 1) - 1:], atol=1e-3, rtol=0)
        top = o["meta_info"]["input_top_logprobs"][-1]
        ref_top = torch.log_softmax(logits[-2], -1).topk(3)
        assert [t for _, t, _ in top] == ref_top.indices.tolist()
        assert o["output_ids"] == [] and o["meta_info"]["completion_tokens"] == 0
    integrity(engine)


def test_output_logprobs_match_hf(engine, hf_smol, prompts_ids, integrity):
    ids = prompts_ids[0]
    o = engine.generate(input_ids=ids, sampling_params={"temperature": 0, "max_new_tokens": 6},
                        return_logprob=True, top_logprobs_num=2)
    full = ids + o["output_ids"]
    with torch.no_grad():
        logits = hf_smol(torch.tensor([full])).logits[0].float()
    lps = torch.log_softmax(logits, -1)
    n = len(o["output_ids"])
    ref = lps[len(ids) - 1 : len(ids) - 1 + n].gather(1, torch.tensor(o["output_ids"])[:, None])[:, 0]
    got = torch.tensor([lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]])
    torch.testing.assert_close(got, ref, atol=1e-3, rtol=0)
    assert all(len(t) == 2 for t in o["meta_info"]["output_top_logprobs"])
    integrity(engine)
