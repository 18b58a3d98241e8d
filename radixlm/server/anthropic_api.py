"""Anthropic Messages API (`POST /v1/messages`) over `TokenizerManager.generate`, so Anthropic
clients can talk to a local model. Text, tool (`tool_use`, `tool_result`) and, for vision models,
base64 image blocks (server/chat_images.py); documents are refused (400). Tools: tool_calls/.

Behaviour worth knowing:
- A final assistant message is a prefill: the prompt is the template rendered up to a new
  assistant turn, plus that text, and the reply continues it (as Anthropic documents).
- `usage.input_tokens` counts the prompt tokens that were NOT read from the radix cache and
  `cache_read_input_tokens` those that were, as Anthropic splits them (their sum is the prompt).
- With tools, the reply's content is a text block (when the model wrote text) followed by one
  `tool_use` block per call, and `stop_reason` is "tool_use" when it made calls; streamed, each
  block opens when it starts (a tool_use block carries its name at once; its input follows as
  `input_json_delta` fragments). A call's `input` is its arguments JSON; arguments that do not
  parse as an object (a reply cut off by max_tokens) give `{}` in a non-streamed reply.
- Errors use Anthropic's shape `{"type": "error", "error": {"type", "message"}}`; inside a stream
  they are an `event: error` with that body.
"""

from __future__ import annotations

import json
import uuid
from typing import Annotated, Any, Literal, Optional, Union

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, Field, field_validator, model_validator

from radixlm.server import chat_images
from radixlm.server import tool_calls as T
from radixlm.server.chat_images import ImageBlock
from radixlm.server.errors import (APIError, anthropic_error_body, anthropic_error_response,
                                   anthropic_error_type, read_json_object, to_api_error)
from radixlm.server.io_struct import GenerateReqInput
from radixlm.server.openai_chat import apply_chat_template_with_tools
from radixlm.server.openai_common import all_updates, close_all, finish_of, start_generations
from radixlm.server.openai_protocol import check_model


class TextBlock(BaseModel):
    type: Literal["text"]
    text: str


def _text_blocks_only(v):
    if isinstance(v, list):
        for block in v:
            kind = block.get("type") if isinstance(block, dict) else None
            if kind != "text":
                raise ValueError(f"content block of type {kind!r} is not supported "
                                 "(only 'text' blocks)")
    return v


def _join(content: Union[str, list[TextBlock], None]) -> str:
    if content is None:
        return ""
    return content if isinstance(content, str) else "\n".join(b.text for b in content)


class ToolUseBlock(BaseModel):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(BaseModel):
    type: Literal["tool_result"]
    tool_use_id: str
    content: Union[str, list[TextBlock], None] = None
    is_error: Optional[bool] = None

    _blocks = field_validator("content", mode="before")(_text_blocks_only)


MESSAGE_BLOCKS = {"user": ("text", "image", "tool_result"), "assistant": ("text", "tool_use")}


class InputMessage(BaseModel):
    role: Literal["user", "assistant"]
    content: Union[str, list[Annotated[Union[TextBlock, ImageBlock, ToolUseBlock,
                                             ToolResultBlock], Field(discriminator="type")]]]

    @model_validator(mode="before")
    @classmethod
    def _known_blocks(cls, v):
        if isinstance(v, dict) and isinstance(v.get("content"), list):
            allowed = MESSAGE_BLOCKS.get(v.get("role"), ("text",))
            for block in v["content"]:
                kind = block.get("type") if isinstance(block, dict) else None
                if kind not in allowed:
                    raise ValueError(f"content block of type {kind!r} is not supported in a "
                                     f"{v.get('role')} message (only {' and '.join(allowed)})")
        return v

    def chat_messages(self) -> list[dict]:
        """OpenAI-shaped messages: tool results become `tool` messages (before the user's
        text, as Anthropic orders them), tool uses the assistant's `tool_calls`."""
        if isinstance(self.content, str):
            return [{"role": self.role, "content": self.content}]
        texts = [b.text for b in self.content if isinstance(b, TextBlock)]
        out: list[dict] = []
        if self.role == "user":
            for b in self.content:
                if isinstance(b, ToolResultBlock):
                    text = b.content if isinstance(b.content, str) else _join(b.content)
                    out.append({"role": "tool", "tool_call_id": b.tool_use_id,
                                "content": ("Error: " + text) if b.is_error else text})
            if texts or not out:
                out.append({"role": "user", "content": "\n".join(texts)})
            if any(isinstance(b, ImageBlock) for b in self.content):  # see chat_images.render
                out[-1]["_parts"] = [{"type": "image", "image": b.data_url()} if isinstance(
                    b, ImageBlock) else {"type": "text", "text": b.text} for b in self.content
                    if isinstance(b, (TextBlock, ImageBlock))]
            return out
        msg: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts)}
        calls = [{"id": b.id, "type": "function",
                  "function": {"name": b.name, "arguments": json.dumps(b.input, ensure_ascii=False)}}
                 for b in self.content if isinstance(b, ToolUseBlock)]
        if calls:
            msg["tool_calls"] = calls
        return [msg]


