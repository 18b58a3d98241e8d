"""The OpenAI-compatible routes, run in-process over a scripted fake TokenizerManager.

The fake validates sampling params with the real `SamplingParams` (so its ValueErrors are the
runtime's), uses a one-char-per-token tokenizer (so token counts and offsets are easy to check),
and records every GenerateReqInput it receives. The real SDKs are checked against a uvicorn
server in a thread at the end.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from types import SimpleNamespace

import httpx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from radixlm.runtime.sampling_params import SamplingParams
from radixlm.server.errors import QueueFullError
from radixlm.server.openai_api import register_openai_routes

VOCAB = 256


class CharTokenizer:
    """One token per character (code point mod 256): token counts equal text lengths."""

    chat_template = "fake"

    def encode(self, text, add_special_tokens=True):
        return [ord(c) % VOCAB for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


class FakeTM:
    """Test double of TokenizerManager: answers every request with a scripted reply."""

    def __init__(self):
        self.model_name, self.context_len = "fake-model", 200
        self.server_args = SimpleNamespace(model_path="/models/fake-path", served_model_name="fake-model",
                                           enable_cache_report=True)
        self.tokenizer = CharTokenizer()
        self.reset()

    def reset(self):
        self.calls, self.templates = [], []
        self.reply = "Hello, world!"
        self.cached = 3
        self.error = None  # raised before anything is queued, as the real manager does
        self.abort_after = None  # chars after which the request is aborted
        self.chunk = 3  # chars per streamed update
        self.delay = 0.0  # seconds between streamed updates
        self.first_delay = 0.0  # seconds before the first update (a busy queue)
        self.fail_call = None  # index of the call that raises instead of the others
        self.completed = 0  # generators that ran to their end
        self.closed = 0  # generators that ran their cleanup (finished, closed or cancelled)

    def apply_chat_template(self, messages, tools=None, template_kwargs=None):
        self.templates.append((messages, tools))
        self.template_kwargs = template_kwargs
        return "".join(f"<{m['role']}>{m['content']}\n" for m in messages) + "<assistant>"

    async def generate(self, obj, request=None):
        self.calls.append(obj)
        if self.error is not None and self.fail_call in (None, len(self.calls) - 1):
            raise self.error
        sp = SamplingParams.from_dict(obj.sampling_params)
        sp.verify(VOCAB)
        ids = list(obj.input_ids) if obj.input_ids is not None else self.tokenizer.encode(obj.text)
        if len(ids) + sp.max_new_tokens > self.context_len:
            raise ValueError("max_new_tokens: prompt plus max_new_tokens exceeds the context length")
        text, finish = self.reply, {"type": "stop", "matched": 0}  # 0 plays EOS
        hits = [(text.find(s), s) for s in sp.stop_strs if s in text]
        if hits:
            cut, s = min(hits)
            text, finish = text[:cut], {"type": "stop", "matched": s}
        if len(text) > sp.max_new_tokens:
            text, finish = text[:sp.max_new_tokens], {"type": "length", "length": sp.max_new_tokens}
        ends = (list(range(self.chunk, len(text), self.chunk)) + [len(text)]) if obj.stream else [len(text)]
        try:
            await asyncio.sleep(self.first_delay)
            for end in ends:
                if self.abort_after is not None and end > self.abort_after:
                    yield self._out(obj, ids, text[:self.abort_after], {"type": "abort", "message": "aborted by test"})
                    return
                yield self._out(obj, ids, text[:end], finish if end == len(text) else None)
                await asyncio.sleep(self.delay)
            self.completed += 1
        finally:
            self.closed += 1

    def _out(self, obj, ids, text, finish):
        meta = {"id": obj.rid or "rid", "prompt_tokens": len(ids), "completion_tokens": len(text),
                "cached_tokens": min(self.cached, len(ids)), "finish_reason": finish, "e2e_latency": 0.01}
        if obj.return_logprob:
            k = obj.top_logprobs_num

            def tops(c, lp):
                alts = [(lp, ord(c) % VOCAB, c)] + [(-5.0 - j, 97 + j, chr(97 + j)) for j in range(k - 1)]
                if k >= 2:
                    alts[-1] = (float("-inf"), alts[-1][1], alts[-1][2])  # must come out as -9999
                return alts[:k]

            meta["output_token_logprobs"] = [(-0.1 * (i + 1), ord(c) % VOCAB, c) for i, c in enumerate(text)]
            meta["output_top_logprobs"] = [tops(c, -0.1 * (i + 1)) for i, c in enumerate(text)]
            if obj.logprob_start_len == 0:
                chars = [chr(t) for t in ids]
                meta["input_token_logprobs"] = [(None if i == 0 else -1.0, t, chars[i]) for i, t in enumerate(ids)]
                meta["input_top_logprobs"] = [None] + [tops(c, -1.0) for c in chars[1:]]
        return {"text": text, "output_ids": self.tokenizer.encode(text), "meta_info": meta}


@pytest.fixture(scope="module")
def fake():
    return FakeTM()


@pytest.fixture(scope="module")
def app(fake):
    app = FastAPI()
    register_openai_routes(app, fake)
    return app


@pytest.fixture
def client(app, fake):
    fake.reset()
    with TestClient(app) as c:
        yield c


def sse_data(resp) -> list:
    """The `data:` payloads of an SSE body, JSON-decoded except the final [DONE]."""
    assert resp.headers["content-type"].startswith("text/event-stream")
    out = []
    for block in resp.text.split("\n\n"):
        if block.strip():
            assert block.startswith("data: "), block
            payload = block[len("data: "):]
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def assert_openai_error(resp, status, param=None, code=None):
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["type"] == ("invalid_request_error" if status < 500 else "server_error")
    if param is not None:
        assert err["param"] == param
    if code is not None:
        assert err["code"] == code


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


# --- errors -----------------------------------------------------------------------------------

MSGS = [{"role": "user", "content": "q"}]


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": ""}, "prompt"),
    ("/v1/completions", {"prompt": []}, "prompt"),
    ("/v1/completions", {"prompt": [[]]}, "prompt"),
    ("/v1/completions", {"prompt": [1.5]}, "prompt"),
    ("/v1/completions", {}, "prompt"),
    ("/v1/completions", {"prompt": "x", "temperature": -0.1}, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, "top_p"),
    ("/v1/completions", {"prompt": "x", "top_p": 1.5}, "top_p"),
    ("/v1/completions", {"prompt": "x", "n": 17}, "n"),
    ("/v1/completions", {"prompt": "x", "n": 0}, "n"),
    ("/v1/completions", {"prompt": "x", "max_tokens": -1}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "stop": [""]}, "stop"),
    ("/v1/completions", {"prompt": "x", "top_k": 0}, "top_k"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"1": 500}}, "logit_bias"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {}, "messages"),
    ("/v1/chat/completions", {"messages": "hi"}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, "messages.0"),
    ("/v1/chat/completions", {"messages": [{"content": "x"}]}, "messages.0.role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]}, "messages.0.content"),
    ("/v1/chat/completions", {"messages": MSGS, "temperature": -1}, "temperature"),
    ("/v1/chat/completions", {"messages": MSGS, "n": 100}, "n"),
    ("/v1/chat/completions", {"messages": MSGS, "top_logprobs": 2}, None),
    ("/v1/chat/completions", {"messages": MSGS, "response_format": {"type": "xml"}}, "response_format.type"),
    ("/v1/chat/completions", {"messages": MSGS, "response_format": {"type": "json_schema"}}, "response_format"),
])
def test_validation_errors_are_400_in_openai_shape(client, fake, path, body, param):
    resp = client.post(path, json=body)
    assert_openai_error(resp, 400, param=param)
    assert fake.calls == [], "nothing reaches the manager"


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("raw", [b"[1, 2]", b'"text"', b"3", b"null", b"{not json", b"", b"\xff\xfe"])
def test_non_object_bodies_are_400(client, path, raw):
    assert_openai_error(client.post(path, content=raw, headers={"content-type": "application/json"}), 400)


@pytest.mark.parametrize("stream", [False, True])
def test_unknown_model_is_404(client, stream):
    for path, body in (("/v1/completions", {"prompt": "x"}), ("/v1/chat/completions", {"messages": MSGS})):
        resp = client.post(path, json={**body, "model": "gpt-9", "stream": stream})
        assert_openai_error(resp, 404, param="model", code="model_not_found")


@pytest.mark.parametrize("stream", [False, True])
def test_manager_errors_before_queueing_map_to_status(client, fake, stream):
    # The runtime's own checks (here SamplingParams.verify and the context bound) give 400s.
    r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 500, "stream": stream})
    assert_openai_error(r, 400)
    assert "context" in r.json()["error"]["message"]
    r = client.post("/v1/completions", json={"prompt": "x", "regex": "a", "json_schema": "{}", "stream": stream})
    assert_openai_error(r, 400)
    fake.error = ValueError("regex: constrained decoding is not supported yet")
    r = client.post("/v1/chat/completions", json={"messages": MSGS, "regex": "a", "stream": stream})
    assert_openai_error(r, 400)
    assert "regex" in r.json()["error"]["message"]
    fake.error = QueueFullError("too many queued requests")
    r = client.post("/v1/completions", json={"prompt": "x", "n": 3, "stream": stream})
    assert_openai_error(r, 503)


def test_one_failing_choice_fails_the_request_at_once(client, fake):
    fake.first_delay, fake.fail_call, fake.error = 30.0, 2, QueueFullError("full")
    t0 = time.time()
    assert_openai_error(client.post("/v1/completions", json={"prompt": "x", "n": 3}), 503)
    assert time.time() - t0 < 5 and fake.closed == 2 and fake.completed == 0


def test_abort_is_an_error_not_a_finish_reason(client, fake):
    fake.abort_after = 4
    assert_openai_error(client.post("/v1/completions", json={"prompt": "x"}), 503)
    events = sse_data(client.post("/v1/chat/completions", json={"messages": MSGS, "stream": True}))
    assert events[-1] == "[DONE]" and events[-2]["error"]["message"] == "aborted by test"
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in events[:-2]) == "Hel"


# --- the real openai SDK against a live server ------------------------------------------------


@pytest.fixture(scope="module")
def live_url(app):
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.time() + 10
    while not server.started and time.time() < deadline:
        time.sleep(0.01)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    server.should_exit = True
    thread.join(timeout=10)


def test_openai_sdk_parses_everything(live_url, fake):
    import openai

    fake.reset()
    client = openai.OpenAI(base_url=live_url + "/v1", api_key="x", max_retries=0)
    assert [m.id for m in client.models.list()] == ["fake-model"]
    c = client.completions.create(model="fake-model", prompt="Hi", max_tokens=5, logprobs=2, echo=True)
    assert c.choices[0].text == "HiHello" and c.choices[0].finish_reason == "length"
    assert c.choices[0].logprobs.tokens == list("HiHello") and c.usage.total_tokens == 7
    chat = client.chat.completions.create(model="fake-model", messages=MSGS, logprobs=True,
                                          top_logprobs=2, n=2)
    assert [ch.message.content for ch in chat.choices] == ["Hello, world!"] * 2
    assert chat.choices[0].logprobs.content[0].top_logprobs[1].logprob == -9999.0
    assert chat.usage.prompt_tokens_details.cached_tokens == 3
    stream = client.chat.completions.create(model="fake-model", messages=MSGS, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == "Hello, world!"
    assert chunks[-1].usage.completion_tokens == 13
    text = "".join(ch.choices[0].text for ch in client.completions.create(
        model="fake-model", prompt="Hi", stream=True, max_tokens=8))
    assert text == "Hello, w"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=MSGS)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="fake-model", messages=MSGS, temperature=-1)
    assert e.value.body["param"] == "temperature"


def test_httpx_streams_incrementally(live_url, fake):
    """Over a real socket the chunks arrive as separate SSE events, not one body at the end."""
    fake.reset()
    with httpx.stream("POST", live_url + "/v1/completions", json={"prompt": "x", "stream": True},
                      timeout=10) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]" and len(lines) == 1 + 5


def test_client_disconnect_closes_every_generation(live_url, fake):
    """A client that leaves mid-stream must not leave generate calls running (the real manager
    aborts the request when its generator is closed or its client is gone)."""
    fake.reset()
    fake.delay, fake.chunk = 0.2, 1  # 13 updates: 2.6 s to finish on its own
    with httpx.stream("POST", live_url + "/v1/chat/completions", timeout=10,
                      json={"messages": MSGS, "stream": True, "n": 3}) as r:
        for line in r.iter_lines():
            if '"content":"H"' in line:
                break
    deadline = time.time() + 1.5
    while fake.closed < 3 and time.time() < deadline:
        time.sleep(0.02)
    assert fake.closed == 3 and fake.completed == 0 and len(fake.calls) == 3
