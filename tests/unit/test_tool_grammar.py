"""Tool calling without a model: tool validation, the schemas, the forced-call grammar, the tool
plan and prompt rendering."""

from __future__ import annotations

import json
from types import SimpleNamespace

import jsonschema
import pytest
import xgrammar as xgr

from radixlm.server.tool_calls import ToolPlan, build_plan
from radixlm.server.tool_calls.grammar import (MAX_PARALLEL_CALLS, Tool, forced_call_constraint,
                                               validate_tools)
from radixlm.server.tool_calls.parsers import HERMES, LLAMA3, MISTRAL, ParsedToolCall, parse_tool_calls
from radixlm.server.tool_calls.render import prepare_messages, render_calls
from tool_defs import ADD, NOARGS, REFS, WEATHER


C = ParsedToolCall


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



def test_generated_arguments_validate_against_their_schema():
    """The schema a forced call is generated from is the tool's own (plus object defaults)."""
    for t in (WEATHER, ADD, REFS):
        jsonschema.validators.validator_for(t.parameters).check_schema(_schema_of(t))
    assert NOARGS.arguments_schema() == {"type": "object", "properties": {}}
