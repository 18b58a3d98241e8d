"""FastAPI app: health, cache, abort, metrics and debug routes here; SGLang's native API
(native_api.py: /generate, /encode, /tokenize, /detokenize; admin_api.py: model and server
info, profiling, weight updates) and the OpenAI and Anthropic APIs are registered from their
modules.

Bad input answers 400 with a message before anything is queued; the server never crashes on it.
"""

from __future__ import annotations

import hmac
import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException

from radixlm.server import openapi_bodies
from radixlm.server.admin_api import (ADMIN_DISABLED, ADMIN_PATHS, admin_key, is_loopback,
                                      register_admin_routes)
from radixlm.server.anthropic_api import register_anthropic_routes
from radixlm.server.errors import UnavailableError, any_api_error_body
from radixlm.server.io_struct import GenerateReqInput
from radixlm.server.native_api import error, json_body, register_native_routes
from radixlm.server.openai_api import register_openai_routes

logger = logging.getLogger(__name__)

# How long an idle keep-alive connection stays open. uvicorn's default (5 s) equals httpx's
# client-side expiry (5 s), so a client may reuse a connection at the very moment the server
# closes it: the request then fails with a bare ReadError (seen as 1-2 of 512 requests under
# benchmarks/dp_router.py's load). Longer than the usual client expiries closes that race.
KEEP_ALIVE_S = 75


class _Guard:
    """API key and body size checks, as a plain ASGI middleware.

    Not `@app.middleware("http")`: Starlette's BaseHTTPMiddleware hides the client's disconnect
    from `Request.is_disconnected()`, so a non-streaming request whose client went away would
    run to its end. A body without Content-Length (chunked) is read here up to
    --max-payload-size and answered 413 beyond it, so no route reads an unbounded body.
    """

    def __init__(self, app, api_key, max_payload_size: int, admin_api_key=None,
                 admin_open: bool = True, admin_paths=ADMIN_PATHS):
        """Admin routes (`admin_paths`) check `admin_api_key` instead of `api_key`; without it
        they answer 403 unless `admin_open` (a loopback bind)."""
        self.app, self.api_key, self.limit = app, api_key, max_payload_size
        self.admin_api_key, self.admin_open = admin_api_key, admin_open
        self.admin_paths = admin_paths

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = Headers(scope=scope)
        if scope["path"] in self.admin_paths:
            need = self.admin_api_key
            if need is None and not self.admin_open:
                return await error(403, ADMIN_DISABLED)(scope, receive, send)
        else:
            need = self.api_key if scope["path"] != "/health" else None
        if need:
            auth = headers.get("authorization", "")
            key = auth[7:] if auth.lower().startswith("bearer ") else headers.get("x-api-key")
            if key is None or not hmac.compare_digest(key.encode(), need.encode()):
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

    admin_open = is_loopback(args.host)
    if not admin_key(args) and not admin_open:
        logger.warning("%s (--host %s)", ADMIN_DISABLED, args.host)
    app.add_middleware(_Guard, api_key=args.api_key, max_payload_size=args.max_payload_size,
                       admin_api_key=admin_key(args), admin_open=admin_open)

    @app.exception_handler(json.JSONDecodeError)
    async def bad_json(request, exc):
        return error(400, f"invalid JSON: {exc}")

    # FastAPI's own errors ({"detail": ...}: no route for the path, a method it does not take)
    # and any bug get a JSON body whose error.message says what happened, like every route's
    @app.exception_handler(StarletteHTTPException)
    async def framework_error(request, exc: StarletteHTTPException):
        return JSONResponse(any_api_error_body(exc.status_code, str(exc.detail)),
                            status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid_parameters(request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()))
        return JSONResponse(any_api_error_body(400, f"{where}: {first.get('msg', 'invalid')}"),
                            status_code=400)

    @app.exception_handler(UnavailableError)
    async def unavailable(request, exc: UnavailableError):  # e.g. a control call, runtime gone
        return JSONResponse(any_api_error_body(503, str(exc)), status_code=503)

    @app.exception_handler(Exception)
    async def internal_error(request, exc: Exception):  # Starlette logs the traceback too
        return JSONResponse(any_api_error_body(500, f"internal server error: "
                                                    f"{type(exc).__name__}: {exc}"),
                            status_code=500)

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

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache(request: Request):
        # the device and host tiers; ?storage=true also deletes the store's pages (hicache)
        flag = request.query_params.get("storage", "false").lower()
        if flag not in ("true", "false", "1", "0"):
            return error(400, f"storage: must be true or false (got {flag!r})")
        ok = await tm.control("flush_cache", {"storage": flag in ("true", "1")})
        if not ok:
            return error(400, "cannot flush the cache while requests are running")
        return Response("Cache flushed.\n", status_code=200)

    @app.post("/abort_request")
    async def abort_request(request: Request):
        try:
            body = await json_body(request)
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
        # the detokenizer's isolated failures count with the scheduler's (one metric)
        stats["request_failures"] = (stats.get("request_failures", 0)
                                     + getattr(tm, "detokenizer_failures", 0))
        return Response(tm.metrics.render(stats), media_type="text/plain; version=0.0.4")

    @app.get("/debug/kv_integrity")
    async def kv_integrity():
        """KV accounting check (free + cached + in use == capacity), used by the tests."""
        try:
            await tm.control("check_integrity")
        except RuntimeError as e:
            return error(500, f"KV integrity check failed: {e}")
        return {"ok": True, **await tm.control("get_stats")}

    register_native_routes(app, tm, args)
    register_admin_routes(app, tm, args)
    register_openai_routes(app, tm)
    register_anthropic_routes(app, tm)
    openapi_bodies.install(app)
    return app
