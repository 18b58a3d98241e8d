"""FastAPI app: SGLang's native API (/generate, /health, ...) plus the OpenAI and Anthropic APIs.

Bad input answers 400 with a message before anything is queued; the server never crashes on it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import logging
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.datastructures import Headers

from radixlm.runtime.sampling_params import MAX_N
from radixlm.server.anthropic_api import register_anthropic_routes
from radixlm.server.errors import QueueFullError
from radixlm.server.io_struct import GenerateReqInput
from radixlm.server.openai_api import register_openai_routes

logger = logging.getLogger(__name__)

_GENERATE_FIELDS = {f.name for f in dataclasses.fields(GenerateReqInput)}
# fields SGLang clients may send that this server accepts and ignores (no effect on text output)
_IGNORED_FIELDS = {"image_data", "lora_path", "session_params", "return_hidden_states",
                   "custom_logit_processor", "bootstrap_host", "bootstrap_room", "log_metrics",
                   "modalities", "token_ids_logprob"}


def error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "code": status}}, status_code=status)


def sse(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def parse_generate_body(body: Any) -> list[GenerateReqInput] | GenerateReqInput:
    """A native /generate body -> one GenerateReqInput, or a list for a batch (ValueError if bad)."""
    if not isinstance(body, dict):
        raise ValueError("the request body must be a JSON object")
    unknown = set(body) - _GENERATE_FIELDS - _IGNORED_FIELDS
    if unknown:
        raise ValueError(f"unknown field(s): {sorted(unknown)}")
    fields = {k: v for k, v in body.items() if k in _GENERATE_FIELDS and v is not None}
    text, ids = fields.get("text"), fields.get("input_ids")
    if text is None and ids is None:
        raise ValueError("text or input_ids is required")
    if not isinstance(fields.get("sampling_params", {}), (dict, list)):
        raise ValueError("sampling_params must be an object (or a list of them for a batch)")
    batch = isinstance(text, list) or (isinstance(ids, list) and ids and isinstance(ids[0], list))
    if not batch:
        if isinstance(fields.get("sampling_params"), list):
            raise ValueError("sampling_params: a list needs a batch of prompts")
        return GenerateReqInput(**fields)
    items = text if text is not None else ids
    if not items:
        raise ValueError("text/input_ids: the batch is empty")
    n = len(items)
    out = []
    for i in range(n):
        one = {}
        for k, v in fields.items():
            per_item = k in ("text", "input_ids") or (isinstance(v, list) and k != "input_ids"
                                                       and k in ("sampling_params", "rid",
                                                                 "return_logprob",
                                                                 "logprob_start_len",
                                                                 "top_logprobs_num"))
            if per_item:
                if len(v) != n:
                    raise ValueError(f"{k}: {len(v)} entries for a batch of {n}")
                one[k] = v[i]
            else:
                one[k] = v
        out.append(GenerateReqInput(**one))
    return out


class _Guard:
    """API key and body size checks, as a plain ASGI middleware.

    Not `@app.middleware("http")`: Starlette's BaseHTTPMiddleware hides the client's disconnect
    from `Request.is_disconnected()`, so a non-streaming request whose client went away would
    run to its end. A body without Content-Length (chunked) is read here up to
    --max-payload-size and answered 413 beyond it, so no route reads an unbounded body.
    """

    def __init__(self, app, api_key, max_payload_size: int):
        self.app, self.api_key, self.limit = app, api_key, max_payload_size

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = Headers(scope=scope)
        if self.api_key and scope["path"] != "/health":
            auth = headers.get("authorization", "")
            key = auth[7:] if auth.lower().startswith("bearer ") else headers.get("x-api-key")
            if key is None or not hmac.compare_digest(key.encode(), self.api_key.encode()):
                return await error(401, "invalid or missing API key")(scope, receive, send)
        size = headers.get("content-length")
        if size is not None:
            if size.isdigit() and int(size) > self.limit:
                return await error(413, f"request body of {size} bytes exceeds "
                                        f"--max-payload-size ({self.limit})")(scope, receive, send)
            return await self.app(scope, receive, send)
        chunks, total, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client left before sending it all
                return
            chunks.append(message.get("body", b""))
            total += len(chunks[-1])
            more = message.get("more_body", False)
            if total > self.limit:
                return await error(413, f"request body exceeds --max-payload-size "
                                        f"({self.limit})")(scope, receive, send)
        pending = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def replay():  # the buffered body once, then the client's own events (disconnect)
            return pending.pop() if pending else await receive()

        return await self.app(scope, replay, send)


def build_app(tm, args, health) -> FastAPI:
    """`health()` -> None when all processes live, else a message (then /health answers 503)."""
    app = FastAPI(title="radixlm")
    app.state.tm = tm

    app.add_middleware(_Guard, api_key=args.api_key, max_payload_size=args.max_payload_size)

    @app.exception_handler(json.JSONDecodeError)
    async def bad_json(request, exc):
        return error(400, f"invalid JSON: {exc}")

    @app.get("/health")
    async def health_route():
        problem = health()
        return Response(status_code=200) if problem is None else error(503, problem)

    @app.get("/health_generate")
    async def health_generate(request: Request):
        obj = GenerateReqInput(input_ids=[0], sampling_params={"max_new_tokens": 1})
        try:
            async for _ in tm.generate(obj, request):
                pass
        except Exception as e:  # report, never crash
            return error(503, f"generation failed: {e}")
        return Response(status_code=200)

    @app.get("/get_model_info")
    async def model_info():
        return {"model_path": tm.model_path, "tokenizer_path": args.tokenizer_path or tm.model_path,
                "is_generation": True, "served_model_name": tm.model_name,
                "context_length": tm.context_len, "eos_token_ids": tm.info["eos_token_ids"]}

    @app.get("/get_server_info")
    async def server_info():
        info = dataclasses.asdict(args)
        info.pop("api_key", None)  # secrets never leave the server
        info["internal_states"] = [await tm.control("get_stats")]
        info["max_total_num_tokens"] = tm.info["max_total_tokens"]
        info["device"], info["dtype"] = tm.info["device"], tm.info["dtype"]  # resolved, not "auto"
        info["version"] = __import__("radixlm").__version__
        return info

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache():
        ok = await tm.control("flush_cache")
        if not ok:
            return error(400, "cannot flush the cache while requests are running")
        return Response("Cache flushed.\n", status_code=200)

    @app.post("/abort_request")
    async def abort_request(request: Request):
        try:
            body = await _json_body(request)
        except ValueError as e:
            return error(400, str(e))
        if not isinstance(body, dict) or not isinstance(body.get("rid"), str):
            return error(400, "rid (string) is required")
        await tm.abort_request(body["rid"])
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics():
        if tm.metrics is None:
            return error(404, "metrics are off; start the server with --enable-metrics")
        stats = await tm.control("get_stats")
        return Response(tm.metrics.render(stats), media_type="text/plain; version=0.0.4")

    @app.get("/debug/kv_integrity")
    async def kv_integrity():
        """KV accounting check (free + cached + in use == capacity), used by the tests."""
        try:
            await tm.control("check_integrity")
        except RuntimeError as e:
            return error(500, f"KV integrity check failed: {e}")
        return {"ok": True, **await tm.control("get_stats")}

    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(request: Request):
        try:
            parsed = parse_generate_body(await _json_body(request))
        except ValueError as e:
            return error(400, str(e))
        try:
            parsed = _expand_n(parsed)
            if isinstance(parsed, list):
                if any(p.stream for p in parsed):
                    return error(400, "stream: streaming takes a single prompt")
                for p in parsed:  # validate the whole batch before queueing any of it
                    tm.tokenize_request(p)
                results = await asyncio.gather(*(_final(tm, p, request) for p in parsed))
                return results
            if parsed.stream:
                tm.tokenize_request(parsed)  # 400 before the stream starts
                return StreamingResponse(_stream(tm, parsed, request), media_type="text/event-stream")
            return await _final(tm, parsed, request)
        except ValueError as e:
            return error(400, str(e))
        except QueueFullError as e:
            return error(503, str(e))

    register_openai_routes(app, tm)
    register_anthropic_routes(app, tm)
    return app


def _expand_n(parsed):
    """`sampling_params.n` > 1: n requests per prompt, prompt-major, as a batch (SGLang's shape)."""
    items = parsed if isinstance(parsed, list) else [parsed]
    ns = []
    for p in items:
        n = p.sampling_params.get("n", 1) if isinstance(p.sampling_params, dict) else 1
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_N:
            raise ValueError(f"sampling_params.n: must be an integer in [1, {MAX_N}] (got {n!r})")
        ns.append(n)
    if all(n == 1 for n in ns):
        return parsed
    out = []
    for p, n in zip(items, ns):
        for k in range(n):
            sp = {**p.sampling_params, "n": 1}
            rid = f"{p.rid}-{k}" if p.rid else None
            out.append(dataclasses.replace(p, sampling_params=sp, rid=rid))
    return out


async def _json_body(request: Request) -> Any:
    raw = await request.body()
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise ValueError(f"invalid JSON: {e}") from None


async def _final(tm, obj: GenerateReqInput, request) -> dict:
    out = None
    async for out in tm.generate(obj, request):
        pass
    return out


async def _stream(tm, obj: GenerateReqInput, request):
    try:
        async for chunk in tm.generate(obj, request):
            yield sse(chunk)
    except (ValueError, QueueFullError) as e:
        yield sse({"error": {"message": str(e)}})
    yield b"data: [DONE]\n\n"
