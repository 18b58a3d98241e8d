"""Tool calling end to end: the real `openai` and `anthropic` SDKs against the real server, on a
random tiny Llama with SmolLM2's tokenizer and chat template (no tool support in the template, so
radixlm renders the tools itself). What is checked holds for any model: forced calls are decoded
under a grammar, and a random model explores the schemas' corners more than SmolLM2 does (it
found xgrammar's raw control characters in bounded strings: constrained/json_schema_strings.py).

The 150 forced calls (50 `required`, 50 named, 50 Anthropic `any`) at temperature 1.0 run as one
concurrent batch in a module fixture; the tests then check their share. Every call must come
back as a call (finish_reason "tool_calls" / stop_reason "tool_use") whose arguments validate
against the tool's schema. Strings, arrays and integers in the schemas are bounded so that a call
always fits in max_tokens: a reply cut off by max_tokens is the one way a forced call can be
incomplete (it then ends with finish_reason "length").
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import anthropic
import jsonschema
import openai
import pytest

pytestmark = pytest.mark.slow

N_FORCED = 50
# Enough for the longest call the schemas allow even in the worst tokenization (every bounded
# string filled with characters of ~3 tokens each): a forced call always completes. Replies end
# when their grammar does, so the bound costs nothing.
MAX_TOKENS = 320
MARKUP = ("<tool_call", "</tool_call", "<tool_response", "[TOOL_CALLS]", "<|python_tag|>")

WEATHER = {  # nested object + enum
    "type": "object",
    "properties": {
        "location": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 24},
            "country": {"type": "string", "maxLength": 24}}, "required": ["city"]},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["location", "unit"]}
TRIP = {  # array of objects + enum + bounded integers
    "type": "object",
    "properties": {
        "stops": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
            "type": "object", "properties": {
                "city": {"type": "string", "maxLength": 20},
                "nights": {"type": "integer", "minimum": 1, "maximum": 14}},
            "required": ["city", "nights"]}},
        "travel_class": {"type": "string", "enum": ["economy", "business", "first"]}},
    "required": ["stops", "travel_class"]}
ADD = {  # array of integers
    "type": "object",
    "properties": {"numbers": {"type": "array", "items": {"type": "integer", "minimum": -9999,
                                                          "maximum": 9999},
                               "minItems": 1, "maxItems": 5}},
    "required": ["numbers"]}
SCHEMAS = {"get_weather": WEATHER, "plan_trip": TRIP, "add_numbers": ADD}
DESCRIPTIONS = {"get_weather": "Current weather in a city", "plan_trip": "Plan a trip with stops",
                "add_numbers": "Add integers"}
OA_TOOLS = [{"type": "function", "function": {"name": n, "description": DESCRIPTIONS[n], "parameters": s}}
            for n, s in SCHEMAS.items()]
AN_TOOLS = [{"name": n, "description": DESCRIPTIONS[n], "input_schema": s} for n, s in SCHEMAS.items()]
ASK = [{"role": "user", "content": "Plan a weekend in Rome, check the weather there, and add 2 and 3."}]
NAMES = list(SCHEMAS)


def _valid(name: str, args) -> None:
    assert name in SCHEMAS, name
    if isinstance(args, str):
        args = json.loads(args)
    jsonschema.validate(args, SCHEMAS[name])


def _no_markup(text) -> None:
    assert not any(m in (text or "") for m in MARKUP), text


@pytest.fixture(scope="module")
def server(tiny_server):
    """The session's shared tiny-model server (tests/conftest.py)."""
    return tiny_server


@pytest.fixture(scope="module")
def oa(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=600)


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=600)


def _required(oa, i):
    return oa.chat.completions.create(model="default", messages=ASK, tools=OA_TOOLS,
                                      tool_choice="required", parallel_tool_calls=False,
                                      temperature=1.0, max_tokens=MAX_TOKENS)


def _named(oa, i):
    choice = {"type": "function", "function": {"name": NAMES[i % 3]}}
    return oa.chat.completions.create(model="default", messages=ASK, tools=OA_TOOLS,
                                      tool_choice=choice, temperature=1.0, max_tokens=MAX_TOKENS)


def _any(claude, i):
    return claude.messages.create(model="default", max_tokens=MAX_TOKENS, messages=ASK, tools=AN_TOOLS,
                                  tool_choice={"type": "any", "disable_parallel_tool_use": True},
                                  extra_body={"temperature": 1.0})


@pytest.fixture(scope="module")
def pool():
    with ThreadPoolExecutor(256) as ex:
        yield ex


