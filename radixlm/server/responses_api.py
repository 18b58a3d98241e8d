"""OpenAI's Responses API: POST /v1/responses, GET and DELETE /v1/responses/{id}.

One generate call per response, on the chat path's machinery: the chat template with tools
(openai_chat.apply_chat_template_with_tools), the tool-call parsers and forced-call grammars
(tool_calls/), `text.format` json_schema as constrained decoding, --reasoning-parser for
reasoning items. The request and its items: responses_protocol.py; the prompt and the reuse of
a previous turn's token ids: responses_prompt.py; stored responses: responses_store.py; the
response object and its events: responses_output.py.

Every response carries the header `x-radixlm-response-id` (streamed ones too, before the first
event) so that the DP router learns which worker holds it without reading the body.
"""

from __future__ import annotations

import time
from typing import Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from radixlm.server import tool_calls as T
from radixlm.server.errors import APIError, openai_error_response, read_json_object, to_api_error
from radixlm.server.io_struct import GenerateReqInput
from radixlm.server.openai_common import all_updates, close_all, finish_of, start_generations
from radixlm.server.openai_protocol import check_model
from radixlm.server.reasoning import ReasoningParser, get_format
from radixlm.server.responses_output import OutputBuilder, new_id, usage_object
from radixlm.server.responses_prompt import Prompt, answer_splice, build_prompt
from radixlm.server.responses_protocol import ResponsesRequest, input_messages, parse_request
from radixlm.server.responses_store import ResponseStore, StoredResponse

RESPONSE_ID_HEADER = "x-radixlm-response-id"


def _not_found(rid: str) -> APIError:
    return APIError(404, f"Response with id '{rid}' not found.", code="response_not_found")


def _reasoning_setup(tm, req: ResponsesRequest) -> tuple[Optional[ReasoningParser], dict]:
    """(the parser, chat template variables). `reasoning` needs --reasoning-parser; effort
    "none" turns thinking off in templates that know enable_thinking (Qwen3's)."""
    name = getattr(tm.server_args, "reasoning_parser", None)
    if req.reasoning is None:
        return (ReasoningParser(get_format(name)) if name else None), {}
    if not name:
        raise APIError(400, "reasoning: this server splits no reasoning out of the answer "
                       "(start it with --reasoning-parser)", "reasoning")
    if req.reasoning.effort == "none":
        return None, {"enable_thinking": False}
    return ReasoningParser(get_format(name)), {}


class ResponseRun:
    """One response being generated: the parsers' state, the output items, the final object."""

    def __init__(self, tm, req: ResponsesRequest, plan: Optional[T.ToolPlan],
                 parser: Optional[ReasoningParser], prompt: Prompt):
        self.tm, self.req, self.plan, self.parser, self.prompt = tm, req, plan, parser, prompt
        self.id, self.created = new_id("resp"), time.time()
        self.out = OutputBuilder()
        self.tools = plan.stream() if plan is not None else None
        self.text_len = 0
        self.final: Optional[dict] = None  # the last update, once finished

    def response(self, status: str, usage: Optional[dict] = None,
                 error: Optional[dict] = None) -> dict:
        req = self.req
        fmt = req.text.format.wire() if req.text is not None else {"type": "text"}
        reasoning = req.reasoning.model_dump() if req.reasoning is not None else None
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "completed_at": time.time() if status in ("completed", "incomplete") else None,
            "error": error,
            "incomplete_details": {"reason": "max_output_tokens"}
            if status == "incomplete" else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "model": self.tm.model_name, "output": self.out.items,
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id, "reasoning": reasoning,
            "store": bool(req.store), "temperature": req.temperature,
            "text": {"format": fmt}, "tool_choice": req.tool_choice_wire(),
            "tools": [t.model_dump(exclude_none=True) for t in req.tools or []],
            "top_p": req.top_p, "truncation": "disabled", "usage": usage,
            "metadata": req.metadata or {}, "user": req.user}

    def feed(self, update: dict) -> None:
        """One update of the generate call (cumulative text) into the output items."""
        reason, _ = finish_of(update)  # an abort raises
        delta = update["text"][self.text_len:]
        self.text_len = len(update["text"])
        final = reason is not None
        if self.parser is not None:
            thought, delta = self.parser.feed(delta)
            if final:
                more_thought, more = self.parser.finish()
                thought, delta = thought + more_thought, delta + more
            self.out.reasoning(thought)
        calls = []
        if self.tools is not None:
            delta, calls = self.tools.feed(delta, final=final)
        self.out.text(delta)
        for d in calls:
            self.out.call(d)
        if final:
            self.final = update

    def finish(self, store: ResponseStore) -> dict:
        """The finished response object (stored when asked)."""
        meta = self.final["meta_info"]
        reason, matched = finish_of(self.final)
        self.out.finish(incomplete=reason == "length")
        thought = self.out.reasoning_text()
        usage = usage_object(meta["prompt_tokens"], meta.get("cached_tokens", 0),
                             meta["completion_tokens"],
                             len(self.tm.tokenizer.encode(thought, add_special_tokens=False))
                             if thought else 0,
                             not getattr(self.tm.server_args, "disable_radix_cache", False))
        obj = self.response("incomplete" if reason == "length" else "completed", usage)
        if self.req.store:
            plain = not thought and not self.out.has_calls()
            splice = answer_splice(self.prompt, self.final.get("output_ids") or [], matched,
                                   reason, plain)
            store.put(self.id, StoredResponse(
                obj, self.prompt.history + [self.out.assistant_message()], splice))
        return obj


