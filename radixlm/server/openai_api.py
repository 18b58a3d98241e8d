"""OpenAI-compatible routes (/v1/models, /v1/completions, /v1/chat/completions) over
`TokenizerManager.generate`.

Each choice is one generate call (n choices per prompt, run concurrently). Before any byte of a
response is sent, every call's first update is awaited: input errors (the manager's ValueError,
a full queue) surface there, so they become a proper 400/503 rather than an error inside a 200
stream. Streams are SSE `data: {json}` events ending in `data: [DONE]`.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any, AsyncIterator, Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from radixlm.server import openai_protocol as P
from radixlm.server import tool_calls as T
from radixlm.server.errors import (APIError, openai_error_body, openai_error_response,
                                   openai_error_type, read_json_object, to_api_error)
from radixlm.server.io_struct import GenerateReqInput

# Logprobs of impossible tokens are -inf, which JSON cannot carry; OpenAI documents -9999.0.
MIN_LOGPROB = -9999.0


# --- running generate calls (shared with anthropic_api) ---------------------------------------


async def close_all(gens: list) -> None:
    # A generator closed early (non-stream final taken, or an error elsewhere) runs its cleanup,
    # which is where the manager aborts a request that is still queued or running.
    for g in gens:
        if g is not None:
            try:
                await g.aclose()
            except Exception:
                pass


async def start_generations(tm, objs: list[GenerateReqInput],
                            request: Optional[Request]) -> tuple[list, list[dict]]:
    """Start every call and return (generators, first updates). The first failure cancels and
    closes the others at once (no waiting for their first token) and is raised."""
    gens: list = [None] * len(objs)

    async def first(i: int) -> dict:
        gens[i] = tm.generate(objs[i], request)
        try:
            return await gens[i].__anext__()
        except StopAsyncIteration:
            raise RuntimeError("the generation ended without producing any output") from None

    tasks = [asyncio.ensure_future(first(i)) for i in range(len(objs))]
    try:
        done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    except BaseException:  # cancelled (client gone) while waiting: stop everything
        for t in tasks:
            t.cancel()
        raise
    if pending or any(t.exception() is not None for t in done):
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        await close_all(gens)
        raise next(t.exception() for t in tasks if not t.cancelled() and t.exception() is not None)
    return gens, [t.result() for t in tasks]


def is_finished(out: dict) -> bool:
    return out["meta_info"].get("finish_reason") is not None


async def all_updates(gens: list, firsts: list[dict]) -> AsyncIterator[tuple[int, dict]]:
    """Yield (call index, update): the first updates, then the rest in arrival order. Leaving
    early (client disconnect, error) cancels the pumps, which closes their generators."""
    for i, f in enumerate(firsts):
        yield i, f
    await close_all([g for g, f in zip(gens, firsts) if is_finished(f)])
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int) -> None:
        try:
            async for item in gens[i]:
                await queue.put((i, item, None))
            await queue.put((i, None, None))
        except Exception as e:  # handed to the consumer, which reports it in the stream
            await queue.put((i, None, e))

    tasks = [asyncio.create_task(pump(i)) for i, f in enumerate(firsts) if not is_finished(f)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item, err = await queue.get()
            if err is not None:
                raise err
            if item is None:
                remaining -= 1
            else:
                yield i, item
    finally:
        for t in tasks:  # no await here: this also runs inside an already-cancelled task
            t.cancel()


def finish_of(out: dict) -> tuple[Optional[str], Any]:
    """(OpenAI finish_reason, matched stop) of an update; an abort is an error, not a reason."""
    fr = out["meta_info"].get("finish_reason")
    if fr is None:
        return None, None
    if fr.get("type") == "length":
        return "length", None
    if fr.get("type") == "abort":
        # Not the caller's doing unless the runtime says so (e.g. a 400 found after queueing).
        raise APIError(int(fr.get("status_code") or 503), fr.get("message") or "request aborted")
    return "stop", fr.get("matched")


def sse(payload: Any) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"


def openai_stream_error(exc: BaseException) -> str:
    err = to_api_error(exc)
    return sse(openai_error_body(err.message, openai_error_type(err.status), err.param, err.code))


def usage_of(outs: list[dict], n: int) -> P.UsageInfo:
    """Each prompt's tokens count once although its n samples each prefilled it; its cached
    tokens are the best any sample got (never more than its prompt)."""
    prompt = cached = completion = 0
    for p in range(0, len(outs), n):
        metas = [o["meta_info"] for o in outs[p:p + n]]
        prompt += metas[0]["prompt_tokens"]
        cached += max(m.get("cached_tokens", 0) for m in metas)
    completion = sum(o["meta_info"]["completion_tokens"] for o in outs)
    return P.UsageInfo(prompt_tokens=prompt, completion_tokens=completion,
                       total_tokens=prompt + completion,
                       prompt_tokens_details=P.PromptTokensDetails(cached_tokens=cached))


def _lp(x: Optional[float]) -> Optional[float]:
    return None if x is None else max(float(x), MIN_LOGPROB)


def _lp_of(entry) -> Optional[float]:
    return None if entry is None else _lp(entry[0])


class _TokenText:
    """Token text of a logprob entry (logprob, id, text|None); decoded when the manager left it
    out. An entry may itself be None (the unscored first prompt token): its text is unknown."""

    def __init__(self, tm):
        self.tm = tm

    def __call__(self, entry) -> str:
        if entry is None:
            return ""
        text = entry[2] if len(entry) > 2 else None
        return text if text is not None else self.tm.tokenizer.decode([entry[1]])


# --- /v1/completions --------------------------------------------------------------------------


def _add_completion_logprobs(tok, entries: list, tops: Optional[list], offset: int,
                             want_top: bool, into: P.CompletionLogprobs) -> int:
    """Append legacy-format entries; returns the offset after them. `text_offset` counts
    characters of the choice's `text` (echoed prompt included) by the tokens' own texts."""
    for k, e in enumerate(entries):
        t = tok(e)
        into.tokens.append(t)
        into.token_logprobs.append(_lp_of(e))
        into.text_offset.append(offset)
        offset += len(t)
        if want_top:
            top = tops[k] if tops is not None and k < len(tops) else None
            into.top_logprobs.append(None if top is None else {tok(x): _lp_of(x) for x in top})
    return offset


class _ChoiceState:
    """What one choice has sent so far, so each streamed chunk carries only what is new."""

    def __init__(self, echo_text: str = ""):
        self.first = True
        self.echo_text = echo_text  # goes out with the choice's first piece
        self.text_len = 0  # chars of the cumulative output text already sent
        self.n_lp = 0  # output logprob entries already sent
        self.tok_offset = len(echo_text)  # text_offset of the next output token


def _completion_piece(tm, req: P.CompletionRequest, st: _ChoiceState, index: int, out: dict,
                      always: bool = False) -> Optional[P.CompletionChoice]:
    meta = out["meta_info"]
    reason, matched = finish_of(out)
    text = st.echo_text + out["text"][st.text_len:]
    st.echo_text, st.text_len = "", len(out["text"])
    lps = None
    if req.logprobs is not None:
        tok, want_top = _TokenText(tm), req.logprobs > 0
        lps = P.CompletionLogprobs(top_logprobs=[] if want_top else None)
        if st.first and req.echo:
            _add_completion_logprobs(tok, meta.get("input_token_logprobs") or [],
                                     meta.get("input_top_logprobs"), 0, want_top, lps)
        entries = (meta.get("output_token_logprobs") or [])[st.n_lp:]
        tops = meta.get("output_top_logprobs")
        st.tok_offset = _add_completion_logprobs(tok, entries, tops[st.n_lp:] if tops else None,
                                                 st.tok_offset, want_top, lps)
        st.n_lp += len(entries)
    st.first = False
    if not always and not text and reason is None and not (lps and lps.tokens):
        return None
    return P.CompletionChoice(index=index, text=text, logprobs=lps, finish_reason=reason,
                              matched_stop=matched)


# --- /v1/chat/completions ---------------------------------------------------------------------


def _lpf(x: Optional[float]) -> float:
    return MIN_LOGPROB if x is None else max(float(x), MIN_LOGPROB)


def _chat_logprobs(tm, meta: dict, st: _ChoiceState) -> P.ChoiceLogprobs:
    tok = _TokenText(tm)
    entries = (meta.get("output_token_logprobs") or [])[st.n_lp:]
    tops = meta.get("output_top_logprobs") or []
    content = []
    for k, e in enumerate(entries):
        t, top = tok(e), (tops[st.n_lp + k] if st.n_lp + k < len(tops) else None) or []
        content.append(P.TokenLogprob(
            token=t, logprob=_lpf(_lp_of(e)), bytes=list(t.encode("utf-8")),
            top_logprobs=[P.TopLogprob(token=tok(x), logprob=_lpf(_lp_of(x)),
                                       bytes=list(tok(x).encode("utf-8"))) for x in top]))
    st.n_lp += len(entries)
    return P.ChoiceLogprobs(content=content)


def chat_tool_plan(tm, req: P.ChatCompletionRequest) -> Optional[T.ToolPlan]:
    """The request's tools and tool_choice, validated (ValueError -> 400) before queueing."""
    tools = [T.Tool(t.function.name, t.function.description, t.function.parameters)
             for t in (req.tools or [])]
    mode, name = req.tool_mode()
    return T.build_plan(tm, tools, mode, name, req.parallel_tool_calls, where="tools")