class AnthropicTool(BaseModel):
    name: str
    description: Optional[str] = None
    input_schema: dict[str, Any]
    type: Optional[str] = None  # client tools only ("custom" or absent)

    @model_validator(mode="before")
    @classmethod
    def _client_tool(cls, v):
        kind = v.get("type") if isinstance(v, dict) else None
        if kind not in (None, "custom"):
            raise ValueError(f"tools of type {kind!r} (server tools) are not supported; only "
                             "client tools with an input_schema")
        return v


class ToolChoice(BaseModel):
    type: Literal["auto", "any", "tool", "none"]
    name: Optional[str] = None
    disable_parallel_tool_use: bool = False

    @model_validator(mode="after")
    def _named(self):
        if self.type == "tool" and not self.name:
            raise ValueError("tool_choice of type 'tool' needs the tool's name")
        return self


def _tool_plan(tm, req) -> Optional[T.ToolPlan]:
    tools = [T.Tool(t.name, t.description, t.input_schema) for t in (req.tools or [])]
    tc = req.tool_choice
    mode = None if tc is None else {"auto": "auto", "any": "required", "tool": "named",
                                    "none": "none"}[tc.type]
    parallel = not (tc is not None and tc.disable_parallel_tool_use)
    return T.build_plan(tm, tools, mode, tc.name if tc is not None else None, parallel)


class MessagesRequest(BaseModel):
    """Unknown fields (metadata, service_tier, ...) are ignored, as in the OpenAI routes."""

    model: Optional[str] = None  # missing means the served model
    messages: list[InputMessage] = Field(min_length=1)
    system: Union[str, list[TextBlock], None] = None
    max_tokens: int = Field(ge=1)  # required, as in Anthropic's API
    temperature: float = Field(1.0, ge=0, le=1)  # Anthropic's documented range
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: Optional[int] = Field(None, ge=1)
    stop_sequences: Optional[list[str]] = None
    stream: bool = False
    tools: Optional[list[AnthropicTool]] = None
    tool_choice: Optional[ToolChoice] = None

    _system_blocks = field_validator("system", mode="before")(_text_blocks_only)

    @field_validator("stop_sequences")
    @classmethod
    def _nonempty_stops(cls, v):
        if v and any(not s for s in v):
            raise ValueError("stop sequences must be non-empty")
        return v or None


class CountTokensRequest(BaseModel):
    model: Optional[str] = None
    messages: list[InputMessage] = Field(min_length=1)
    system: Union[str, list[TextBlock], None] = None
    tools: Optional[list[AnthropicTool]] = None
    tool_choice: Optional[ToolChoice] = None

    _system_blocks = field_validator("system", mode="before")(_text_blocks_only)


def _prompt_ids(tm, req: Union[MessagesRequest, CountTokensRequest],
                plan: Optional[T.ToolPlan] = None) -> tuple[list[int], list[str]]:
    from jinja2 import TemplateError

    msgs = [{"role": "system", "content": _join(req.system)}] if req.system else []
    for m in req.messages:
        msgs += m.chat_messages()
    prefill = ""
    if msgs[-1]["role"] == "assistant":
        if msgs[-1].get("tool_calls"):
            raise APIError(400, "messages: a final assistant message with tool_use blocks needs "
                           "a user message with their tool_result blocks after it")
        prefill = msgs.pop()["content"]
    if not msgs:
        raise APIError(400, "messages: a conversation cannot consist of one assistant message")
    try:
        prompt, images = chat_images.render(
            tm, msgs, lambda ms: apply_chat_template_with_tools(tm, plan, ms))
    except TemplateError as e:
        raise APIError(400, f"messages: the chat template rejected them: {e}") from None
    # Special tokens come from the template itself; see openai_api._chat_prompt_ids.
    return tm.tokenizer.encode(prompt + prefill, add_special_tokens=False), images


