"""Acceptance: the real `openai` and `anthropic` SDKs and plain HTTP against the real server.

Operational endpoints (health, info, flush, abort, metrics, native n) are in
test_acceptance_ops.py.

All tests share the session's fp32 server (`main_server`; `model_name` is its served name, both
from conftest.py); every test that generates ends with the KV integrity check once the server is
idle.
"""

from __future__ import annotations

import uuid

import anthropic
import httpx
import openai
import pytest

from server_harness import http, MAIN_CONTEXT_LEN, sse_events

PROMPTS = [
    "The capital of France is",
    "Here is a short poem about the sea:\n",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Q: What is the boiling point of water at sea level?\nA:",
]


@pytest.fixture(scope="module")
def oai(main_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=main_server.url + "/v1", api_key="unused", max_retries=0,
                         timeout=300)


@pytest.fixture(scope="module")
def claude(main_server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=main_server.url, api_key="unused", max_retries=0,
                               timeout=300)


def greedy(main_server, text: str, n: int) -> dict:
    return main_server.generate(text, max_new_tokens=n, temperature=0)


# --- OpenAI SDK -----------------------------------------------------------------------------------


def test_openai_models(oai, model_name):
    models = oai.models.list().data
    assert [m.id for m in models] == [model_name]
    assert oai.models.retrieve(model_name).id == model_name


