"""The OpenAI-compatible routes (/v1/models, /v1/completions, /v1/chat/completions), run
in-process over a scripted fake TokenizerManager (openai_fake.py). Errors and the real SDKs are in
test_openai_api_errors.py.
"""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from openai_fake import FakeTM, assert_openai_error, make_app, sse_data


@pytest.fixture(scope="module")
def fake():
    return FakeTM()


@pytest.fixture(scope="module")
def app(fake):
    return make_app(fake)


@pytest.fixture
def client(app, fake):
    fake.reset()
    with TestClient(app) as c:
        yield c


# --- /v1/models -------------------------------------------------------------------------------


def test_models_lists_the_served_name(client):
    body = client.get("/v1/models").json()
    assert body["object"] == "list" and [m["id"] for m in body["data"]] == ["fake-model"]
    assert body["data"][0]["object"] == "model" and body["data"][0]["max_model_len"] == 200
    assert client.get("/v1/models/fake-model").json()["id"] == "fake-model"
    assert_openai_error(client.get("/v1/models/nope"), 404, code="model_not_found")


# --- /v1/completions --------------------------------------------------------------------------


def test_completion_maps_sampling_params_and_shapes_the_response(client, fake):
    r = client.post("/v1/completions", json={
        "model": "fake-model", "prompt": "Say hi", "max_tokens": 50, "temperature": 0.5, "top_p": 0.9,
        "stop": "zzz", "seed": 7, "top_k": 5, "min_p": 0.1, "ignore_eos": True, "min_tokens": 2,
        "repetition_penalty": 1.1, "frequency_penalty": 0.5, "presence_penalty": -0.5,
        "regex": "[a-z]+", "stop_token_ids": [3], "user": "ignored-extra"})
    assert r.status_code == 200, r.text
    (obj,) = fake.calls
    assert obj.text == "Say hi" and obj.input_ids is None and not obj.stream
    assert obj.sampling_params == {
        "max_new_tokens": 50, "min_new_tokens": 2, "temperature": 0.5, "top_p": 0.9, "top_k": 5,
        "min_p": 0.1, "frequency_penalty": 0.5, "presence_penalty": -0.5, "repetition_penalty": 1.1,
        "ignore_eos": True, "skip_special_tokens": True, "no_stop_trim": False, "stop": ["zzz"],
        "stop_token_ids": [3], "regex": "[a-z]+", "seed": 7}
    assert not obj.return_logprob
    body = r.json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert body["model"] == "fake-model" and isinstance(body["created"], int)
    (choice,) = body["choices"]
    assert choice == {"index": 0, "text": "Hello, world!", "logprobs": None, "finish_reason": "stop",
                      "matched_stop": 0}
    assert body["usage"] == {"prompt_tokens": 6, "completion_tokens": 13, "total_tokens": 19,
                             "prompt_tokens_details": {"cached_tokens": 3}}


def test_completion_defaults(client, fake):
    client.post("/v1/completions", json={"prompt": "x"})  # no model: the served one
    sp = fake.calls[0].sampling_params
    assert sp["max_new_tokens"] == 16 and sp["temperature"] == 1.0 and "seed" not in sp
    # The model path and SGLang's "default" name the same model.
    for name in ("/models/fake-path", "default"):
        assert client.post("/v1/completions", json={"model": name, "prompt": "x"}).status_code == 200


def test_completion_finish_reasons(client):
    r = client.post("/v1/completions", json={"prompt": "p", "max_tokens": 5}).json()
    assert r["choices"][0]["text"] == "Hello" and r["choices"][0]["finish_reason"] == "length"
    r = client.post("/v1/completions", json={"prompt": "p", "stop": [",", "!"]}).json()
    assert r["choices"][0]["text"] == "Hello" and r["choices"][0]["finish_reason"] == "stop"
    assert r["choices"][0]["matched_stop"] == ","


def test_completion_n_and_batch_of_prompts(client, fake):
    r = client.post("/v1/completions", json={"prompt": ["ab", "cde"], "n": 3, "seed": 10}).json()
    assert [c["index"] for c in r["choices"]] == list(range(6))
    assert [o.text for o in fake.calls] == ["ab"] * 3 + ["cde"] * 3
    # sample j of each prompt is seeded seed + j: distinct yet reproducible
    assert [o.sampling_params["seed"] for o in fake.calls] == [10, 11, 12] * 2
    # each prompt's tokens count once; cached tokens are capped by the prompt
    assert r["usage"]["prompt_tokens"] == 5 and r["usage"]["completion_tokens"] == 6 * 13
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == 2 + 3