def _stop(out: dict, stops: Optional[list[str]]) -> tuple[Optional[str], Optional[str]]:
    """(stop_reason, stop_sequence): a stop string the caller gave is `stop_sequence`; EOS and
    anything else the runtime stops on is the model ending its turn."""
    reason, matched = finish_of(out)  # raises APIError on an abort
    if reason is None:
        return None, None
    if reason == "length":
        return "max_tokens", None
    if isinstance(matched, str) and matched in (stops or []):
        return "stop_sequence", matched
    return "end_turn", None


def _tool_content(plan: T.ToolPlan, text: str, reason: Optional[str]
                  ) -> tuple[list[dict], Optional[str]]:
    """Content blocks of a reply with tools, and its stop reason (tool_use when it made calls)."""
    content, calls = plan.parse(text)
    if not calls:
        return [{"type": "text", "text": content}], reason
    blocks: list[dict] = [{"type": "text", "text": content}] if content else []
    for c in calls:
        try:
            args = json.loads(c.arguments)
        except ValueError:
            args = None
        blocks.append({"type": "tool_use", "id": T.new_call_id("toolu_"), "name": c.name,
                       "input": args if isinstance(args, dict) else {}})
    return blocks, "tool_use" if reason == "end_turn" else reason


def _usage(meta: dict, output_tokens: Optional[int] = None) -> dict[str, int]:
    cached = meta.get("cached_tokens", 0)
    return {"input_tokens": meta["prompt_tokens"] - cached,
            "output_tokens": meta["completion_tokens"] if output_tokens is None else output_tokens,
            "cache_read_input_tokens": cached}


def _event(kind: str, payload: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **payload}, ensure_ascii=False)}\n\n"


