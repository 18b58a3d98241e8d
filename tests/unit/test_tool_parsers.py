"""Tool calling without a model: the parsers (complete and streamed at every split), the
registry, tool validation, the forced-call grammar, prompt rendering, and both HTTP routes over a
scripted fake TokenizerManager."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import jsonschema
import pytest
import xgrammar as xgr
from fastapi import FastAPI
from fastapi.testclient import TestClient

from radixlm.runtime.sampling_params import SamplingParams
from radixlm.server.anthropic_api import register_anthropic_routes
from radixlm.server.openai_api import register_openai_routes
from radixlm.server.tool_calls import ToolPlan, build_plan
from radixlm.server.tool_calls.grammar import (MAX_PARALLEL_CALLS, Tool, forced_call_constraint,
                                               validate_tools)
from radixlm.server.tool_calls.parsers import (FORMATS, HERMES, LLAMA3, MISTRAL, ParsedToolCall,
                                               StreamingToolParser, detect_format, get_format,
                                               parse_tool_calls, template_supports_tools)
from radixlm.server.tool_calls.render import prepare_messages, render_calls

MARKUP = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "[TOOL_CALLS]",
          "<|python_tag|>", "[ARGS]")

C = ParsedToolCall
CASES = [
    # (format, model output, expected content, expected calls)
    (HERMES, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     "", [C("get_weather", '{"city": "Paris"}')]),
    (HERMES, 'Let me check.\n<tool_call>\n{"name": "a", "arguments": {"x": [1, {"y": "}{\\"]"}]}}\n'
             '</tool_call>\n<tool_call>\n{"arguments": {"q": null}, "name": "b"}\n</tool_call>\n',
     "Let me check.", [C("a", '{"x": [1, {"y": "}{\\"]"}]}'), C("b", '{"q": null}')]),
    (HERMES, "Plain answer: 1 < 2 and <b>bold</b>; a <tool", "Plain answer: 1 < 2 and <b>bold</b>; a <tool", []),
    (HERMES, '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call> done',
     "done", [C("f", '{"a": 1}')]),  # arguments sent as a JSON string
    (HERMES, '<tool_call>{"name": "f"}</tool_call>', "", [C("f", "{}")]),
    (HERMES, '<tool_call>{"name": "f", "parameters": {"k": true}, "id": 7}</tool_call>', "",
     [C("f", '{"k": true}')]),
    (HERMES, '<tool_call>{"name": "f", "arguments": {"a": "trunc', "", [C("f", '{"a": "trunc')]),
    (HERMES, '<tool_call>{"arguments": {"a": 1}', "", []),  # cut before the name: dropped
    (HERMES, '<tool_call>not json</tool_call>after', "after", []),
    (HERMES, 'stray </tool_call> closer', "stray  closer", []),
    (HERMES, '<tool_response>\n{"t": 21}\n</tool_response>', '{"t": 21}', []),  # echoed result tags
    (LLAMA3, '{"name": "f", "parameters": {"a": 1}}', "", [C("f", '{"a": 1}')]),
    (LLAMA3, ' {"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {}}', "",
     [C("f", '{"a": 1}'), C("g", "{}")]),
    (LLAMA3, '<|python_tag|>{"name": "f", "arguments": {"s": "x;y"}}', "", [C("f", '{"s": "x;y"}')]),
    (LLAMA3, '{"answer": 42}', '{"answer": 42}', []),
    (LLAMA3, 'The answer is {"name": "f"}', 'The answer is {"name": "f"}', []),
    (MISTRAL, '[TOOL_CALLS] [{"name": "f", "arguments": {"a": 1}, "id": "abcdefghi"}, '
              '{"name": "g", "arguments": {}}]', "", [C("f", '{"a": 1}'), C("g", "{}")]),
    (MISTRAL, 'ok [TOOL_CALLS]f[ARGS]{"a": [1, 2]}[TOOL_CALLS]g[CALL_ID]abc123456[ARGS]{}', "ok",
     [C("f", '{"a": [1, 2]}'), C("g", "{}")]),
    (MISTRAL, '[TOOL_CALLS] {"name": "f", "arguments": {"a": 1}} tail', "tail", [C("f", '{"a": 1}')]),
]


def _stream(fmt, pieces):
    """Feed pieces; check the delta contract; return (content, calls) reassembled."""
    p = StreamingToolParser(fmt)
    content, calls, named = "", [], set()
    for piece in [*pieces, None]:
        c, deltas = p.feed(piece) if piece is not None else p.finish()
        content += c
        for d in deltas:
            if d.name is not None:
                assert d.index == len(calls) and d.index not in named  # name first, once
                named.add(d.index)
                calls.append(C(d.name, d.arguments))
            else:
                assert d.index in named  # arguments only after the name
                calls[d.index].arguments += d.arguments
    return content, calls


@pytest.mark.parametrize("fmt,text,content,calls", CASES)
def test_parse_complete(fmt, text, content, calls):
    assert parse_tool_calls(fmt, text) == (content, calls)


@pytest.mark.parametrize("fmt,text,content,calls", CASES)
def test_stream_every_split_equals_complete(fmt, text, content, calls):
    full = parse_tool_calls(fmt, text)
    assert _stream(fmt, list(text)) == full  # one character at a time
    for i in range(len(text) + 1):  # two pieces, split at every boundary
        got = _stream(fmt, [text[:i], text[i:]])
        assert got == full, i
    for i in range(0, len(text) + 1, 3):  # three pieces
        for j in range(i, len(text) + 1, 5):
            assert _stream(fmt, [text[:i], text[i:j], text[j:]]) == full, (i, j)


@pytest.mark.parametrize("fmt,text,content,calls", CASES)
def test_content_never_holds_markup_even_mid_stream(fmt, text, content, calls):
    p = StreamingToolParser(fmt)
    sent = ""
    for ch in text:
        sent += p.feed(ch)[0]
        if calls:  # every prefix of the markup is held back, never sent
            assert not any(m[:k] and sent.endswith(m[:k]) for m in MARKUP for k in range(2, len(m) + 1))
    sent += p.finish()[0]
    assert not any(m in sent for m in MARKUP)


def test_name_is_sent_before_the_arguments_finish():
    p = StreamingToolParser(HERMES)
    _, d = p.feed('<tool_call>\n{"name": "get_weather"')
    assert d and d[0].name == "get_weather" and d[0].arguments == ""
    _, d = p.feed(', "arguments": {"city": "Pa')
    assert [x.arguments for x in d] == ['{"city": "Pa']
    _, d = p.feed('ris"}}\n</tool')
    assert [x.arguments for x in d] == ['ris"}']  # the last } closes the call object
    assert p.feed("_call>") == ("", [])


def test_registry_and_detection():
    assert set(FORMATS) == {"hermes", "llama3", "mistral"}
    assert get_format("qwen") is HERMES and get_format("Llama3") is LLAMA3
    with pytest.raises(ValueError, match="unknown tool call parser"):
        get_format("nope")
    smollm = "{% for message in messages %}<|im_start|>{{ message['role'] }}{% endfor %}"
    qwen = "{% if tools %}<tools>{% for tool in tools %}{{ tool | tojson }}{% endfor %}<tool_call>"
    llama = "<|start_header_id|>ipython<|end_header_id|>{% if tools %}<|python_tag|>"
    mistral = "{% if tools %}[AVAILABLE_TOOLS]{% endif %}[TOOL_CALLS]"
    assert detect_format(smollm) is HERMES and not template_supports_tools(smollm)
    assert detect_format(qwen) is HERMES and template_supports_tools(qwen)
    assert detect_format(llama) is LLAMA3 and detect_format(mistral) is MISTRAL
    assert detect_format({"default": smollm, "tool_use": mistral}) is MISTRAL
    assert detect_format(None) is HERMES


# --- tools, schemas, grammar ------------------------------------------------------------------

WEATHER = Tool("get_weather", "Weather of a city", {
    "type": "object",
    "properties": {"location": {"type": "object", "properties": {
        "city": {"type": "string"}, "country": {"type": "string"}}, "required": ["city"]},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["location", "unit"]})
ADD = Tool("add", None, {"type": "object", "properties": {
    "numbers": {"type": "array", "items": {"type": "integer"}, "minItems": 1}}, "required": ["numbers"]})
REFS = Tool("book", None, {  # $refs resolve against the tool's own $defs
    "type": "object", "properties": {"who": {"$ref": "#/$defs/Person"}}, "required": ["who"],
    "$defs": {"Person": {"type": "object", "properties": {"name": {"type": "string"}},
                         "required": ["name"]}}})
NOARGS = Tool("ping", None, None)


@pytest.mark.parametrize("tools,match", [
    ([Tool("bad name!", None, None)], "tool name"),
    ([Tool("f", None, None), Tool("f", None, None)], "more than one tool"),
    ([Tool("f", None, {"type": "object", "properties": {"a": {"type": "strnig"}}})],
     r"tools\[0\]: invalid parameter schema"),
    ([Tool("f", None, {"type": "array"})], "must describe an object"),
    ([Tool("f", None, {"type": "object", "required": "a"})], "invalid parameter schema"),
    ([Tool("f", None, {"type": "object", "properties": {"a": {"type": "string", "pattern": "[a-"}}})],
     "schema"),
])
def test_validate_tools_rejects(tools, match):
    with pytest.raises(ValueError, match=match):
        validate_tools(tools)


def test_validate_tools_accepts():
    validate_tools([WEATHER, ADD, REFS, NOARGS])


def _accepts(ebnf: str, text: str) -> bool:
    return xgr.testing._is_grammar_accept_string(xgr.Grammar.from_ebnf(ebnf), text)


def _schema_of(tool):
    return tool.arguments_schema()


@pytest.mark.parametrize("fmt", [HERMES, LLAMA3, MISTRAL], ids=lambda f: f.name)
def test_forced_grammar_accepts_exactly_valid_calls(fmt):
    tools = [WEATHER, ADD, REFS, NOARGS]
    good = [("get_weather", {"location": {"city": "Paris"}, "unit": "celsius"}),
            ("add", {"numbers": [1, 2]}), ("book", {"who": {"name": "Ann"}}), ("ping", {})]
    one = forced_call_constraint(fmt, tools, parallel=False)["ebnf"]
    many = forced_call_constraint(fmt, tools, parallel=True)["ebnf"]
    for name, args in good:
        text = render_calls(fmt, [(name, json.dumps(args))])
        assert _accepts(one, text), text
        # what the grammar produces, the format's parser reads back
        assert parse_tool_calls(fmt, text)[1] == [C(name, json.dumps(args))]
    text = render_calls(fmt, [(n, json.dumps(a)) for n, a in good])
    assert _accepts(many, text) and not _accepts(one, text)
    too_many = render_calls(fmt, [(n, json.dumps(a)) for n, a in (good * 2)[:MAX_PARALLEL_CALLS + 1]])
    assert not _accepts(many, too_many)
    bad = [("get_weather", {"location": {"city": "Paris"}, "unit": "kelvin"}),  # enum
           ("get_weather", {"unit": "celsius"}),  # required nested object
           ("add", {"numbers": []}), ("add", {"numbers": ["1"]}),  # minItems, item type
           ("book", {"who": {}}), ("ping", {"x": 1}), ("nope", {})]  # $ref, no args, name
    for name, args in bad:
        assert not _accepts(one, render_calls(fmt, [(name, json.dumps(args))])), (name, args)
    assert not _accepts(one, "I will not call a tool.")


def test_forced_grammar_named_tool_only():
    ebnf = forced_call_constraint(HERMES, [ADD], parallel=False)["ebnf"]
    assert _accepts(ebnf, render_calls(HERMES, [("add", '{"numbers": [3]}')]))
    assert not _accepts(ebnf, render_calls(HERMES, [("ping", "{}")]))
    # the grammar's JSON has no free whitespace: jump-forward covers keys and punctuation
    assert not _accepts(ebnf, render_calls(HERMES, [("add", '{"numbers":[3]}')]))


class _TM(SimpleNamespace):
    pass


def _tm(parser=None, template="{{ messages }}"):
    return _TM(server_args=SimpleNamespace(tool_call_parser=parser), chat_template=template,
               tokenizer=None)


def test_build_plan_modes_and_errors():
    tm = _tm()
    assert build_plan(tm, [], None, None, True) is None
    plan = build_plan(tm, [WEATHER, ADD], None, None, True)
    assert plan.mode == "auto" and not plan.forced and plan.sampling_params() == {}
    plan = build_plan(tm, [WEATHER, ADD], "required", None, False)
    assert "ebnf" in plan.sampling_params() and plan.max_calls == 1
    plan = build_plan(tm, [WEATHER, ADD], "named", "add", True)
    assert plan.max_calls == 1 and _accepts(plan.sampling_params()["ebnf"],
                                            render_calls(HERMES, [("add", '{"numbers": [1]}')]))
    with pytest.raises(ValueError, match="not in `tools`"):
        build_plan(tm, [WEATHER], "named", "nope", True)
    with pytest.raises(ValueError, match="needs a non-empty"):
        build_plan(tm, [], "required", None, True)
    assert build_plan(_tm("mistral"), [ADD], "required", None, True).sampling_params()[
        "skip_special_tokens"] is False


def test_plan_none_and_single_call_limits():
    text = ('<tool_call>{"name": "add", "arguments": {"numbers": [1]}}</tool_call>'
            '<tool_call>{"name": "ping", "arguments": {}}</tool_call>')
    none = ToolPlan(HERMES, [ADD, NOARGS], "none", None, True)
    assert none.parse(text) == ("", [])
    single = ToolPlan(HERMES, [ADD, NOARGS], "auto", None, False)
    assert single.parse(text)[1] == [C("add", '{"numbers": [1]}')]
    s = single.stream()
    deltas = [d for ch in text for d in s.feed(ch)[1]] + s.feed("", final=True)[1]
    assert {d.index for d in deltas} == {0} and s.n_calls == 1
    s = none.stream()
    outs = [s.feed(ch) for ch in text] + [s.feed("", final=True)]
    assert all(out == ("", []) for out in outs)  # none: no calls, and the markup is not content


def test_render_default_and_template_paths():
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "",
             "tool_calls": [{"id": "c1", "type": "function",
                             "function": {"name": "add", "arguments": '{"numbers": [2, 2]}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "4"},
            {"role": "tool", "tool_call_id": "c2", "content": "5"}]
    out, tools = prepare_messages(HERMES, False, msgs, [ADD])
    assert tools == [ADD.openai_dict()]
    assert [m["role"] for m in out] == ["system", "user", "assistant", "tool"]
    assert out[0]["content"].startswith("Be brief.\n\n") and '"name":"add"' in out[0]["content"]
    assert out[2]["content"] == '<tool_call>\n{"name": "add", "arguments": {"numbers": [2, 2]}}\n</tool_call>'
    assert out[3]["content"] == "<tool_response>\n4\n</tool_response>\n<tool_response>\n5\n</tool_response>"
    assert all("tool_calls" not in m for m in out)
    out, _ = prepare_messages(HERMES, False, msgs, [ADD], results_role="user")
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    out, tools = prepare_messages(HERMES, True, msgs, [ADD])
    assert out[2]["tool_calls"][0]["function"]["arguments"] == {"numbers": [2, 2]}  # dict for tojson
    assert out[3] == msgs[3] and tools == [ADD.openai_dict()]
    out, tools = prepare_messages(HERMES, False, msgs[:2], None)  # tools not offered
    assert out == msgs[:2] and tools is None


# --- the routes over a scripted fake manager --------------------------------------------------

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


def test_generated_arguments_validate_against_their_schema():
    """The schema a forced call is generated from is the tool's own (plus object defaults)."""
    for t in (WEATHER, ADD, REFS):
        jsonschema.validators.validator_for(t.parameters).check_schema(_schema_of(t))
    assert NOARGS.arguments_schema() == {"type": "object", "properties": {}}


def test_anthropic_count_tokens_counts_the_tools(client, fake):
    base = {"messages": [{"role": "user", "content": "q"}]}
    plain = client.post("/v1/messages/count_tokens", json=base).json()["input_tokens"]
    with_tools = client.post("/v1/messages/count_tokens", json={
        **base, "tools": [{"name": "add", "input_schema": ADD.parameters}]}).json()["input_tokens"]
    assert with_tools > plain