def test_completion_token_id_prompts_and_echo(client, fake):
    r = client.post("/v1/completions", json={"prompt": [72, 105], "echo": True, "max_tokens": 3}).json()
    assert fake.calls[0].input_ids == [72, 105] and fake.calls[0].text is None
    assert r["choices"][0]["text"] == "Hi" + "Hel"
    client.post("/v1/completions", json={"prompt": [[72], [105, 33]], "max_tokens": 1})
    assert [o.input_ids for o in fake.calls[1:]] == [[72], [105, 33]]


def test_completion_logprobs_with_echo(client, fake):
    r = client.post("/v1/completions", json={"prompt": "Hey", "echo": True, "logprobs": 2,
                                             "max_tokens": 4}).json()
    obj = fake.calls[0]
    assert obj.return_logprob and obj.logprob_start_len == 0 and obj.top_logprobs_num == 2
    assert obj.return_text_in_logprobs
    choice = r["choices"][0]
    lp = choice["logprobs"]
    assert choice["text"] == "HeyHell"
    assert lp["tokens"] == list("HeyHell")
    assert lp["token_logprobs"][0] is None and lp["token_logprobs"][1:3] == [-1.0, -1.0]
    assert lp["token_logprobs"][3:] == pytest.approx([-0.1, -0.2, -0.3, -0.4])
    assert lp["top_logprobs"][0] is None and all(len(d) == 2 for d in lp["top_logprobs"][1:])
    assert min(lp["top_logprobs"][3].values()) == -9999.0  # -inf clamped, JSON has no -inf
    for tok, off in zip(lp["tokens"], lp["text_offset"]):
        assert choice["text"][off:off + len(tok)] == tok


def test_unscored_prompt_token_may_be_none(client, fake, monkeypatch):
    """The manager may give the first prompt token's entry as None instead of (None, id, text)."""
    out = fake._out

    def none_first(*a):
        d = out(*a)
        if "input_token_logprobs" in d["meta_info"]:
            d["meta_info"]["input_token_logprobs"][0] = None
        return d

    monkeypatch.setattr(fake, "_out", none_first)
    r = client.post("/v1/completions", json={"prompt": "Hey", "echo": True, "logprobs": 1, "max_tokens": 2})
    lp = r.json()["choices"][0]["logprobs"]
    assert lp["tokens"] == ["", "e", "y", "H", "e"] and lp["token_logprobs"][0] is None


def test_completion_logprobs_without_echo(client, fake):
    r = client.post("/v1/completions", json={"prompt": "Hey", "logprobs": 0, "max_tokens": 3}).json()
    assert fake.calls[0].logprob_start_len == -1
    lp = r["choices"][0]["logprobs"]
    assert lp["tokens"] == list("Hel") and lp["text_offset"] == [0, 1, 2]
    assert lp["top_logprobs"] is None


def test_completion_stream_reassembles(client, fake):
    plain = client.post("/v1/completions", json={"prompt": "p", "n": 2}).json()
    r = client.post("/v1/completions", json={"prompt": "p", "n": 2, "stream": True,
                                             "stream_options": {"include_usage": True}})
    events = sse_data(r)
    assert events[-1] == "[DONE]"
    *chunks, usage = events[:-1]
    assert usage["choices"] == [] and usage["usage"] == plain["usage"]
    texts, finishes = {0: "", 1: ""}, {}
    for c in chunks:
        assert c["object"] == "text_completion" and c["id"] == chunks[0]["id"]
        for ch in c["choices"]:
            assert ch["index"] not in finishes, "no chunk after a choice finished"
            texts[ch["index"]] += ch["text"]
            if ch["finish_reason"]:
                finishes[ch["index"]] = ch["finish_reason"]
    assert texts == {0: "Hello, world!", 1: "Hello, world!"} and finishes == {0: "stop", 1: "stop"}
    assert len(chunks) > 4 and all(o.stream for o in fake.calls[2:])


def test_completion_stream_logprobs_and_echo(client):
    r = client.post("/v1/completions", json={"prompt": "ab", "stream": True, "echo": True,
                                             "logprobs": 1, "max_tokens": 7})
    chunks = [c for c in sse_data(r)[:-1]]
    text = "".join(c["choices"][0]["text"] for c in chunks)
    tokens = sum((c["choices"][0]["logprobs"]["tokens"] for c in chunks), [])
    offsets = sum((c["choices"][0]["logprobs"]["text_offset"] for c in chunks), [])
    assert text == "abHello, " and tokens == list(text)
    assert offsets == list(range(len(text)))


def test_completion_stream_without_usage_has_no_usage_chunk(client):
    chunks = sse_data(client.post("/v1/completions", json={"prompt": "p", "stream": True}))[:-1]
    assert all(c["choices"] and c["usage"] is None for c in chunks)


