"""The /v1/responses request (OpenAI's Responses API, as the openai SDK sends it) and its input
items turned into the chat messages the chat path renders (chat template, tool calls).

Field names follow `openai/types/responses/response_create_params.py`. Unlike the chat route,
unknown fields are a 400 that names them: the Responses API is new enough that no client sends
vendor extras by habit, and a misspelt field (`max_tokens` here) silently ignored would be worse.
Fields of OpenAI's API whose machinery this server lacks (`background`, `conversation`, hosted
tools, ...) are a 400 that says so, unless their value asks for nothing (`background: false`).

Input items (the union OpenAI calls ResponseInputItem) become chat messages:
    message (role user | system | developer | assistant; content a string or text parts)
                                    -> that role's message (developer as system)
    function_call                   -> an assistant message's tool_calls (consecutive calls, and
                                       an assistant text right before them, make one message)
    function_call_output            -> a tool message answering call_id
    reasoning                       -> dropped: earlier turns' reasoning is not shown to the model
                                       again (what chat templates of reasoning models do too)
"""

from __future__ import annotations

import json
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator

from radixlm.server.errors import APIError

# Fields of OpenAI's API served as OpenAI documents them (see ResponsesRequest), plus SGLang's
# sampling extras.
_SERVED = {"model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls",
           "text", "max_output_tokens", "temperature", "top_p", "stream", "store",
           "previous_response_id", "reasoning", "metadata", "user", "safety_identifier",
           "prompt_cache_key", "service_tier", "truncation", "include", "top_logprobs",
           "stream_options", "background", "max_tool_calls",
           "top_k", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty",
           "stop", "seed"}
# Fields of OpenAI's API this server cannot serve (any value but null is a 400 saying so).
_NOT_SERVED = {"conversation": "conversations are not stored here; use previous_response_id",
               "prompt": "prompt templates are not stored here",
               "context_management": "context management is not done here",
               "moderation": "no moderation model is served"}


class FunctionTool(BaseModel):
    type: Literal["function"]
    name: str
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None


class NamedFunctionChoice(BaseModel):
    type: Literal["function"]
    name: str


class TextFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: Optional[str] = None
    schema_: Optional[dict[str, Any]] = Field(None, alias="schema")
    description: Optional[str] = None
    strict: Optional[bool] = None

    @model_validator(mode="after")
    def _schema_present(self):
        if self.type == "json_schema" and self.schema_ is None:
            raise ValueError("a json_schema format needs `schema`")
        return self

    def wire(self) -> dict:
        out: dict[str, Any] = {"type": self.type}
        if self.type == "json_schema":
            out.update(name=self.name or "response", schema=self.schema_, strict=self.strict,
                       description=self.description)
        return out


class TextConfig(BaseModel):
    format: TextFormat = Field(default_factory=TextFormat)
    verbosity: Optional[Literal["low", "medium", "high"]] = None