def apply_chat_template_with_tools(tm, plan: Optional[T.ToolPlan], messages: list[dict]) -> str:
    """The template applied to messages that may hold tools, calls and results (rendered as
    tool_calls/render.py says; unchanged without any of them). A template that rejects the
    `tool` role of rendered results gets them as user turns instead."""
    traffic = any(m.get("tool_calls") or m["role"] == "tool" for m in messages)
    if plan is None and not traffic:
        return tm.apply_chat_template(messages)
    from jinja2 import TemplateError

    fmt = plan.fmt if plan is not None else T.resolve_format(tm)
    offered = plan.offered if plan is not None else None
    forced = plan.name if plan is not None and plan.mode == "named" else None
    own = T.template_supports_tools(T.model_template(tm))
    msgs, tools = T.prepare_messages(fmt, own, messages, offered, forced)
    try:
        return tm.apply_chat_template(msgs, tools=tools)
    except TemplateError:
        if own or not any(m["role"] == "tool" for m in msgs):
            raise
    msgs, tools = T.prepare_messages(fmt, own, messages, offered, forced, results_role="user")
    return tm.apply_chat_template(msgs, tools=tools)


def _chat_prompt_ids(tm, req: P.ChatCompletionRequest, plan: Optional[T.ToolPlan] = None) -> list[int]:
    from jinja2 import TemplateError

    messages = [m.for_template() for m in req.messages]
    try:
        prompt = apply_chat_template_with_tools(tm, plan, messages)
    except TemplateError as e:  # e.g. the template's own raise_exception on a role order
        raise APIError(400, f"messages: the chat template rejected them: {e}", "messages")
    # The rendered text already holds the template's special tokens (BOS included where the
    # template wants one), so it is encoded without adding more, as HF's apply_chat_template does.
    return tm.tokenizer.encode(prompt, add_special_tokens=False)