def test_openai_completions(main_server, oai, model_name):
    prompt = PROMPTS[0]
    ref = greedy(main_server, prompt, 12)
    # non-streaming, n=2, logprobs with 2 alternatives per token
    r = oai.completions.create(model=model_name, prompt=prompt, max_tokens=12, temperature=0,
                               n=2, logprobs=2)
    assert len(r.choices) == 2 and sorted(c.index for c in r.choices) == [0, 1]
    for c in r.choices:
        assert c.text == ref["text"]  # greedy: both samples are the native greedy text
        assert c.finish_reason in ("stop", "length")
        lp = c.logprobs
        n_tokens = ref["meta_info"]["completion_tokens"]
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n_tokens
        assert all(x <= 0 for x in lp.token_logprobs)
        assert all(1 <= len(t) <= 2 and all(v <= 0 for v in t.values()) for t in lp.top_logprobs)
        assert "".join(lp.tokens) == c.text
    assert r.usage.prompt_tokens == ref["meta_info"]["prompt_tokens"]
    assert r.usage.completion_tokens == 2 * ref["meta_info"]["completion_tokens"]
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens

    # streaming with usage: the deltas add up to the non-streamed text
    text, usage, finish = "", None, None
    for chunk in oai.completions.create(model=model_name, prompt=prompt, max_tokens=12,
                                        temperature=0, stream=True,
                                        stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            text += c.text
            finish = c.finish_reason or finish
    assert text == ref["text"]
    assert finish in ("stop", "length")
    assert usage is not None and usage.completion_tokens == ref["meta_info"]["completion_tokens"]

    # sampled n=2 with a seed: two choices, reproducible
    kw = dict(model=model_name, prompt=prompt, max_tokens=8, temperature=1.0, n=2, seed=1234)
    a, b = oai.completions.create(**kw), oai.completions.create(**kw)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    main_server.check_integrity()


def test_openai_chat(main_server, oai, model_name):
    messages = [{"role": "system", "content": "You are a concise assistant."},
                {"role": "user", "content": "Name three colors."}]
    r = oai.chat.completions.create(model=model_name, messages=messages, max_tokens=16,
                                    temperature=0, n=2, logprobs=True, top_logprobs=3)
    assert len(r.choices) == 2
    texts = [c.message.content for c in r.choices]
    assert texts[0] == texts[1] and texts[0]
    for c in r.choices:
        assert c.message.role == "assistant"
        assert c.finish_reason in ("stop", "length")
        content = c.logprobs.content
        assert len(content) >= 1
        for t in content:
            assert t.logprob <= 0 and len(t.top_logprobs) == 3
            # the sampled (greedy) token is the most likely one
            assert t.logprob == pytest.approx(max(x.logprob for x in t.top_logprobs), abs=1e-4)
    assert r.usage.completion_tokens == sum(len(c.logprobs.content) for c in r.choices)

    # streaming, n=2: per-index deltas add up to the non-streamed text; role comes first
    got = {0: "", 1: ""}
    roles, finishes = set(), {}
    for chunk in oai.chat.completions.create(model=model_name, messages=messages, max_tokens=16,
                                             temperature=0, n=2, stream=True):
        for c in chunk.choices:
            if c.delta.role:
                roles.add(c.index)
            got[c.index] += c.delta.content or ""
            if c.finish_reason:
                finishes[c.index] = c.finish_reason
    assert roles == {0, 1}
    assert got == {0: texts[0], 1: texts[1]}
    assert set(finishes) == {0, 1}
    main_server.check_integrity()


# --- Anthropic SDK --------------------------------------------------------------------------------


def test_anthropic_messages(main_server, claude, model_name):
    kw = dict(model=model_name, max_tokens=16, system="You are a concise assistant.",
              messages=[{"role": "user", "content": "Name three animals."}],
              extra_body={"temperature": 0})  # SDK 2.x takes temperature only as an extra
    m = claude.messages.create(**kw)
    assert m.role == "assistant" and m.type == "message"
    text = m.content[0].text
    assert text and m.stop_reason in ("end_turn", "max_tokens")
    assert m.usage.output_tokens >= 1 and m.usage.input_tokens >= 1

    with claude.messages.stream(**kw) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == text
    assert final.content[0].text == text and final.stop_reason == m.stop_reason

    # a stop sequence that occurs in the greedy text ends it there
    words = text.split()
    if len(words) >= 3:
        stop = " " + words[2]
        s = claude.messages.create(**kw, stop_sequences=[stop])
        assert s.stop_reason == "stop_sequence" and s.stop_sequence == stop
        assert s.content[0].text == text[:text.index(stop)]
    main_server.check_integrity()


# --- native HTTP API ------------------------------------------------------------------------------


def test_generate_single_batch_stream(main_server):
    sp = {"max_new_tokens": 10, "temperature": 0}
    singles = [main_server.post("/generate", {"text": p, "sampling_params": sp}).json()
               for p in PROMPTS]
    for out in singles:
        meta = out["meta_info"]
        assert out["text"] and len(out["output_ids"]) == meta["completion_tokens"] <= 10
        assert meta["finish_reason"]["type"] in ("stop", "length")
        assert meta["prompt_tokens"] > 0 and meta["e2e_latency"] > 0 and meta["id"]

    batch = main_server.post("/generate", {"text": PROMPTS, "sampling_params": sp})
    assert batch.status_code == 200, batch.text
    assert [b["text"] for b in batch.json()] == [s["text"] for s in singles]

    # token ids in, same text out
    ids = _ids_of(main_server, PROMPTS[0])
    by_ids = main_server.post("/generate", {"input_ids": ids, "sampling_params": sp}).json()
    assert by_ids["meta_info"]["prompt_tokens"] == len(ids)
    assert by_ids["text"] == singles[0]["text"]

    # streaming: cumulative text, only growing, ending with the non-streamed text and [DONE]
    with http.stream("POST", main_server.url + "/generate", timeout=120,
                     json={"text": PROMPTS[1], "sampling_params": sp, "stream": True}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    assert raw.rstrip().endswith("data: [DONE]")
    events = [e for e in sse_events(httpx.Response(200, text=raw))]
    assert len(events) >= 2
    for a, b in zip(events, events[1:]):
        assert b["text"].startswith(a["text"])
        assert a["meta_info"]["finish_reason"] is None
    assert events[-1]["text"] == singles[1]["text"]
    assert events[-1]["output_ids"] == singles[1]["output_ids"]
    assert events[-1]["meta_info"]["finish_reason"] is not None

    # logprobs: one (logprob, id, text) per output token, top lists of the asked size
    lp = main_server.post("/generate", {"text": PROMPTS[0], "sampling_params": sp,
                                        "return_logprob": True, "top_logprobs_num": 2,
                                        "return_text_in_logprobs": True}).json()
    out_lp = lp["meta_info"]["output_token_logprobs"]
    assert [t[1] for t in out_lp] == lp["output_ids"]
    assert all(v <= 0 and isinstance(s, str) for v, _, s in out_lp)
    assert all(len(t) == 2 for t in lp["meta_info"]["output_top_logprobs"])
    main_server.check_integrity()


def _ids_of(main_server, text: str) -> list[int]:
    # The prompt's ids as the server tokenized them: input logprobs from the first token on.
    r = main_server.post("/generate", {"text": text, "sampling_params": {"max_new_tokens": 1},
                                       "return_logprob": True, "logprob_start_len": 0})
    return [t[1] for t in r.json()["meta_info"]["input_token_logprobs"]]


def test_cached_tokens_on_repeated_prefix(main_server, oai, claude, model_name):
    # A prefix no earlier test sent (the tag comes first), long enough to be worth caching.
    prefix = f"[{uuid.uuid4().hex}] " + "Radix trees share prompt prefixes between requests. " * 12
    sp = {"max_new_tokens": 4, "temperature": 0}
    first = main_server.post("/generate", {"text": prefix + "First question?", "sampling_params": sp})
    second = main_server.post("/generate", {"text": prefix + "Second question?", "sampling_params": sp})
    m1, m2 = first.json()["meta_info"], second.json()["meta_info"]
    assert m1["cached_tokens"] < 20  # a new prefix: (almost) nothing cached
    assert m2["cached_tokens"] > 0.8 * m1["prompt_tokens"] - 10
    assert m2["cached_tokens"] < m2["prompt_tokens"]

    messages = [{"role": "user", "content": prefix + "Summarize this."}]
    oai.chat.completions.create(model=model_name, messages=messages, max_tokens=4, temperature=0)
    r = oai.chat.completions.create(model=model_name, messages=messages, max_tokens=4, temperature=0)
    details = r.usage.prompt_tokens_details
    assert details is not None and details.cached_tokens > 0.8 * r.usage.prompt_tokens

    kw = dict(model=model_name, max_tokens=4, messages=[{"role": "user", "content": prefix + "Again."}],
              extra_body={"temperature": 0})
    claude.messages.create(**kw)
    m = claude.messages.create(**kw)
    assert m.usage.cache_read_input_tokens > 0
    main_server.check_integrity()


def test_greedy_text_equals_engine(main_server):
    """The server (fp32) and the offline Engine (fp32) give the same greedy text."""
    import radixlm

    sp = {"max_new_tokens": 24, "temperature": 0}
    served = [main_server.post("/generate", {"text": p, "sampling_params": sp}).json()
              for p in PROMPTS]
    engine = radixlm.Engine(dtype="float32", max_total_tokens=4096, context_length=MAIN_CONTEXT_LEN)
    try:
        local = [engine.generate(p, sp) for p in PROMPTS]
    finally:
        engine.shutdown()
    for p, s, e in zip(PROMPTS, served, local):
        assert s["text"] == e["text"], f"prompt {p!r}"
        assert s["output_ids"] == e["output_ids"], f"prompt {p!r}"
        assert s["meta_info"]["finish_reason"] == e["meta_info"]["finish_reason"]
    main_server.check_integrity()