def _prepare(tm, store: ResponseStore, body: dict) -> tuple[ResponseRun, GenerateReqInput]:
    """Validate and render before anything is queued: every input error is a 4xx here."""
    req = parse_request(body)
    check_model(tm, req.model)
    prev = None
    if req.previous_response_id is not None:
        prev = store.get(req.previous_response_id)
        if prev is None:
            raise APIError(404, f"Previous response with id '{req.previous_response_id}' not "
                           f"found.", "previous_response_id", "previous_response_not_found")
    tools = [T.Tool(t.name, t.description, t.parameters) for t in req.tools or []]
    mode, name = req.tool_mode()
    plan = T.build_plan(tm, tools, mode, name, req.parallel_tool_calls is not False)
    parser, template_kwargs = _reasoning_setup(tm, req)
    prompt = build_prompt(tm, req, plan, prev, input_messages(req.input), template_kwargs)
    max_new = req.max_output_tokens
    if max_new is None:  # as much as the context has room for
        max_new = max(tm.context_len - len(prompt.ids), 1)
    sp = {**req.sampling_params(max_new), **(plan.sampling_params() if plan else {})}
    obj = GenerateReqInput(input_ids=prompt.ids, sampling_params=sp, stream=bool(req.stream))
    return ResponseRun(tm, req, plan, parser, prompt), obj


def register_responses_routes(app: FastAPI, tm) -> None:
    store = ResponseStore(getattr(tm.server_args, "max_stored_responses", 1024))
    app.state.responses_store = store

    @app.post("/v1/responses")
    async def create_response(request: Request):
        try:
            run, obj = _prepare(tm, store, await read_json_object(request))
            gens, firsts = await start_generations(tm, [obj], request)
        except Exception as e:
            return openai_error_response(e)
        headers = {RESPONSE_ID_HEADER: run.id}
        if not obj.stream:
            await close_all(gens)
            try:
                run.feed(firsts[0])
                return JSONResponse(run.finish(store), headers=headers)
            except Exception as e:
                return openai_error_response(e)
        return StreamingResponse(_events(run, store, gens, firsts),
                                 media_type="text/event-stream", headers=headers)

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str):
        item = store.get(response_id)
        if item is None:
            return openai_error_response(_not_found(response_id))
        return JSONResponse(item.response, headers={RESPONSE_ID_HEADER: response_id})

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str):
        if not store.delete(response_id):
            return openai_error_response(_not_found(response_id))
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})


async def _events(run: ResponseRun, store: ResponseStore, gens: list, firsts: list):
    out = run.out
    out.event("response.created", response=run.response("in_progress"))
    out.event("response.in_progress", response=run.response("in_progress"))
    rest = all_updates(gens, firsts)
    try:
        async for _, update in rest:
            run.feed(update)
            for e in out.take_events():
                yield e
        obj = run.finish(store)
        out.event("response.incomplete" if obj["status"] == "incomplete"
                  else "response.completed", response=obj)
    except Exception as e:  # after the 200: the stream's error event, then the response failed
        err = to_api_error(e)
        out.event("error", code=err.code, message=err.message, param=err.param)
        # the terminal event a Responses client waits for (in place of response.completed):
        # a cut stream (a dead scheduler, a stopping server) never looks finished
        code = err.code or ("server_error" if err.status >= 500 else "invalid_request")
        out.event("response.failed", response=run.response(
            "failed", error={"code": code, "message": err.message}))
    finally:
        await rest.aclose()
    for e in out.take_events():
        yield e