@pytest.fixture(scope="module")
def jobs(oa, claude, pool):
    """Every request of this module, submitted at once (futures): on a CPU one big batch costs
    little more per step than a small one, so all tests share it. First one forced call of
    each kind alone: their prompts are then in the radix cache for the other 147."""
    kinds = {"required": (_required, oa), "named": (_named, oa), "any": (_any, claude)}
    for warm in [pool.submit(fn, client, 0) for fn, client in kinds.values()]:
        warm.result()
    jobs = {kind: [pool.submit(fn, client, i) for i in range(N_FORCED)]
            for kind, (fn, client) in kinds.items()}
    jobs.update({
        "parallel": pool.submit(_parallel, oa),
        "multi_openai": pool.submit(_multi_turn_openai, oa),
        "multi_anthropic": pool.submit(_multi_turn_anthropic, claude),
        "stream_anthropic": (pool.submit(_anthropic_whole, claude), pool.submit(_anthropic_stream, claude)),
        **{f"stream_{name}": (pool.submit(_openai_whole, oa, choice), pool.submit(_openai_stream, oa, choice))
           for name, choice in STREAM_CHOICES.items()},
    })
    return jobs


def test_required_calls_always_parse_and_validate(jobs):
    results = [f.result() for f in jobs["required"]]
    assert len(results) == N_FORCED
    for r in results:
        (choice,) = r.choices
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.content is None
        (call,) = choice.message.tool_calls  # parallel_tool_calls=False: exactly one
        assert call.type == "function" and call.id.startswith("call_")
        _valid(call.function.name, call.function.arguments)
    used = {r.choices[0].message.tool_calls[0].function.name for r in results}
    assert len(used) >= 2  # temperature 1.0 does pick among the tools


def test_named_calls_always_parse_and_validate(jobs):
    results = [f.result() for f in jobs["named"]]
    assert len(results) == N_FORCED
    for i, r in enumerate(results):
        (choice,) = r.choices
        assert choice.finish_reason == "tool_calls", choice
        (call,) = choice.message.tool_calls
        assert call.function.name == NAMES[i % 3]
        _valid(call.function.name, call.function.arguments)


def test_anthropic_any_calls_always_parse_and_validate(jobs):
    results = [f.result() for f in jobs["any"]]
    assert len(results) == N_FORCED
    for m in results:
        assert m.stop_reason == "tool_use", m
        (use,) = [b for b in m.content if b.type == "tool_use"]
        assert use.id.startswith("toolu_") and isinstance(use.input, dict)
        _valid(use.name, use.input)
        assert all(b.type != "text" for b in m.content)  # a forced call has no text around it


def _parallel(oa):
    # one short tool, so that up to four calls stay cheap
    return oa.chat.completions.create(model="default", messages=[{"role": "user", "content": "Add 2 and 3, "
                                      "then 4 and 5."}], tools=OA_TOOLS[2:], tool_choice="required",
                                      temperature=1.0, seed=7, max_tokens=4 * MAX_TOKENS)


def test_parallel_required_calls_validate(jobs):
    (choice,) = jobs["parallel"].result().choices
    assert choice.finish_reason == "tool_calls" and 1 <= len(choice.message.tool_calls) <= 4
    for call in choice.message.tool_calls:
        _valid(call.function.name, call.function.arguments)
    assert len({c.id for c in choice.message.tool_calls}) == len(choice.message.tool_calls)


def _multi_turn_openai(oa):
    messages = [{"role": "user", "content": "What is the weather in Paris, in celsius?"}]
    first = oa.chat.completions.create(model="default", messages=messages, tools=OA_TOOLS[:1],
                                       tool_choice="required", parallel_tool_calls=False,
                                       temperature=0, max_tokens=MAX_TOKENS)
    msg = first.choices[0].message
    messages += [msg.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": msg.tool_calls[0].id,
                  "content": json.dumps({"temperature": 21, "condition": "sunny"})}]
    final = oa.chat.completions.create(model="default", messages=messages, tools=OA_TOOLS[:1],
                                       temperature=0, max_tokens=40)
    return first, final


def test_multi_turn_openai(jobs):
    first, final = jobs["multi_openai"].result()
    (call,) = first.choices[0].message.tool_calls
    assert first.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    _valid("get_weather", call.function.arguments)
    (choice,) = final.choices
    assert choice.finish_reason in ("stop", "length") and not choice.message.tool_calls
    assert choice.message.content and choice.message.content.strip()
    _no_markup(choice.message.content)


def _multi_turn_anthropic(claude):
    messages = [{"role": "user", "content": "How much is 19 plus 23?"}]
    first = claude.messages.create(model="default", max_tokens=MAX_TOKENS, messages=messages,
                                   tools=AN_TOOLS, tool_choice={"type": "tool", "name": "add_numbers"},
                                   extra_body={"temperature": 0})
    (use,) = [b for b in first.content if b.type == "tool_use"]
    messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                               "content": str(sum(use.input.get("numbers", [])))}]}]
    final = claude.messages.create(model="default", max_tokens=40, messages=messages, tools=AN_TOOLS,
                                   tool_choice={"type": "none"}, extra_body={"temperature": 0})
    return first, final


