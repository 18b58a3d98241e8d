"""Pydantic models of the OpenAI-compatible requests: /v1/completions, /v1/chat/completions.

Requests are validated here, before anything reaches the TokenizerManager, so a bad field is a
400 that names it. Unknown request fields are ignored (not rejected): clients written for other
servers send vendor extras (`user`, `metadata`, `store`, ...) and must keep working.
The response models live in openai_response_models.py (re-exported here).
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, Field, field_validator, model_validator

from radixlm.server.chat_images import ImageURLPart, check_local_url
from radixlm.server.errors import APIError
from radixlm.server.openai_response_models import (  # noqa: F401  (re-exported: P.<Response model>)
    PromptTokensDetails,
    UsageInfo,
    CompletionLogprobs,
    CompletionChoice,
    CompletionResponse,
    TopLogprob,
    TokenLogprob,
    ChoiceLogprobs,
    FunctionCallOut,
    ToolCallOut,
    ChatMessageOut,
    ChatChoice,
    ChatCompletionResponse,
    DeltaFunctionCall,
    DeltaToolCall,
    DeltaMessage,
    ChatStreamChoice,
    ChatCompletionChunk,
    ModelCard,
    ModelList,
)

MAX_N = 16  # choices per prompt; each is one generate call, so this bounds a request's fan-out
MAX_TOP_LOGPROBS = 20  # OpenAI's bound for chat; also used for completions' `logprobs`


def accepted_model_names(tm) -> set[str]:
    """The served name, the model path it was loaded from, and "default" (SGLang's examples and
    scripts send it) all name the one model this server holds; anything else is a 404."""
    names = {tm.model_name, "default"}
    for path in (getattr(tm, "model_path", None),
                 getattr(getattr(tm, "server_args", None), "model_path", None)):
        if path:
            names.add(str(path))
    return names


def check_model(tm, model: Optional[str]) -> None:
    """A missing model means the served one (curl users often leave it out)."""
    if model is not None and model not in accepted_model_names(tm):
        raise APIError(404, f"The model `{model}` does not exist (this server serves "
                       f"`{tm.model_name}`)", param="model", code="model_not_found")


class StreamOptions(BaseModel):
    include_usage: bool = False


class _SamplingFields(BaseModel):
    """Fields both endpoints share: OpenAI's sampling knobs plus SGLang's extras."""

    model: Optional[str] = None
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    n: int = Field(1, ge=1, le=MAX_N)
    stop: Optional[Union[str, list[str]]] = None
    seed: Optional[int] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    logit_bias: Optional[dict[str, float]] = None  # {token id: bias in [-100, 100]}
    # SGLang extras
    stop_regex: Optional[Union[str, list[str]]] = None
    top_k: int = -1
    min_p: float = Field(0.0, ge=0, le=1)
    repetition_penalty: float = Field(1.0, gt=0, le=2)
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: Optional[list[int]] = None
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    regex: Optional[str] = None
    json_schema: Optional[str] = None
    ebnf: Optional[str] = None
    # disaggregation: set by the PD router (radixlm/router/pd.py), one prompt and n 1 only
    bootstrap_host: Optional[str] = None
    bootstrap_port: Optional[int] = None
    bootstrap_room: Optional[int] = None

    def bootstrap_fields(self, n_requests: int) -> dict[str, Any]:
        """The GenerateReqInput fields of a disaggregated request ({} when colocated)."""
        if self.bootstrap_room is None:
            return {}
        if n_requests != 1:
            raise ValueError("bootstrap_room: a disaggregated request has one prompt and n 1")
        return {"bootstrap_host": self.bootstrap_host, "bootstrap_port": self.bootstrap_port,
                "bootstrap_room": self.bootstrap_room}

    @field_validator("stop")
    @classmethod
    def _stop_nonempty(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        return stops or None

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v):
        if v < 1 and v != -1:
            raise ValueError("top_k must be -1 (disabled) or >= 1")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias_range(cls, v):
        for k, b in (v or {}).items():
            if not -100 <= b <= 100:
                raise ValueError(f"logit_bias of token {k}: must be in [-100, 100] (got {b})")
        return v or None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def sampling_params(self, max_new_tokens: int, seed_offset: int = 0) -> dict[str, Any]:
        """SGLang `sampling_params` for one of the n samples. With a seed and n > 1, sample i uses
        seed + i: the n choices differ, yet the request stays reproducible."""
        sp: dict[str, Any] = {
            "max_new_tokens": max_new_tokens, "min_new_tokens": self.min_tokens,
            "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
            "min_p": self.min_p, "frequency_penalty": self.frequency_penalty,
            "presence_penalty": self.presence_penalty,
            "repetition_penalty": self.repetition_penalty, "ignore_eos": self.ignore_eos,
            "skip_special_tokens": self.skip_special_tokens, "no_stop_trim": self.no_stop_trim,
        }
        optional = {"stop": self.stop, "stop_token_ids": self.stop_token_ids,
                    "stop_regex": self.stop_regex, "logit_bias": self.logit_bias,
                    "regex": self.regex, "json_schema": self.json_schema, "ebnf": self.ebnf,
                    "seed": None if self.seed is None else self.seed + seed_offset}
        sp.update({k: v for k, v in optional.items() if v is not None})
        return sp


class CompletionRequest(_SamplingFields):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: int = Field(16, ge=0)  # OpenAI's default for the legacy endpoint
    echo: bool = False
    logprobs: Optional[int] = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    @field_validator("prompt", mode="before")
    @classmethod
    def _check_prompt(cls, v):
        def is_ids(x):
            return isinstance(x, list) and all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in x)

        if isinstance(v, str):
            items = [v]
        elif is_ids(v) and v:
            items = [v]
        elif isinstance(v, list) and v and (all(isinstance(x, str) for x in v)
                                            or all(is_ids(x) for x in v)):
            items = v
        else:
            raise ValueError("prompt must be a string, a list of strings, a list of token ids "
                             "or a list of token id lists")
        if any(len(x) == 0 for x in items):
            raise ValueError("prompt must not be empty")
        return v

    def prompts(self) -> list[Union[str, list[int]]]:
        """The batch of prompts, each a string or a token id list."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class FunctionCallIn(BaseModel):
    name: str
    arguments: Union[str, dict[str, Any]] = "{}"  # OpenAI sends JSON text; a dict is accepted