def _format_constraint(req: P.ChatCompletionRequest) -> dict:
    fmt = req.response_format
    if fmt is None or fmt.type == "text":
        return {}
    schema = {"type": "object"} if fmt.type == "json_object" else fmt.json_schema.schema_
    return {"json_schema": json.dumps(schema)}


def _chat_piece(tm, req, st: _ChoiceState, index: int, out: dict) -> Optional[P.ChatStreamChoice]:
    reason, matched = finish_of(out)
    delta = out["text"][st.text_len:]
    st.text_len = len(out["text"])
    lps = _chat_logprobs(tm, out["meta_info"], st) if req.logprobs else None
    calls = None
    tools: Optional[T.ToolStream] = getattr(st, "tools", None)
    if tools is not None:  # markup never reaches `content`; calls go out as tool_calls deltas
        delta, deltas = tools.feed(delta, final=reason is not None)
        calls = [_delta_tool_call(st, d) for d in deltas] or None
        if reason == "stop" and tools.n_calls:
            reason = "tool_calls"
    if not delta and not calls and reason is None and not (lps and lps.content):
        return None
    return P.ChatStreamChoice(index=index, delta=P.DeltaMessage(content=delta or None, tool_calls=calls),
                              logprobs=lps, finish_reason=reason, matched_stop=matched)


def _delta_tool_call(st: _ChoiceState, d: T.ToolCallDelta) -> P.DeltaToolCall:
    if d.name is None:
        return P.DeltaToolCall(index=d.index, function=P.DeltaFunctionCall(arguments=d.arguments))
    return P.DeltaToolCall(index=d.index, id=T.new_call_id(), type="function",
                           function=P.DeltaFunctionCall(name=d.name, arguments=d.arguments))


def _chat_message(plan: Optional[T.ToolPlan], text: str, reason: Optional[str]
                  ) -> tuple[P.ChatMessageOut, Optional[str]]:
    """The final message of a choice and its finish reason (tool_calls when it made calls)."""
    if plan is None:
        return P.ChatMessageOut(content=text), reason
    content, calls = plan.parse(text)
    if not calls:
        return P.ChatMessageOut(content=content), reason
    out = [P.ToolCallOut(id=T.new_call_id(), function=P.FunctionCallOut(name=c.name, arguments=c.arguments))
           for c in calls]
    return (P.ChatMessageOut(content=content or None, tool_calls=out),
            "tool_calls" if reason == "stop" else reason)


# --- routes -----------------------------------------------------------------------------------