def register_anthropic_routes(app: FastAPI, tm) -> None:
    @app.post("/v1/messages")
    async def create_message(request: Request):
        try:
            req = MessagesRequest.model_validate(await read_json_object(request))
            check_model(tm, req.model)
            plan = _tool_plan(tm, req)
            sp: dict[str, Any] = {"max_new_tokens": req.max_tokens, "temperature": req.temperature,
                                  "top_p": req.top_p, "top_k": req.top_k or -1}
            if req.stop_sequences:
                sp["stop"] = req.stop_sequences
            if plan is not None:
                sp.update(plan.sampling_params())
            ids, images = _prompt_ids(tm, req, plan)
            obj = GenerateReqInput(input_ids=ids, sampling_params=sp, stream=req.stream,
                                   image_data=images or None)
            gens, firsts = await start_generations(tm, [obj], request)
            msg_id = f"msg_{uuid.uuid4().hex}"
            if not req.stream:
                await close_all(gens)
                out = firsts[0]
                reason, seq = _stop(out, req.stop_sequences)
                content: list[dict] = [{"type": "text", "text": out["text"]}]
                if plan is not None:
                    content, reason = _tool_content(plan, out["text"], reason)
                return JSONResponse({
                    "id": msg_id, "type": "message", "role": "assistant",
                    "content": content, "model": tm.model_name,
                    "stop_reason": reason, "stop_sequence": seq, "usage": _usage(out["meta_info"])})
        except Exception as e:
            return anthropic_error_response(e)
        if plan is not None:
            return StreamingResponse(_stream_tools(req, plan, msg_id, gens, firsts),
                                     media_type="text/event-stream")
        return StreamingResponse(_stream(req, msg_id, gens, firsts),
                                 media_type="text/event-stream")

    async def _stream(req: MessagesRequest, msg_id: str, gens, firsts):
        first_meta = firsts[0]["meta_info"]
        yield _event("message_start", {"message": {
            "id": msg_id, "type": "message", "role": "assistant", "content": [],
            "model": tm.model_name, "stop_reason": None, "stop_sequence": None,
            "usage": _usage(first_meta, output_tokens=0)}})
        yield _event("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}})
        yield _event("ping", {})
        sent, updates = 0, all_updates(gens, firsts)
        try:
            async for _, out in updates:
                reason, seq = _stop(out, req.stop_sequences)
                if len(out["text"]) > sent:
                    yield _event("content_block_delta", {
                        "index": 0, "delta": {"type": "text_delta", "text": out["text"][sent:]}})
                    sent = len(out["text"])
                if reason is not None:
                    yield _event("content_block_stop", {"index": 0})
                    yield _event("message_delta", {
                        "delta": {"stop_reason": reason, "stop_sequence": seq},
                        "usage": _usage(out["meta_info"])})
                    yield _event("message_stop", {})
                    return
            raise RuntimeError("the generation ended without a finish reason")
        except Exception as e:  # an abort or a runtime failure after the 200 went out
            err = to_api_error(e)
            body = anthropic_error_body(err.message, anthropic_error_type(err.status))
            yield f"event: error\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"
        finally:
            await updates.aclose()

    async def _stream_tools(req: MessagesRequest, plan: T.ToolPlan, msg_id: str, gens, firsts):
        """Blocks open as they start: text, then one tool_use block per call (see the module
        docstring); the same parser as the non-streamed reply, so both carry the same calls."""
        yield _event("message_start", {"message": {
            "id": msg_id, "type": "message", "role": "assistant", "content": [],
            "model": tm.model_name, "stop_reason": None, "stop_sequence": None,
            "usage": _usage(firsts[0]["meta_info"], output_tokens=0)}})
        yield _event("ping", {})
        parser = plan.stream()
        sent, updates = 0, all_updates(gens, firsts)
        block = {"index": -1, "kind": None}  # the open block

        def open_block(kind: str, start: dict) -> list[str]:
            events = [_event("content_block_stop", {"index": block["index"]})] if block["kind"] else []
            block["index"] += 1
            block["kind"] = kind
            return events + [_event("content_block_start", {"index": block["index"], "content_block": start})]

        try:
            async for _, out in updates:
                reason, seq = _stop(out, req.stop_sequences)
                text, deltas = parser.feed(out["text"][sent:], final=reason is not None)
                sent = len(out["text"])
                if text:
                    if block["kind"] != "text":
                        for ev in open_block("text", {"type": "text", "text": ""}):
                            yield ev
                    yield _event("content_block_delta", {
                        "index": block["index"], "delta": {"type": "text_delta", "text": text}})
                for d in deltas:
                    if d.name is not None:
                        for ev in open_block("tool_use", {"type": "tool_use", "id": T.new_call_id("toolu_"),
                                                          "name": d.name, "input": {}}):
                            yield ev
                    if d.arguments:
                        yield _event("content_block_delta", {
                            "index": block["index"],
                            "delta": {"type": "input_json_delta", "partial_json": d.arguments}})
                if reason is not None:
                    if block["kind"] is None:  # nothing at all: one empty text block, as unstreamed
                        for ev in open_block("text", {"type": "text", "text": ""}):
                            yield ev
                    yield _event("content_block_stop", {"index": block["index"]})
                    if parser.n_calls and reason == "end_turn":
                        reason = "tool_use"
                    yield _event("message_delta", {
                        "delta": {"stop_reason": reason, "stop_sequence": seq},
                        "usage": _usage(out["meta_info"])})
                    yield _event("message_stop", {})
                    return
            raise RuntimeError("the generation ended without a finish reason")
        except Exception as e:
            err = to_api_error(e)
            body = anthropic_error_body(err.message, anthropic_error_type(err.status))
            yield f"event: error\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"
        finally:
            await updates.aclose()

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request):
        try:
            req = CountTokensRequest.model_validate(await read_json_object(request))
            check_model(tm, req.model)
            ids, images = _prompt_ids(tm, req, _tool_plan(tm, req))
            return JSONResponse({"input_tokens": chat_images.prompt_len(tm, ids, images)})
        except Exception as e:
            return anthropic_error_response(e)