class ToolCallIn(BaseModel):
    """A call in an assistant message of the history."""

    id: Optional[str] = None
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessage(BaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[Union[TextPart, ImageURLPart]], None] = None
    name: Optional[str] = None
    tool_calls: Optional[list[ToolCallIn]] = None  # assistant only
    tool_call_id: Optional[str] = None  # tool only: the call this message answers

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, v):
        if isinstance(v, list):
            for part in v:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind not in ("text", "image_url"):
                    raise ValueError(f"content part of type {kind!r} is not supported "
                                     "(only 'text' and 'image_url' parts)")
                image = part.get("image_url") if kind == "image_url" else None
                url = image.get("url") if isinstance(image, dict) else None  # fuzzing: a float
                if isinstance(url, str):  # said here, not as a union's mismatch
                    check_local_url(url)
        return v

    @model_validator(mode="after")
    def _content_required(self):
        # Only an assistant turn may lack content (OpenAI allows it alongside tool_calls).
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content")
        if self.tool_calls and self.role != "assistant":
            raise ValueError(f"a {self.role} message cannot have tool_calls")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(p.text for p in self.content if isinstance(p, TextPart))

    def for_template(self) -> dict:
        # Chat templates know "system", not OpenAI's newer "developer" role.
        role = "system" if self.role == "developer" else self.role
        msg = {"role": role, "content": self.text()}
        if isinstance(self.content, list) and any(isinstance(p, ImageURLPart) for p in self.content):
            # content in order, for chat_images.render (which places the image token)
            msg["_parts"] = [{"type": "text", "text": p.text} if isinstance(p, TextPart) else
                             {"type": "image", "image": p.image_url.url} for p in self.content]
        if self.name is not None:
            msg["name"] = self.name
        if self.tool_calls:
            msg["tool_calls"] = [
                {"id": c.id, "type": "function",
                 "function": {"name": c.function.name, "arguments": c.function.arguments}}
                for c in self.tool_calls]
        if self.tool_call_id is not None:
            msg["tool_call_id"] = self.tool_call_id
        return msg


class JsonSchemaFormat(BaseModel):
    name: Optional[str] = None
    schema_: Optional[dict[str, Any]] = Field(None, alias="schema")
    strict: Optional[bool] = None


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None

    @model_validator(mode="after")
    def _schema_present(self):
        if self.type == "json_schema" and (self.json_schema is None or self.json_schema.schema_ is None):
            raise ValueError("response_format of type json_schema needs json_schema.schema")
        return self


class FunctionDef(BaseModel):
    name: str
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None  # JSON schema; None: no arguments
    strict: Optional[bool] = None


class ChatTool(BaseModel):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Optional[int] = Field(None, ge=0)
    max_completion_tokens: Optional[int] = Field(None, ge=0)  # OpenAI's newer name; wins
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    response_format: Optional[ResponseFormat] = None
    tools: Optional[list[ChatTool]] = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    parallel_tool_calls: bool = True
    # SGLang extras: --reasoning-parser output split (reasoning_content), template variables
    separate_reasoning: bool = True
    stream_reasoning: bool = True
    chat_template_kwargs: Optional[dict[str, Any]] = None

    @field_validator("chat_template_kwargs")
    @classmethod
    def _no_reserved_template_kwargs(cls, v):
        reserved = sorted(set(v or {}) & {"messages", "conversation", "tools", "chat_template",
                                           "tokenize", "add_generation_prompt", "return_dict",
                                           "documents", "continue_final_message"})
        if reserved:
            raise ValueError(f"chat_template_kwargs: {reserved} cannot be set here")
        return v

    @model_validator(mode="after")
    def _consistent(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        fmt = self.response_format
        if fmt is not None and fmt.type != "text" and (self.json_schema or self.regex or self.ebnf):
            raise ValueError("response_format cannot be combined with json_schema, regex or ebnf")
        constrained = (fmt is not None and fmt.type != "text") or self.json_schema or self.regex or self.ebnf
        if constrained and (self.tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice)):
            raise ValueError("a tool_choice that forces a call cannot be combined with "
                             "response_format, json_schema, regex or ebnf")
        return self

    def tool_mode(self) -> tuple[Optional[str], Optional[str]]:
        """(none | auto | required | named, the named function) or (None, None): not given."""
        tc = self.tool_choice
        if isinstance(tc, NamedToolChoice):
            return "named", tc.function.name
        return tc, None

    def requested_max_tokens(self) -> Optional[int]:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