def register_openai_routes(app: FastAPI, tm) -> None:
    started = int(time.time())
    T.resolve_format(tm)  # an unknown --tool-call-parser stops the server at start-up

    def card() -> P.ModelCard:
        return P.ModelCard(id=tm.model_name, created=started, max_model_len=tm.context_len,
                           root=getattr(tm, "model_path", None)
                           or getattr(tm.server_args, "model_path", None))

    @app.get("/v1/models")
    async def list_models():
        return JSONResponse(P.ModelList(data=[card()]).model_dump())

    @app.get("/v1/models/{model_id:path}")
    async def retrieve_model(model_id: str):
        try:
            P.check_model(tm, model_id)
        except APIError as e:
            return openai_error_response(e)
        return JSONResponse(card().model_dump())

    async def run(objs, request, stream, on_final, on_stream):
        """Start the calls, then answer with one JSON body or an SSE stream."""
        gens, firsts = await start_generations(tm, objs, request)
        if not stream:
            await close_all(gens)
            return JSONResponse(on_final(firsts).model_dump())
        return StreamingResponse(on_stream(gens, firsts), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def create_completion(request: Request):
        try:
            req = P.CompletionRequest.model_validate(await read_json_object(request))
            P.check_model(tm, req.model)
            objs, states = [], []
            for prompt in req.prompts():
                is_text = isinstance(prompt, str)
                echo = (prompt if is_text else tm.tokenizer.decode(prompt)) if req.echo else ""
                for j in range(req.n):
                    objs.append(GenerateReqInput(
                        text=prompt if is_text else None,
                        input_ids=None if is_text else list(prompt),
                        sampling_params=req.sampling_params(req.max_tokens, j),
                        return_logprob=req.logprobs is not None,
                        # Echo with logprobs scores the prompt too: start at its first token.
                        logprob_start_len=0 if req.echo and req.logprobs is not None else -1,
                        top_logprobs_num=req.logprobs or 0, return_text_in_logprobs=True,
                        stream=req.stream))
                    states.append(_ChoiceState(echo))
            rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())

            def on_final(outs):
                choices = [_completion_piece(tm, req, states[i], i, o, always=True)
                           for i, o in enumerate(outs)]
                return P.CompletionResponse(id=rid, created=created, model=tm.model_name,
                                            choices=choices, usage=usage_of(outs, req.n))

            async def on_stream(gens, firsts):
                last = list(firsts)
                rest = all_updates(gens, firsts)
                try:
                    async for i, out in rest:
                        last[i] = out
                        piece = _completion_piece(tm, req, states[i], i, out)
                        if piece is not None:
                            yield sse(P.CompletionResponse(id=rid, created=created, model=tm.model_name,
                                                           choices=[piece]).model_dump_json())
                    if req.include_usage:
                        yield sse(P.CompletionResponse(id=rid, created=created, model=tm.model_name, choices=[],
                                                       usage=usage_of(last, req.n)).model_dump_json())
                except Exception as e:  # an abort or a runtime failure after the 200 went out
                    yield openai_stream_error(e)
                finally:
                    await rest.aclose()
                yield sse("[DONE]")

            return await run(objs, request, req.stream, on_final, on_stream)
        except Exception as e:
            return openai_error_response(e)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(request: Request):
        try:
            req = P.ChatCompletionRequest.model_validate(await read_json_object(request))
            P.check_model(tm, req.model)
            plan = chat_tool_plan(tm, req)
            ids = _chat_prompt_ids(tm, req, plan)
            max_new = req.requested_max_tokens()
            if max_new is None:  # OpenAI's default: as much as the context has room for
                max_new = max(tm.context_len - len(ids), 1)
            objs = [GenerateReqInput(
                input_ids=list(ids),
                sampling_params={**req.sampling_params(max_new, j), **_format_constraint(req),
                                 **(plan.sampling_params() if plan is not None else {})},
                return_logprob=req.logprobs, top_logprobs_num=req.top_logprobs or 0,
                return_text_in_logprobs=True, stream=req.stream) for j in range(req.n)]
            states = [_ChoiceState() for _ in objs]
            for st in states:
                st.tools = plan.stream() if plan is not None else None
            rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

            def chunk(choices, usage=None) -> str:
                return sse(P.ChatCompletionChunk(id=rid, created=created, model=tm.model_name,
                                                 choices=choices, usage=usage).model_dump_json())

            def on_final(outs):
                choices = []
                for i, o in enumerate(outs):
                    reason, matched = finish_of(o)
                    lps = _chat_logprobs(tm, o["meta_info"], states[i]) if req.logprobs else None
                    message, reason = _chat_message(plan, o["text"], reason)
                    choices.append(P.ChatChoice(index=i, message=message,
                                                logprobs=lps, finish_reason=reason, matched_stop=matched))
                return P.ChatCompletionResponse(id=rid, created=created, model=tm.model_name,
                                                choices=choices, usage=usage_of(outs, req.n))

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
                        yield chunk([], usage_of(last, req.n))
                except Exception as e:
                    yield openai_stream_error(e)
                finally:
                    await rest.aclose()
                yield sse("[DONE]")

            return await run(objs, request, req.stream, on_final, on_stream)
        except Exception as e:
            return openai_error_response(e)