def test_multi_turn_anthropic(jobs):
    first, final = jobs["multi_anthropic"].result()
    assert first.stop_reason == "tool_use"
    (use,) = [b for b in first.content if b.type == "tool_use"]
    assert use.name == "add_numbers"
    _valid(use.name, use.input)
    assert final.stop_reason in ("end_turn", "max_tokens")
    (text,) = final.content
    assert text.type == "text" and text.text.strip()
    _no_markup(text.text)


STREAM_CHOICES = {"required": "required", "named": {"type": "function", "function": {"name": "plan_trip"}},
                  "auto": "auto"}


def _stream_kw(choice) -> dict:
    # greedy, so the streamed and the whole reply are the same generation
    return dict(model="default", messages=ASK, tools=OA_TOOLS, tool_choice=choice, temperature=0,
                seed=3, max_tokens=MAX_TOKENS if choice != "auto" else 40, parallel_tool_calls=False)


def _openai_whole(oa, choice):
    return oa.chat.completions.create(**_stream_kw(choice))


def _openai_stream(oa, choice):
    content, calls, finish = "", {}, None
    for chunk in oa.chat.completions.create(stream=True, **_stream_kw(choice)):
        for c in chunk.choices:
            _no_markup(c.delta.content)
            content += c.delta.content or ""
            for tc in c.delta.tool_calls or []:
                if tc.id is not None:  # the first delta of a call: its name
                    assert tc.index not in calls and tc.function.name
                    calls[tc.index] = [tc.id, tc.function.name, tc.function.arguments or ""]
                else:
                    calls[tc.index][2] += tc.function.arguments
            finish = c.finish_reason or finish
    return content, [tuple(calls[i][1:]) for i in sorted(calls)], finish


@pytest.mark.parametrize("choice", list(STREAM_CHOICES))
def test_openai_stream_reassembles_to_the_non_streamed_reply(jobs, choice):
    whole_f, stream_f = jobs[f"stream_{choice}"]
    whole = whole_f.result().choices[0]
    content, calls, finish = stream_f.result()
    assert calls == [(c.function.name, c.function.arguments) for c in whole.message.tool_calls or []]
    assert content == (whole.message.content or "") and finish == whole.finish_reason
    _no_markup(whole.message.content)
    if choice != "auto":
        assert finish == "tool_calls" and len(calls) == 1
        _valid(*calls[0])


def _anthropic_kw() -> dict:
    return dict(model="default", max_tokens=MAX_TOKENS, messages=ASK, tools=AN_TOOLS,
                tool_choice={"type": "any", "disable_parallel_tool_use": True},
                extra_body={"temperature": 0})


def _anthropic_whole(claude):
    return claude.messages.create(**_anthropic_kw())


def _anthropic_stream(claude):
    fragments = []
    with claude.messages.stream(**_anthropic_kw()) as stream:
        for event in stream:
            if event.type == "content_block_delta" and event.delta.type == "input_json_delta":
                fragments.append(event.delta.partial_json)
            if event.type == "content_block_delta" and event.delta.type == "text_delta":
                _no_markup(event.delta.text)
        return fragments, stream.get_final_message()


def test_anthropic_stream_reassembles_to_the_non_streamed_reply(jobs):
    whole_f, stream_f = jobs["stream_anthropic"]
    whole = whole_f.result()
    fragments, streamed = stream_f.result()
    assert streamed.stop_reason == whole.stop_reason == "tool_use"
    shape = lambda m: [(b.type, getattr(b, "name", None), getattr(b, "input", None), getattr(b, "text", None))
                       for b in m.content]
    assert shape(streamed) == shape(whole)
    (use,) = [b for b in whole.content if b.type == "tool_use"]
    assert fragments and json.loads("".join(fragments)) == use.input  # input_json_delta pieces
    _valid(use.name, use.input)


def test_invalid_schema_and_unknown_tool_are_400(oa, claude, server):
    bad_schema = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "strnig"}}}}}]
    with pytest.raises(openai.BadRequestError, match="invalid parameter schema"):
        oa.chat.completions.create(model="default", messages=ASK, tools=bad_schema, max_tokens=5)
    with pytest.raises(openai.BadRequestError, match="not in `tools`"):
        oa.chat.completions.create(model="default", messages=ASK, tools=OA_TOOLS, max_tokens=5,
                                   tool_choice={"type": "function", "function": {"name": "nope"}})
    with pytest.raises(anthropic.BadRequestError, match="invalid parameter schema"):
        claude.messages.create(model="default", max_tokens=5, messages=ASK, tools=[
            {"name": "f", "input_schema": {"type": "object", "properties": {"x": {"type": 3}}}}])
    with pytest.raises(anthropic.BadRequestError, match="not in `tools`"):
        claude.messages.create(model="default", max_tokens=5, messages=ASK, tools=AN_TOOLS,
                               tool_choice={"type": "tool", "name": "nope"})
    server.assert_serving()
