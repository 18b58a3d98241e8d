"""Tool calling without a model: the parsers (complete and streamed at every split) and the
registry. Tool validation, the forced-call grammar and prompt rendering are in
test_tool_grammar.py; both HTTP routes over a scripted fake manager in test_tool_routes.py."""

from __future__ import annotations

import pytest

from radixlm.server.tool_calls.parsers import (FORMATS, HERMES, LLAMA3, MISTRAL, ParsedToolCall,
                                               StreamingToolParser, detect_format, get_format,
                                               parse_tool_calls, template_supports_tools)


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
