"""Tool calling for the OpenAI and Anthropic routes.

    parsers.py   formats by model family + the streaming parser (text -> content, calls)
    grammar.py   tool validation + the grammar that forces a well-formed call
    render.py    tools, calls and results in the prompt
    (here)       ToolPlan: what one request asked for, shared by both APIs

A request's `tool_choice` becomes one of four modes:
    none      tools are not offered; any call markup the model still writes is removed
    auto      tools offered, decoding free; calls are parsed out of whatever the model writes
    required  tools offered, decoding constrained to 1..N calls of any of them (1 unless
              parallel calls are allowed)                       (OpenAI "required", Anthropic "any")
    named     decoding constrained to exactly one call of that tool  (OpenAI function, Anthropic "tool")
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any, Optional

from radixlm.server.tool_calls.grammar import (MAX_PARALLEL_CALLS, Tool, forced_call_constraint,
                                               validate_tools)
from radixlm.server.tool_calls.parsers import (FORMATS, PARSER_NAMES, ParsedToolCall,
                                               StreamingToolParser, ToolCallDelta, ToolCallFormat,
                                               detect_format, get_format, parse_tool_calls,
                                               template_supports_tools)
from radixlm.server.tool_calls.render import prepare_messages

__all__ = ["Tool", "ToolPlan", "ToolCallDelta", "ParsedToolCall", "ToolCallFormat", "FORMATS",
           "PARSER_NAMES", "MAX_PARALLEL_CALLS", "get_format", "detect_format", "model_template",
           "resolve_format", "new_call_id", "prepare_messages", "validate_tools",
           "template_supports_tools"]


def model_template(tm) -> Any:
    """The chat template the server renders with (--chat-template, else the tokenizer's)."""
    own = getattr(tm, "chat_template", None)
    if own:
        return own
    return getattr(getattr(tm, "tokenizer", None), "chat_template", None)


def resolve_format(tm) -> ToolCallFormat:
    """--tool-call-parser, else the format the chat template teaches (Hermes-style if none)."""
    name = getattr(getattr(tm, "server_args", None), "tool_call_parser", None)
    cached = getattr(tm, "_tool_call_format", None)
    if cached is not None:
        return cached
    fmt = get_format(name) if name else detect_format(model_template(tm))
    try:
        tm._tool_call_format = fmt
    except AttributeError:
        pass
    return fmt


def new_call_id(prefix: str = "call_") -> str:
    return prefix + uuid.uuid4().hex[:24]


@dataclass
class ToolPlan:
    fmt: ToolCallFormat
    tools: list[Tool]
    mode: str  # none | auto | required | named
    name: Optional[str]  # the named tool
    parallel: bool

    @property
    def forced(self) -> bool:
        return self.mode in ("required", "named")

    @property
    def offered(self) -> Optional[list[Tool]]:
        """The tools the prompt shows (none: the model is not told about them)."""
        return None if self.mode == "none" or not self.tools else self.tools

    @property
    def max_calls(self) -> Optional[int]:
        return None if self.parallel and self.mode != "named" else 1

    def sampling_params(self) -> dict:
        sp: dict[str, Any] = {}
        if self.forced:
            allowed = [t for t in self.tools if self.mode != "named" or t.name == self.name]
            sp.update(forced_call_constraint(self.fmt, allowed, self.max_calls is None))
        if self.fmt.needs_special_tokens:  # the call marker is a special token
            sp["skip_special_tokens"] = False
        return sp

    def stream(self) -> "ToolStream":
        return ToolStream(self)

    def parse(self, text: str) -> tuple[str, list[ParsedToolCall]]:
        content, calls = parse_tool_calls(self.fmt, text)
        if self.mode == "none":
            return content, []
        return content, calls[:self.max_calls] if self.max_calls else calls


class ToolStream:
    """One choice's streaming parser with the plan's limits applied (calls beyond max_calls and
    any call under `none` are dropped, as `ToolPlan.parse` drops them)."""

    def __init__(self, plan: ToolPlan):
        self.plan = plan
        self.parser = StreamingToolParser(plan.fmt)
        self.n_calls = 0  # calls started (and sent) so far

    def _keep(self, deltas: list[ToolCallDelta]) -> list[ToolCallDelta]:
        if self.plan.mode == "none":
            return []
        limit = self.plan.max_calls
        kept = [d for d in deltas if limit is None or d.index < limit]
        for d in kept:
            if d.name is not None:
                self.n_calls += 1
        return kept

    def feed(self, text: str, final: bool = False) -> tuple[str, list[ToolCallDelta]]:
        content, deltas = self.parser.feed(text)
        if final:
            c2, d2 = self.parser.finish()
            content, deltas = content + c2, deltas + d2
        return content, self._keep(deltas)


def build_plan(tm, tools: Optional[list[Tool]], mode: Optional[str], name: Optional[str],
               parallel: bool, where: str = "tools") -> Optional[ToolPlan]:
    """Validate a request's tools and choice (ValueError -> 400) and plan the request. None when
    the request has no tools and does not ask for a call."""
    tools = tools or []
    mode = mode or ("auto" if tools else "none")
    if mode in ("required", "named") and not tools:
        raise ValueError(f"tool_choice {mode!r} needs a non-empty `{where}` list")
    validate_tools(tools, where)
    if mode == "named":
        names = [t.name for t in tools]
        if name not in names:
            raise ValueError(f"tool_choice names the tool {name!r}, which is not in `{where}` "
                             f"(tools: {', '.join(names)})")
    if not tools:
        return None
    plan = ToolPlan(resolve_format(tm), tools, mode, name, parallel)
    plan.sampling_params()  # builds (and caches) the grammar now: a bad schema is a 400 here
    return plan
