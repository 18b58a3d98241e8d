"""Tool definitions: validation, and the grammar that guarantees a call.

When the client requires a call (OpenAI `required` or a named function, Anthropic `any` or
`tool`), decoding is constrained by an EBNF grammar that spells the model family's own markup
around one JSON call object per call, each call being one of:

    {"name": "<tool name>", "<args key>": <arguments matching the tool's parameter schema>}

so the output always parses with the family's parser and its arguments validate. The grammar is
assembled from xgrammar pieces: each tool's parameter schema is converted on its own (so its
`$ref`s resolve against its own `$defs`), wrapped in literal text that fixes the name, and the
tools are alternatives of one union. Parallel calls repeat the block up to MAX_PARALLEL_CALLS
times, separated by the format's separator; a single call when parallel calls are off or a
function is named. Literal parts (markup, `{"name": "`, the name when only one tool is allowed,
`", "arguments": `) are what jump-forward then appends without decoding.

JSON inside the grammar has no free whitespace (separators ", " and ": "), as xgrammar writes it.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from typing import Any, Optional

from radixlm.runtime.constrained.json_schema_strings import json_schema_grammar
from radixlm.server.tool_calls.parsers import ToolCallFormat

MAX_PARALLEL_CALLS = 4  # a bound, so a sampled reply cannot repeat calls until max_tokens
TOOL_NAME_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,128}$")


@dataclass(frozen=True)
class Tool:
    name: str
    description: Optional[str]
    parameters: Optional[dict]  # JSON schema of the arguments, as the client sent it

    def arguments_schema(self) -> dict:
        """The schema the arguments are generated from: no schema, or an empty one, means no
        arguments at all; a schema without a type but with properties is an object."""
        s = self.parameters
        if not s:
            return {"type": "object", "properties": {}}
        if "type" not in s and "properties" in s:
            return {"type": "object", **s}
        return s

    def openai_dict(self) -> dict:
        fn: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            fn["description"] = self.description
        if self.parameters is not None:
            fn["parameters"] = self.parameters
        return {"type": "function", "function": fn}


def _xgr():
    import xgrammar

    return xgrammar


def _xgr_message(e: Exception) -> str:
    msg = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
    return msg.split(": ", 1)[-1] if re.match(r"^\[[0-9:]+\]", msg) else msg


def validate_tools(tools: list[Tool], where: str = "tools") -> None:
    """ValueError naming the tool when a name is bad or repeated, or a schema is invalid."""
    seen: set[str] = set()
    for i, t in enumerate(tools):
        at = f"{where}[{i}]"
        if not TOOL_NAME_RE.match(t.name or ""):
            raise ValueError(f"{at}: tool name {t.name!r} must be 1-128 characters of "
                             "letters, digits, '_', '-' or '.'")
        if t.name in seen:
            raise ValueError(f"{at}: tool name {t.name!r} is used by more than one tool")
        seen.add(t.name)
        if t.parameters is None:
            continue
        if not isinstance(t.parameters, dict):
            raise ValueError(f"{at}: the parameter schema must be a JSON object")
        typ = t.parameters.get("type")
        if typ is not None and typ != "object":
            raise ValueError(f"{at}: the parameter schema must describe an object "
                             f"(type 'object'), not {typ!r}")
        _check_schema(json.dumps(t.parameters, sort_keys=True), at)


@functools.lru_cache(maxsize=256)
def _check_schema(schema_json: str, at: str) -> None:
    schema = json.loads(schema_json)
    try:
        import jsonschema
    except ImportError:  # the meta-schema check is optional; xgrammar below is not
        jsonschema = None
    if jsonschema is not None:
        try:
            jsonschema.validators.validator_for(schema).check_schema(schema)
        except jsonschema.SchemaError as e:
            path = "/".join(str(p) for p in e.path)
            raise ValueError(f"{at}: invalid parameter schema: {e.message}"
                             + (f" (at {path})" if path else "")) from None
    try:
        _xgr().Grammar.from_json_schema(schema_json, any_whitespace=False)
    except (RuntimeError, ValueError, TypeError) as e:
        raise ValueError(f"{at}: unsupported parameter schema: {_xgr_message(e)}") from None


def _lit(text: str):
    return _xgr().Grammar.from_ebnf(f"root ::= {json.dumps(text)}")


def _call_grammar(fmt: ToolCallFormat, tools: list[Tool]):
    xgr = _xgr()
    alts = []
    for t in tools:
        args = json_schema_grammar(t.arguments_schema())
        head = "{" + f'"name": {json.dumps(t.name)}, "{fmt.args_key}": '
        alts.append(xgr.Grammar.concat(_lit(head), args, _lit("}")))
    return alts[0] if len(alts) == 1 else xgr.Grammar.union(*alts)


# markup around calls: (before all, around each call: open, close; between calls, after all)
_LAYOUT = {
    "hermes": ("", "<tool_call>\n", "\n</tool_call>", "\n", ""),
    "llama3": ("", "", "", "; ", ""),
    "mistral": ("[TOOL_CALLS] [", "", "", ", ", "]"),
}


def tool_call_ebnf(fmt: ToolCallFormat, tools: list[Tool], parallel: bool) -> str:
    """EBNF text of "one or more calls of these tools" (one only unless parallel)."""
    xgr = _xgr()
    before, open_, close, sep, after = _LAYOUT[fmt.name]
    call = _call_grammar(fmt, tools)
    block = xgr.Grammar.concat(*[g for g in (_lit(open_) if open_ else None, call,
                                             _lit(close) if close else None) if g is not None])
    seq = block
    if parallel and MAX_PARALLEL_CALLS > 1:
        tail = None  # tail_k: up to k more calls, each preceded by the separator
        for _ in range(MAX_PARALLEL_CALLS - 1):
            more = xgr.Grammar.concat(_lit(sep), block, *([tail] if tail is not None else []))
            tail = xgr.Grammar.union(_lit(""), more)
        seq = xgr.Grammar.concat(block, tail)
    parts = [g for g in (_lit(before) if before else None, seq, _lit(after) if after else None)
             if g is not None]
    grammar = parts[0] if len(parts) == 1 else xgr.Grammar.concat(*parts)
    return str(grammar)


@functools.lru_cache(maxsize=128)
def _cached_ebnf(fmt: ToolCallFormat, key: str, parallel: bool) -> str:
    tools = [Tool(n, None, p) for n, p in json.loads(key)]
    return tool_call_ebnf(fmt, tools, parallel)


def forced_call_constraint(fmt: ToolCallFormat, tools: list[Tool], parallel: bool) -> dict:
    """`sampling_params` entries that force one (or, with parallel, 1..N) call of `tools`."""
    for i, t in enumerate(tools):  # schemas the meta-schema accepts may still be unsupported
        _check_schema(json.dumps(t.arguments_schema(), sort_keys=True), f"tools[{t.name}]")
    key = json.dumps([[t.name, t.arguments_schema()] for t in tools], sort_keys=True)
    try:
        return {"ebnf": _cached_ebnf(fmt, key, parallel)}
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"tools: cannot build the tool call grammar: {_xgr_message(e)}") from None
