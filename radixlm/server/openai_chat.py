"""/v1/chat/completions: chat templates, tool calls (tool_calls/), response formats, and with
--reasoning-parser the `<think>` part of the output as `reasoning_content` (streamed too)."""

from __future__ import annotations

import json
import time
import uuid
from typing import Optional

from fastapi import FastAPI, Request

from radixlm.server import chat_images
from radixlm.server import openai_protocol as P
from radixlm.server import tool_calls as T
from radixlm.server.errors import APIError, openai_error_response, read_json_object
from radixlm.server.io_struct import GenerateReqInput
from radixlm.server.openai_common import (MIN_LOGPROB, ChoiceState, TokenText, all_updates,
                                          cache_report, finish_of, lp_of, openai_stream_error,
                                          sse, usage_of)
from radixlm.server.reasoning import ReasoningParser, get_format


def _lpf(x: Optional[float]) -> float:
    return MIN_LOGPROB if x is None else max(float(x), MIN_LOGPROB)


def _chat_logprobs(tm, meta: dict, st: ChoiceState) -> P.ChoiceLogprobs:
    tok = TokenText(tm)
    entries = (meta.get("output_token_logprobs") or [])[st.n_lp:]
    tops = meta.get("output_top_logprobs") or []
    content = []
    for k, e in enumerate(entries):
        t, top = tok(e), (tops[st.n_lp + k] if st.n_lp + k < len(tops) else None) or []
        content.append(P.TokenLogprob(
            token=t, logprob=_lpf(lp_of(e)), bytes=list(t.encode("utf-8")),
            top_logprobs=[P.TopLogprob(token=tok(x), logprob=_lpf(lp_of(x)),
                                       bytes=list(tok(x).encode("utf-8"))) for x in top]))
    st.n_lp += len(entries)
    return P.ChoiceLogprobs(content=content)


def chat_tool_plan(tm, req: P.ChatCompletionRequest) -> Optional[T.ToolPlan]:
    """The request's tools and tool_choice, validated (ValueError -> 400) before queueing."""
    tools = [T.Tool(t.function.name, t.function.description, t.function.parameters)
             for t in (req.tools or [])]
    mode, name = req.tool_mode()
    return T.build_plan(tm, tools, mode, name, req.parallel_tool_calls, where="tools")


def apply_chat_template_with_tools(tm, plan: Optional[T.ToolPlan], messages: list[dict],
                                   template_kwargs: Optional[dict] = None) -> str:
    """The template applied to messages that may hold tools, calls and results (rendered as
    tool_calls/render.py says; unchanged without any of them). A template that rejects the
    `tool` role of rendered results gets them as user turns instead. `template_kwargs`
    (SGLang's chat_template_kwargs, e.g. enable_thinking) go to the template as variables."""
    kw = {"template_kwargs": template_kwargs} if template_kwargs else {}
    traffic = any(m.get("tool_calls") or m["role"] == "tool" for m in messages)
    if plan is None and not traffic:
        return tm.apply_chat_template(messages, **kw)
    from jinja2 import TemplateError

    fmt = plan.fmt if plan is not None else T.resolve_format(tm)
    offered = plan.offered if plan is not None else None
    forced = plan.name if plan is not None and plan.mode == "named" else None
    own = T.template_supports_tools(T.model_template(tm))
    msgs, tools = T.prepare_messages(fmt, own, messages, offered, forced)
    try:
        return tm.apply_chat_template(msgs, tools=tools, **kw)
    except TemplateError:
        if own or not any(m["role"] == "tool" for m in msgs):
            raise
    msgs, tools = T.prepare_messages(fmt, own, messages, offered, forced, results_role="user")
    return tm.apply_chat_template(msgs, tools=tools, **kw)


def _chat_prompt_ids(tm, req: P.ChatCompletionRequest, plan: Optional[T.ToolPlan] = None
                     ) -> tuple[list[int], list[str]]:
    """The prompt's ids and its images (in order; their image tokens are in the ids)."""
    from jinja2 import TemplateError

    messages = [m.for_template() for m in req.messages]
    try:
        prompt, images = chat_images.render(tm, messages, lambda ms: apply_chat_template_with_tools(
            tm, plan, ms, req.chat_template_kwargs))
    except TemplateError as e:  # e.g. the template's own raise_exception on a role order
        raise APIError(400, f"messages: the chat template rejected them: {e}", "messages")
    # The rendered text already holds the template's special tokens (BOS included where the
    # template wants one), so it is encoded without adding more, as HF's apply_chat_template does.
    return tm.tokenizer.encode(prompt, add_special_tokens=False), images


def _format_constraint(req: P.ChatCompletionRequest) -> dict:
    fmt = req.response_format
    if fmt is None or fmt.type == "text":
        return {}
    schema = {"type": "object"} if fmt.type == "json_object" else fmt.json_schema.schema_
    return {"json_schema": json.dumps(schema)}


def _chat_piece(tm, req, st: ChoiceState, index: int, out: dict) -> Optional[P.ChatStreamChoice]:
    reason, matched = finish_of(out)
    delta = out["text"][st.text_len:]
    st.text_len = len(out["text"])
    lps = _chat_logprobs(tm, out["meta_info"], st) if req.logprobs else None
    calls, thought = None, None
    if st.reasoning is not None:  # reasoning goes out as reasoning_content, never as content
        thought, delta = st.reasoning.feed(delta)
        if reason is not None:
            more_thought, more = st.reasoning.finish()
            thought, delta = thought + more_thought, delta + more
    tools: Optional[T.ToolStream] = st.tools
    if tools is not None:  # markup never reaches `content`; calls go out as tool_calls deltas
        delta, deltas = tools.feed(delta, final=reason is not None)
        calls = [_delta_tool_call(st, d) for d in deltas] or None
        if reason == "stop" and tools.n_calls:
            reason = "tool_calls"
    if not delta and not calls and not thought and reason is None and not (lps and lps.content):
        return None
    return P.ChatStreamChoice(index=index, delta=P.DeltaMessage(content=delta or None, tool_calls=calls,
                                                                reasoning_content=thought or None),
                              logprobs=lps, finish_reason=reason, matched_stop=matched)


