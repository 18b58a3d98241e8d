"""Correctness against the reference: HF transformers on the same GGUF weights, fp32: its loader's
weights and config, greedy tokens, prompt and output logprobs, embeddings.

Every test that needs HF's model of the bundled file (the session fixture hf_smol, ~5 CPU-s to load)
lives here, so that `make test`'s workers (one module each) load it once."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from radixlm.runtime.config import ModelConfig
from radixlm.runtime.models.loader import iter_weights, load_hf_config

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
    """HF's greedy tokens for each prompt, from left-padded batches (HF's own padding: its
    attention mask and the positions generate derives from it): ~4x faster than one each, and
    the same tokens as one each here (checked when this changed). The chat prompts (35-42 tokens)
    and the raw ones (4-14) are two batches: HF computes every pad, and one batch of all 20 was
    44% pads (840 positions for 469 tokens; two batches: 560)."""
    outs = []
    for group in (prompts_ids[:len(CHAT_QUESTIONS)], prompts_ids[len(CHAT_QUESTIONS):]):
        width = max(map(len, group))
        x = torch.tensor([[2] * (width - len(ids)) + ids for ids in group])
        mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in group])
        with torch.no_grad():
            y = hf_smol.generate(x, attention_mask=mask, max_new_tokens=MAX_NEW, do_sample=False,
                                 eos_token_id=2, pad_token_id=2)
        for row in y[:, width:].tolist():  # a row that ended at eos is padded after it
            outs.append(row[:row.index(2) + 1] if 2 in row else row)
    return outs


@pytest.fixture(scope="module")
def hf_logits(hf_smol):
    """`hf_logits(ids)`: HF's fp32 logits for one unpadded sequence, kept for the module (the
    prompt-logprob tests ask for the same prompts at each start)."""
    seen: dict[tuple, torch.Tensor] = {}

    def logits(ids: list[int]) -> torch.Tensor:
        if tuple(ids) not in seen:
            with torch.no_grad():
                seen[tuple(ids)] = hf_smol(torch.tensor([ids])).logits[0].float()
        return seen[tuple(ids)]

    return logits


def test_greedy_matches_hf_one_batch(engine, prompts_ids, hf_outputs, integrity):
    assert len(prompts_ids) >= 20
    outs = engine.generate(input_ids=prompts_ids,
                           sampling_params={"temperature": 0, "max_new_tokens": MAX_NEW})
    for i, (o, ref) in enumerate(zip(outs, hf_outputs)):
        assert o["output_ids"] == ref, f"prompt {i}: {o['text']!r}"
    integrity(engine)


def test_greedy_matches_hf_one_at_a_time(engine, prompts_ids, hf_outputs, integrity):
    """Batch-1 steps (the batch above checks every prompt): four chat and four raw prompts."""
    engine.flush_cache()
    pick = [0, 2, 5, 8, 10, 11, 14, 19]
    for ids, ref in zip([prompts_ids[i] for i in pick], [hf_outputs[i] for i in pick]):
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
def test_prompt_logprobs_match_hf(engine, hf_logits, prompts_ids, start, integrity):
    for ids in prompts_ids[:4] + prompts_ids[10:14]:
        if len(ids) <= start + 1:
            continue
        o = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 0},
                            return_logprob=True, logprob_start_len=start, top_logprobs_num=3)
        logits = hf_logits(ids)
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


def test_gguf_weights_equal_hf(smol_path, hf_smol):
    ours = dict(iter_weights(smol_path, "gguf", torch.float32))
    ref = hf_smol.state_dict()
    # Tied embeddings: HF's state dict also lists lm_head.weight (the same tensor); the file does not.
    assert torch.equal(ref["lm_head.weight"], ref["model.embed_tokens.weight"])
    ref.pop("lm_head.weight")
    ref = {k: v for k, v in ref.items() if "rotary_emb" not in k}  # buffers, not weights
    assert set(ours) == set(ref)
    assert len(ours) == 2 + 30 * 9
    for name, ref_t in ref.items():
        assert ours[name].dtype == torch.float32
        assert ours[name].shape == ref_t.shape, name
        # Same dequantization, same float32 arithmetic: bit-identical, not merely close.
        assert torch.equal(ours[name], ref_t), name


def test_gguf_config_matches_hf(smol_path, hf_smol):
    hf = ModelConfig.from_hf(hf_smol.config.to_dict())
    ours = ModelConfig.from_hf(load_hf_config(smol_path, "gguf"))
    # HF's GGUF config has no `architectures` and keeps eps as float32 (9.99999974e-06).
    assert ours.architecture == "LlamaForCausalLM" and hf.architecture == "llama"
    assert ours.rms_norm_eps == pytest.approx(hf.rms_norm_eps, rel=1e-6)
    assert dataclasses.replace(ours, architecture="llama", rms_norm_eps=hf.rms_norm_eps) == hf


@functools.lru_cache(maxsize=4)  # both chunk sizes compare with the same texts
def _hf_states(hf_smol, ids: tuple[int, ...]) -> torch.Tensor:
    with torch.no_grad():
        out = hf_smol(torch.tensor([ids]), output_hidden_states=True)
    return out.hidden_states[-1][0]  # (T, H), after the final norm


@pytest.mark.parametrize("chunk", [2048, 5])
def test_embeddings_match_hf_hidden_states(make_engine, hf_smol, integrity, chunk):
    eng = make_engine(chunked_prefill_size=chunk)
    texts = ["The capital of France is Paris.", "Radix trees share prefixes"]
    last = eng.encode(texts, pooling="last")
    mean = eng.encode(texts[0], pooling="mean")
    again = eng.encode(texts[0], pooling="last")  # served with a cached prefix this time
    for text, res in zip(texts, last):
        ids = eng.tokenizer.encode(text)
        ref = torch.nn.functional.normalize(_hf_states(hf_smol, tuple(ids))[-1], dim=-1)
        got = torch.tensor(res["embedding"])
        assert got.shape == ref.shape and torch.allclose(got, ref, atol=2e-3)
        assert res["meta_info"]["prompt_tokens"] == len(ids)
    assert torch.allclose(torch.tensor(again["embedding"]), torch.tensor(last[0]["embedding"]),
                          atol=1e-4)
    ids = eng.tokenizer.encode(texts[0])
    ref = torch.nn.functional.normalize(_hf_states(hf_smol, tuple(ids)).mean(0), dim=-1)
    assert torch.allclose(torch.tensor(mean["embedding"]), ref, atol=2e-3)
    integrity(eng)