class ReasoningConfig(BaseModel):
    effort: Optional[Literal["none", "minimal", "low", "medium", "high", "xhigh"]] = None
    summary: Optional[Literal["auto", "concise", "detailed"]] = None
    generate_summary: Optional[Literal["auto", "concise", "detailed"]] = None


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(populate_by_name=True)

    model: Optional[str] = None
    input: Union[str, list[dict[str, Any]]]
    instructions: Optional[str] = None
    tools: Optional[list[FunctionTool]] = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedFunctionChoice, None] = None
    parallel_tool_calls: Optional[bool] = None
    text: Optional[TextConfig] = None
    max_output_tokens: Optional[int] = Field(None, ge=1)
    temperature: Optional[float] = Field(None, ge=0, le=2)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    stream: Optional[bool] = False
    store: Optional[bool] = True
    previous_response_id: Optional[str] = None
    reasoning: Optional[ReasoningConfig] = None
    metadata: Optional[dict[str, str]] = None
    # accepted, with no effect on the output: who asks, cache and tier hints, what OpenAI
    # would leave out of `include` anyway
    user: Optional[str] = None
    safety_identifier: Optional[str] = None
    prompt_cache_key: Optional[str] = None
    service_tier: Optional[str] = None
    truncation: Optional[Literal["disabled"]] = None  # "auto" (dropping old items): not done
    include: Optional[list[str]] = Field(None, max_length=0)
    top_logprobs: Optional[int] = Field(None, ge=0, le=0)
    stream_options: Optional[dict[str, Any]] = None
    background: Optional[Literal[False]] = None
    max_tool_calls: Optional[int] = Field(None, ge=1)
    # SGLang's sampling extras
    top_k: int = -1
    min_p: float = Field(0.0, ge=0, le=1)
    repetition_penalty: float = Field(1.0, gt=0, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    stop: Optional[Union[str, list[str]]] = None
    seed: Optional[int] = None

    @model_validator(mode="after")
    def _consistent(self):
        if self.top_k < 1 and self.top_k != -1:
            raise ValueError("top_k must be -1 (disabled) or >= 1")
        fmt = self.text.format if self.text is not None else None
        forced = self.tool_choice == "required" or isinstance(self.tool_choice,
                                                               NamedFunctionChoice)
        if forced and fmt is not None and fmt.type != "text":
            raise ValueError("a tool_choice that forces a call cannot be combined with a "
                             "json text.format")
        if isinstance(self.input, str) and not self.input:
            raise ValueError("input must not be empty")
        return self

    def tool_mode(self) -> tuple[Optional[str], Optional[str]]:
        tc = self.tool_choice
        if isinstance(tc, NamedFunctionChoice):
            return "named", tc.name
        return tc, None

    def tool_choice_wire(self) -> Any:
        tc = self.tool_choice
        if isinstance(tc, NamedFunctionChoice):
            return {"type": "function", "name": tc.name}
        return tc or "auto"

    def format_constraint(self) -> dict:
        """The sampling params of text.format: a JSON schema the output is decoded under."""
        fmt = self.text.format if self.text is not None else None
        if fmt is None or fmt.type == "text":
            return {}
        schema = {"type": "object"} if fmt.type == "json_object" else fmt.schema_
        return {"json_schema": json.dumps(schema)}

    def sampling_params(self, max_new_tokens: int) -> dict:
        sp: dict[str, Any] = {
            "max_new_tokens": max_new_tokens,
            "temperature": 1.0 if self.temperature is None else self.temperature,
            "top_p": 1.0 if self.top_p is None else self.top_p, "top_k": self.top_k,
            "min_p": self.min_p, "repetition_penalty": self.repetition_penalty,
            "frequency_penalty": self.frequency_penalty,
            "presence_penalty": self.presence_penalty, **self.format_constraint()}
        stops = [self.stop] if isinstance(self.stop, str) else self.stop
        if stops:
            if any(not s for s in stops):
                raise APIError(400, "stop: stop strings must be non-empty", "stop")
            sp["stop"] = stops
        if self.seed is not None:
            sp["seed"] = self.seed
        return sp


def parse_request(body: dict) -> ResponsesRequest:
    """The validated request, or an APIError naming the offending field."""
    unknown = sorted(set(body) - _SERVED - set(_NOT_SERVED))
    if unknown:
        raise APIError(400, f"unknown field(s) {', '.join(map(repr, unknown))}: /v1/responses "
                       f"does not take them", param=unknown[0])
    for name, why in _NOT_SERVED.items():
        if body.get(name) is not None:
            raise APIError(400, f"{name}: not supported by this server ({why})", param=name)
    return ResponsesRequest.model_validate(body)


# --- input items -> chat messages ---------------------------------------------------------------

_TEXT_PARTS = ("input_text", "output_text", "text")


def _content_text(content: Any, where: str) -> str:
    """A message's content (a string, or text parts) as one string."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where}: must be a string or a list of content parts", where)
    out = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in _TEXT_PARTS and isinstance(part.get("text"), str):
            out.append(part["text"])
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            out.append(part["refusal"])
        else:
            raise APIError(400, f"{where}[{j}]: content part of type {kind!r} is not supported "
                           f"(only input_text / output_text parts)", f"{where}[{j}]")
    return "\n".join(out)


def _string_field(item: dict, key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise APIError(400, f"{where}.{key}: required, a string", f"{where}.{key}")
    return value


def input_messages(items: Union[str, list[dict]], where: str = "input") -> list[dict]:
    """Chat-template messages of the request's input (see the module docstring)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict] = []
    for i, item in enumerate(items):
        at = f"{where}[{i}]"
        if not isinstance(item, dict):
            raise APIError(400, f"{at}: must be an object", at)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise APIError(400, f"{at}.role: must be user, system, developer or assistant "
                               f"(got {role!r})", f"{at}.role")
            text = _content_text(item.get("content"), f"{at}.content")
            messages.append({"role": "system" if role == "developer" else role, "content": text})
        elif kind == "function_call":
            call = {"id": _string_field(item, "call_id", at), "type": "function",
                    "function": {"name": _string_field(item, "name", at),
                                 "arguments": _string_field(item, "arguments", at)}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else _content_text(output, f"{at}.output")
            messages.append({"role": "tool", "tool_call_id": _string_field(item, "call_id", at),
                             "content": text})
        elif kind == "reasoning":
            continue
        else:
            raise APIError(400, f"{at}.type: input items of type {kind!r} are not supported "
                           f"(message, function_call, function_call_output, reasoning)",
                           f"{at}.type")
    if not messages:
        raise APIError(400, f"{where}: holds no message", where)
    return messages
