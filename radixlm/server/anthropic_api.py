"""Anthropic Messages API (`POST /v1/messages`) over `TokenizerManager.generate`, so Anthropic
clients can talk to a local model. Text only: image, document and tool blocks are refused (400).

Behaviour worth knowing:
- A final assistant message is a prefill: the prompt is the template rendered up to a new
  assistant turn, plus that text, and the reply continues it (as Anthropic documents).
- `usage.input_tokens` counts the prompt tokens that were NOT read from the radix cache and
  `cache_read_input_tokens` those that were, as Anthropic splits them (their sum is the prompt).
- Errors use Anthropic's shape `{"type": "error", "error": {"type", "message"}}`; inside a stream
  they are an `event: error` with that body.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Literal, Optional, Union

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, Field, field_validator

from radixlm.server.errors import (APIError, anthropic_error_body, anthropic_error_response,
                                   anthropic_error_type, read_json_object, to_api_error)
from radixlm.server.io_struct import GenerateReqInput
from radixlm.server.openai_api import all_updates, close_all, finish_of, start_generations
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


class InputMessage(BaseModel):
    role: Literal["user", "assistant"]
    content: Union[str, list[TextBlock]]

    _blocks = field_validator("content", mode="before")(_text_blocks_only)


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

    _system_blocks = field_validator("system", mode="before")(_text_blocks_only)


def _prompt_ids(tm, req: Union[MessagesRequest, CountTokensRequest]) -> list[int]:
    from jinja2 import TemplateError

    msgs = [{"role": "system", "content": _join(req.system)}] if req.system else []
    msgs += [{"role": m.role, "content": _join(m.content)} for m in req.messages]
    prefill = msgs.pop()["content"] if msgs[-1]["role"] == "assistant" else ""
    if not msgs:
        raise APIError(400, "messages: a conversation cannot consist of one assistant message")
    try:
        prompt = tm.apply_chat_template(msgs) + prefill
    except TemplateError as e:
        raise APIError(400, f"messages: the chat template rejected them: {e}") from None
    # Special tokens come from the template itself; see openai_api._chat_prompt_ids.
    return tm.tokenizer.encode(prompt, add_special_tokens=False)


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
            sp: dict[str, Any] = {"max_new_tokens": req.max_tokens, "temperature": req.temperature,
                                  "top_p": req.top_p, "top_k": req.top_k or -1}
            if req.stop_sequences:
                sp["stop"] = req.stop_sequences
            obj = GenerateReqInput(input_ids=_prompt_ids(tm, req), sampling_params=sp,
                                   stream=req.stream)
            gens, firsts = await start_generations(tm, [obj], request)
            msg_id = f"msg_{uuid.uuid4().hex}"
            if not req.stream:
                await close_all(gens)
                out = firsts[0]
                reason, seq = _stop(out, req.stop_sequences)
                return JSONResponse({
                    "id": msg_id, "type": "message", "role": "assistant",
                    "content": [{"type": "text", "text": out["text"]}], "model": tm.model_name,
                    "stop_reason": reason, "stop_sequence": seq, "usage": _usage(out["meta_info"])})
        except Exception as e:
            return anthropic_error_response(e)
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

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request):
        try:
            req = CountTokensRequest.model_validate(await read_json_object(request))
            check_model(tm, req.model)
            return JSONResponse({"input_tokens": len(_prompt_ids(tm, req))})
        except Exception as e:
            return anthropic_error_response(e)