# --- /v1/chat/completions ---------------------------------------------------------------------


def test_chat_renders_template_and_maps_params(client, fake):
    r = client.post("/v1/chat/completions", json={
        "model": "fake-model", "temperature": 0, "stop": ["!"],
        "messages": [{"role": "developer", "content": "Be brief."},
                     {"role": "user", "content": [{"type": "text", "text": "Hi"},
                                                  {"type": "text", "text": "there"}]},
                     {"role": "assistant", "content": "Yo"},
                     {"role": "user", "content": "Again"}]})
    assert r.status_code == 200, r.text
    (messages, tools), = fake.templates
    assert messages == [{"role": "system", "content": "Be brief."},
                        {"role": "user", "content": "Hi\nthere"},
                        {"role": "assistant", "content": "Yo"}, {"role": "user", "content": "Again"}]
    prompt = "<system>Be brief.\n<user>Hi\nthere\n<assistant>Yo\n<user>Again\n<assistant>"
    obj = fake.calls[0]
    assert obj.input_ids == fake.tokenizer.encode(prompt) and obj.text is None
    # no max_tokens: whatever room the context has left
    assert obj.sampling_params["max_new_tokens"] == 200 - len(prompt)
    assert obj.sampling_params["stop"] == ["!"] and obj.sampling_params["temperature"] == 0
    body = r.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    (choice,) = body["choices"]
    assert choice["message"] == {"role": "assistant", "content": "Hello, world"}
    assert choice["finish_reason"] == "stop" and choice["logprobs"] is None
    assert body["usage"]["prompt_tokens"] == len(prompt)
    assert body["usage"]["prompt_tokens_details"] == {"cached_tokens": 3}


def test_chat_max_tokens_names(client, fake):
    msgs = [{"role": "user", "content": "q"}]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    client.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 9, "tools": tools})
    assert fake.templates[0][1] == tools  # rendered by the template; calls are not parsed back
    client.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 9, "max_completion_tokens": 4})
    assert [o.sampling_params["max_new_tokens"] for o in fake.calls] == [9, 4]
    r = client.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 4}).json()
    assert r["choices"][0]["finish_reason"] == "length"


def test_chat_logprobs_shape(client, fake):
    r = client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "q"}], "logprobs": True, "top_logprobs": 3,
        "max_tokens": 2, "n": 2}).json()
    assert fake.calls[0].return_logprob and fake.calls[0].top_logprobs_num == 3
    assert len(fake.calls) == 2 and [c["index"] for c in r["choices"]] == [0, 1]
    content = r["choices"][0]["logprobs"]["content"]
    assert [t["token"] for t in content] == ["H", "e"]
    assert content[0]["logprob"] == pytest.approx(-0.1) and content[0]["bytes"] == [72]
    tops = content[1]["top_logprobs"]
    assert len(tops) == 3 and set(tops[0]) == {"token", "logprob", "bytes"}
    assert tops[-1]["logprob"] == -9999.0


def test_chat_response_format_maps_to_json_schema(client, fake):
    msgs = [{"role": "user", "content": "q"}]
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    for fmt in ({"type": "text"}, {"type": "json_object"},
                {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}):
        assert client.post("/v1/chat/completions", json={"messages": msgs, "response_format": fmt}).status_code == 200
    got = [o.sampling_params.get("json_schema") for o in fake.calls]
    assert got[0] is None and json.loads(got[1]) == {"type": "object"} and json.loads(got[2]) == schema


def test_chat_stream_role_first_then_content_then_usage(client, fake):
    r = client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "q"}], "stream": True, "n": 2, "logprobs": True,
        "stream_options": {"include_usage": True}})
    events = sse_data(r)
    assert events[-1] == "[DONE]"
    chunks, usage = events[:-2], events[-2]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 2 * 13
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    firsts = {}
    texts, tokens, finish = {0: "", 1: ""}, {0: [], 1: []}, {}
    for c in chunks:
        (ch,) = c["choices"]
        firsts.setdefault(ch["index"], ch["delta"])
        texts[ch["index"]] += ch["delta"].get("content") or ""
        if ch["logprobs"]:
            tokens[ch["index"]] += [t["token"] for t in ch["logprobs"]["content"]]
        if ch["finish_reason"]:
            finish[ch["index"]] = ch["finish_reason"]
    assert firsts == {0: {"role": "assistant", "content": ""}, 1: {"role": "assistant", "content": ""}}
    assert texts == {0: "Hello, world!", 1: "Hello, world!"} and finish == {0: "stop", 1: "stop"}
    assert tokens == {0: list("Hello, world!"), 1: list("Hello, world!")}
    assert all("role" not in c["choices"][0]["delta"] for c in chunks[2:])