def _delta_tool_call(st: ChoiceState, d: T.ToolCallDelta) -> P.DeltaToolCall:
    if d.name is None:
        return P.DeltaToolCall(index=d.index, function=P.DeltaFunctionCall(arguments=d.arguments))
    return P.DeltaToolCall(index=d.index, id=T.new_call_id(), type="function",
                           function=P.DeltaFunctionCall(name=d.name, arguments=d.arguments))


def _chat_message(plan: Optional[T.ToolPlan], text: str, reason: Optional[str],
                  parser: Optional[ReasoningParser] = None
                  ) -> tuple[P.ChatMessageOut, Optional[str]]:
    """The final message of a choice and its finish reason (tool_calls when it made calls);
    with a reasoning parser, the reasoning is split off into reasoning_content first."""
    thought = None
    if parser is not None:
        thought, text = parser.parse(text)
        thought = thought or None
    if plan is None:
        return P.ChatMessageOut(content=text, reasoning_content=thought), reason
    content, calls = plan.parse(text)
    if not calls:
        return P.ChatMessageOut(content=content, reasoning_content=thought), reason
    out = [P.ToolCallOut(id=T.new_call_id(), function=P.FunctionCallOut(name=c.name, arguments=c.arguments))
           for c in calls]
    return (P.ChatMessageOut(content=content or None, tool_calls=out, reasoning_content=thought),
            "tool_calls" if reason == "stop" else reason)


def reasoning_parser_for(tm, req: P.ChatCompletionRequest) -> Optional[ReasoningParser]:
    """The choice's parser: with --reasoning-parser, unless the request turns separation off
    (separate_reasoning=false) or thinking off (chat_template_kwargs enable_thinking=false)."""
    name = getattr(tm.server_args, "reasoning_parser", None)
    if not name or not req.separate_reasoning:
        return None
    kw = req.chat_template_kwargs or {}
    if kw.get("enable_thinking") is False or kw.get("thinking") is False:
        return None
    return ReasoningParser(get_format(name), stream_reasoning=req.stream_reasoning)


def register_chat_route(app: FastAPI, tm, run) -> None:
    @app.post("/v1/chat/completions")
    async def create_chat_completion(request: Request):
        try:
            req = P.ChatCompletionRequest.model_validate(await read_json_object(request))
            P.check_model(tm, req.model)
            plan = chat_tool_plan(tm, req)
            ids, images = _chat_prompt_ids(tm, req, plan)
            max_new = req.requested_max_tokens()
            if max_new is None:  # OpenAI's default: as much as the context has room for
                max_new = max(tm.context_len - chat_images.prompt_len(tm, ids, images), 1)
            objs = [GenerateReqInput(
                input_ids=list(ids),
                sampling_params={**req.sampling_params(max_new, j), **_format_constraint(req),
                                 **(plan.sampling_params() if plan is not None else {})},
                return_logprob=req.logprobs, top_logprobs_num=req.top_logprobs or 0,
                return_text_in_logprobs=True, stream=req.stream,
                image_data=images or None, **req.bootstrap_fields(req.n)) for j in range(req.n)]
            states = [ChoiceState() for _ in objs]
            for st in states:
                st.tools = plan.stream() if plan is not None else None
                st.reasoning = reasoning_parser_for(tm, req)
            rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

            def chunk(choices, usage=None) -> str:
                return sse(P.ChatCompletionChunk(id=rid, created=created, model=tm.model_name,
                                                 choices=choices, usage=usage).model_dump_json())

            def on_final(outs):
                choices = []
                for i, o in enumerate(outs):
                    reason, matched = finish_of(o)
                    lps = _chat_logprobs(tm, o["meta_info"], states[i]) if req.logprobs else None
                    message, reason = _chat_message(plan, o["text"], reason,
                                                    reasoning_parser_for(tm, req))
                    choices.append(P.ChatChoice(index=i, message=message,
                                                logprobs=lps, finish_reason=reason, matched_stop=matched))
                return P.ChatCompletionResponse(id=rid, created=created, model=tm.model_name,
                                                choices=choices, usage=usage_of(outs, req.n, cache_report(tm)))

            async def on_stream(gens, firsts):
                last = list(firsts)
                rest = all_updates(gens, firsts)
                try:
                    # OpenAI opens every choice with a delta that carries only the role.
                    for i in range(len(objs)):
                        yield chunk([P.ChatStreamChoice(
                            index=i, delta=P.DeltaMessage(role="assistant", content=""))])
                    async for i, out in rest:
                        last[i] = out
                        piece = _chat_piece(tm, req, states[i], i, out)
                        if piece is not None:
                            yield chunk([piece])
                    if req.include_usage:
                        yield chunk([], usage_of(last, req.n, cache_report(tm)))
                except Exception as e:
                    yield openai_stream_error(e)
                finally:
                    await rest.aclose()
                yield sse("[DONE]")

            return await run(objs, request, req.stream, on_final, on_stream)
        except Exception as e:
            return openai_error_response(e)
