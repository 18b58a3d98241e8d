"""Tool calling over both HTTP routes (OpenAI and Anthropic), run in-process over a scripted
fake TokenizerManager that streams its reply one character per update."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from radixlm.runtime.sampling_params import SamplingParams
from radixlm.server.anthropic_api import register_anthropic_routes
from radixlm.server.openai_api import register_openai_routes
from radixlm.server.tool_calls.parsers import HERMES
from radixlm.server.tool_calls.render import render_calls
from tool_defs import ADD, WEATHER


class CharTokenizer:
    chat_template = "{{ messages }}"  # no tool support: radixlm renders tools itself

    def encode(self, text, add_special_tokens=True):
        return [ord(c) % 256 for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


class FakeTM:
    def __init__(self):
        self.model_name, self.context_len = "fake-model", 100000
        self.server_args = SimpleNamespace(model_path="/m", served_model_name="fake-model",
                                           tool_call_parser=None)
        self.tokenizer = CharTokenizer()
        self.chat_template = None
        self.reply, self.calls, self.rendered = "", [], []

    def apply_chat_template(self, messages, tools=None):
        self.rendered.append((messages, tools))
        return "".join(f"<{m['role']}>{m['content']}\n" for m in messages) + "<assistant>"

    async def generate(self, obj, request=None):
        self.calls.append(obj)
        SamplingParams.from_dict(obj.sampling_params).verify(256)
        text = self.reply
        ends = list(range(1, len(text))) + [len(text)] if obj.stream else [len(text)]
        for end in ends:  # streamed one character per update: every split point is exercised
            meta = {"id": "r", "prompt_tokens": len(obj.input_ids), "completion_tokens": end,
                    "cached_tokens": 0, "e2e_latency": 0.0,
                    "finish_reason": {"type": "stop", "matched": 0} if end == len(text) else None}
            yield {"text": text[:end], "output_ids": [], "meta_info": meta}
            await asyncio.sleep(0)


@pytest.fixture(scope="module")
def fake():
    return FakeTM()


@pytest.fixture(scope="module")
def client(fake):
    app = FastAPI()
    register_openai_routes(app, fake)
    register_anthropic_routes(app, fake)
    return TestClient(app)


OA_TOOLS = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                              "parameters": t.parameters}} for t in (WEATHER, ADD)]
REPLY = ('Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"location": {"city": "Oslo"}, '
         '"unit": "celsius"}}\n</tool_call>\n<tool_call>\n{"name": "add", "arguments": {"numbers": [1, 2]}}'
         '\n</tool_call>')
CALLS = [("get_weather", '{"location": {"city": "Oslo"}, "unit": "celsius"}'), ("add", '{"numbers": [1, 2]}')]


def _sse(r):
    return [json.loads(line[6:]) for line in r.text.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]


def test_openai_tool_calls_response_and_stream(client, fake):
    fake.reply = REPLY
    body = {"messages": [{"role": "user", "content": "Weather in Oslo and 1+2?"}], "tools": OA_TOOLS,
            "max_tokens": 50}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    assert choice["finish_reason"] == "tool_calls"
    msg = choice["message"]
    assert msg["content"] == "Checking."
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in msg["tool_calls"]] == CALLS
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in msg["tool_calls"])
    assert "ebnf" not in fake.calls[-1].sampling_params  # auto: unconstrained

    chunks = _sse(client.post("/v1/chat/completions", json={**body, "stream": True}))
    content, calls, reasons = "", {}, []
    for ch in chunks:
        for c in ch["choices"]:
            d = c["delta"]
            content += d.get("content") or ""
            for tc in d.get("tool_calls", []):
                if "id" in tc:
                    assert tc["index"] not in calls and tc["function"]["name"] and tc["type"] == "function"
                    calls[tc["index"]] = [tc["function"]["name"], tc["function"].get("arguments", "")]
                else:
                    assert set(tc) == {"index", "function"} and set(tc["function"]) == {"arguments"}
                    calls[tc["index"]][1] += tc["function"]["arguments"]
            reasons.append(c["finish_reason"])
    assert content == "Checking." and [tuple(calls[i]) for i in sorted(calls)] == CALLS
    assert reasons[-1] == "tool_calls" and set(reasons[:-1]) == {None}


def test_openai_forced_choices_constrain(client, fake):
    fake.reply = '<tool_call>\n{"name": "add", "arguments": {"numbers": [1]}}\n</tool_call>'
    base = {"messages": [{"role": "user", "content": "q"}], "tools": OA_TOOLS, "max_tokens": 50}
    for choice in ("required", {"type": "function", "function": {"name": "add"}}):
        r = client.post("/v1/chat/completions", json={**base, "tool_choice": choice})
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "tool_calls"
        assert r.json()["choices"][0]["message"]["content"] is None
        assert "ebnf" in fake.calls[-1].sampling_params
    r = client.post("/v1/chat/completions", json={**base, "tool_choice": "none"})
    assert r.json()["choices"][0]["message"] == {"role": "assistant", "content": ""}
    assert r.json()["choices"][0]["finish_reason"] == "stop"
    messages, tools = fake.rendered[-1]
    assert tools is None and "<tools>" not in messages[0]["content"]  # none: tools not offered


@pytest.mark.parametrize("patch,match", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "nope"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "strnig"}}}}}]}, "invalid parameter schema"),
    ({"tools": [], "tool_choice": "required"}, "non-empty"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "cannot be combined"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "name"),
])
def test_openai_tool_errors_are_400(client, fake, patch, match):
    n = len(fake.calls)
    body = {"messages": [{"role": "user", "content": "q"}], "tools": OA_TOOLS, **patch}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 400 and match in r.json()["error"]["message"], r.text
    assert len(fake.calls) == n  # refused before queueing


def test_openai_history_with_tool_calls(client, fake):
    fake.reply = "It is 3."
    r = client.post("/v1/chat/completions", json={"tools": OA_TOOLS, "max_tokens": 20, "messages": [
        {"role": "user", "content": "1+2?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"numbers": [1, 2]}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "3"}]})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"] == {"role": "assistant", "content": "It is 3."}
    messages, _ = fake.rendered[-1]
    assert messages[2]["content"].startswith("<tool_call>") and messages[3]["role"] == "tool"
    assert "<tool_response>\n3\n</tool_response>" in messages[3]["content"]


def test_results_fall_back_to_user_turns_when_the_template_refuses_the_tool_role(client, fake):
    from jinja2 import TemplateError

    def strict(messages, tools=None):
        if any(m["role"] == "tool" for m in messages):
            raise TemplateError("roles must alternate user/assistant")
        return FakeTM.apply_chat_template(fake, messages, tools)

    fake.reply, fake.apply_chat_template = "3", strict
    try:
        r = client.post("/v1/chat/completions", json={"tools": OA_TOOLS, "messages": [
            {"role": "user", "content": "1+2?"},
            {"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {
                "name": "add", "arguments": '{"numbers": [1, 2]}'}}]},
            {"role": "tool", "tool_call_id": "c", "content": "3"}]})
    finally:
        del fake.apply_chat_template
    assert r.status_code == 200, r.text
    assert [m["role"] for m in fake.rendered[-1][0]] == ["system", "user", "assistant", "user"]


def test_anthropic_tool_use_response_and_stream(client, fake):
    fake.reply = REPLY
    body = {"max_tokens": 50, "messages": [{"role": "user", "content": "Weather?"}],
            "tools": [{"name": t.name, "description": t.description or "", "input_schema": t.parameters}
                      for t in (WEATHER, ADD)]}
    r = client.post("/v1/messages", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["stop_reason"] == "tool_use"
    assert out["content"][0] == {"type": "text", "text": "Checking."}
    uses = out["content"][1:]
    assert [(u["type"], u["name"], u["input"]) for u in uses] == [
        ("tool_use", n, json.loads(a)) for n, a in CALLS]
    assert all(u["id"].startswith("toolu_") for u in uses)

    r = client.post("/v1/messages", json={**body, "stream": True})
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
    blocks, open_ = {}, None
    for e in events:
        if e["type"] == "content_block_start":
            assert open_ is None
            open_ = e["index"]
            blocks[open_] = dict(e["content_block"], partial="")
        elif e["type"] == "content_block_delta":
            assert e["index"] == open_
            d = e["delta"]
            if d["type"] == "text_delta":
                blocks[open_]["text"] += d["text"]
            else:
                assert d["type"] == "input_json_delta"
                blocks[open_]["partial"] += d["partial_json"]
        elif e["type"] == "content_block_stop":
            assert e["index"] == open_
            open_ = None
        elif e["type"] == "message_delta":
            assert e["delta"]["stop_reason"] == "tool_use"
    assert blocks[0]["type"] == "text" and blocks[0]["text"] == "Checking."
    assert [(blocks[i]["name"], json.loads(blocks[i]["partial"])) for i in (1, 2)] == [
        (n, json.loads(a)) for n, a in CALLS]


def test_anthropic_choices_history_and_errors(client, fake):
    fake.reply = '<tool_call>\n{"name": "add", "arguments": {"numbers": [1]}}\n</tool_call>'
    tools = [{"name": "add", "input_schema": ADD.parameters}]
    base = {"max_tokens": 50, "tools": tools, "messages": [{"role": "user", "content": "q"}]}
    for tc in ({"type": "any"}, {"type": "tool", "name": "add"}):
        r = client.post("/v1/messages", json={**base, "tool_choice": tc})
        assert r.status_code == 200 and r.json()["stop_reason"] == "tool_use", r.text
        assert "ebnf" in fake.calls[-1].sampling_params
    r = client.post("/v1/messages", json={**base, "tool_choice": {"type": "none"}})
    assert r.json()["content"] == [{"type": "text", "text": ""}] and r.json()["stop_reason"] == "end_turn"
    fake.reply = "One."
    r = client.post("/v1/messages", json={**base, "messages": [
        {"role": "user", "content": "sum of [1]?"},
        {"role": "assistant", "content": [{"type": "text", "text": "Let me add."},
                                          {"type": "tool_use", "id": "toolu_1", "name": "add",
                                           "input": {"numbers": [1]}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "1"},
                                     {"type": "text", "text": "Say it in words."}]}]})
    assert r.status_code == 200 and r.json()["content"] == [{"type": "text", "text": "One."}], r.text
    messages, _ = fake.rendered[-1]
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "user"]
    assert messages[2]["content"] == 'Let me add.\n' + render_calls(HERMES, [("add", '{"numbers": [1]}')])
    n = len(fake.calls)
    for patch, match in [
        ({"tool_choice": {"type": "tool", "name": "nope"}}, "nope"),
        ({"tools": [{"name": "f", "input_schema": {"type": "object", "properties": {"a": {"type": 1}}}}]},
         "invalid parameter schema"),
        ({"tools": [{"name": "web", "type": "web_search_20250305"}]}, "not supported"),
        ({"messages": [{"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "x"}]}]},
         "not supported"),
    ]:
        r = client.post("/v1/messages", json={**base, **patch})
        assert r.status_code == 400 and match in r.json()["error"]["message"], (patch, r.text)
    assert len(fake.calls) == n



def test_anthropic_count_tokens_counts_the_tools(client, fake):
    base = {"messages": [{"role": "user", "content": "q"}]}
    plain = client.post("/v1/messages/count_tokens", json=base).json()["input_tokens"]
    with_tools = client.post("/v1/messages/count_tokens", json={
        **base, "tools": [{"name": "add", "input_schema": ADD.parameters}]}).json()["input_tokens"]
    assert with_tools > plain
