"""Tools shared by the tool-calling tests (test_tool_grammar.py, test_tool_routes.py)."""

from __future__ import annotations

from radixlm.server.tool_calls.grammar import Tool

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
