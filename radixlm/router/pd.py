"""The router's prefill/decode mode: `radixlm router --pd-disaggregation --prefill URL [PORT]
--decode URL` (sgl-router's flag form).

A request (/generate, /v1/completions, /v1/chat/completions) gets a random `bootstrap_room` and the chosen prefill server's handshake
address (`bootstrap_host`: the prefill URL's host; `bootstrap_port`: the PORT given after the URL,
else the server's own --disaggregation-bootstrap-port from its /get_server_info), and goes to
both servers at once: the prefill server computes the prompt (its answer only carries the prompt
logprobs, merged into the decode server's answer), the decode server streams the output.

Failures: the answer is an error whenever either side fails. When the prefill side fails first
(refused, 5xx, its process died), the decode side's request is aborted (/abort_request by rid:
its reserved KV slots go back at once) and the client gets the prefill side's error; the decode
server itself also fails a room whose link broke or whose KV did not come within
--disaggregation-timeout, so nothing waits forever. A stream that already began gets the error
as a last `{"error": ...}` chunk, as the servers' own streams do.
Workers are chosen by the fewest requests in flight (round robin among equals). /generate,
/v1/completions and /v1/chat/completions are disaggregated (one prompt, n 1); other routes
answer 501 here: send them to a colocated server.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
import uuid
from typing import Optional
from urllib.parse import urlsplit

import httpx
import orjson
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from radixlm.router.workers import normalize_url

logger = logging.getLogger("radixlm.router")
INPUT_LOGPROB_KEYS = ("input_token_logprobs", "input_top_logprobs", "input_token_ids_logprobs")
PD_PATHS = ("/generate", "/v1/completions", "/v1/chat/completions")


class PDWorker:
    def __init__(self, url: str, bootstrap_port: Optional[int] = None):
        self.url = normalize_url(url)
        self.host = urlsplit(self.url).hostname
        self.bootstrap_port = bootstrap_port
        self.in_flight = 0


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "code": status}}, status_code=status)


def _sse(obj) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


class PDRouter:
    def __init__(self, prefill: list[tuple[str, Optional[int]]], decode: list[str],
                 request_timeout: float = 1800.0):
        self.prefill = [PDWorker(u, p) for u, p in prefill]
        self.decode = [PDWorker(u) for u in decode]
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(request_timeout, connect=10.0),
                                        limits=httpx.Limits(max_connections=None))
        self._turn = itertools.count()

    async def start(self, startup_timeout: float) -> None:
        """Every worker must answer /get_server_info in its role (a prefill worker in prefill
        mode, a decode worker in decode mode) within `startup_timeout` seconds."""
        async def check(w: PDWorker, role: str) -> None:
            deadline = asyncio.get_running_loop().time() + startup_timeout
            while True:
                try:
                    r = await self.client.get(w.url + "/get_server_info", timeout=10.0)
                    if r.status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if asyncio.get_running_loop().time() > deadline:
                    raise RuntimeError(f"{role} worker {w.url} did not answer in time")
                await asyncio.sleep(0.5)
            info = r.json()
            if info.get("disaggregation_mode") != role:
                raise RuntimeError(f"{w.url} is given as a {role} worker but runs with "
                                   f"--disaggregation-mode {info.get('disaggregation_mode')}")
            if role == "prefill" and w.bootstrap_port is None:
                w.bootstrap_port = int(info["disaggregation_bootstrap_port"])

        await asyncio.gather(*[check(w, "prefill") for w in self.prefill],
                             *[check(w, "decode") for w in self.decode])

    def pick(self, workers: list[PDWorker]) -> PDWorker:
        turn = next(self._turn)
        return min(workers, key=lambda w: (w.in_flight, (workers.index(w) - turn) % len(workers)))

    async def _post(self, w: PDWorker, path: str, body: dict, headers: dict) -> httpx.Response:
        w.in_flight += 1
        try:
            return await self.client.post(w.url + path, json=body, headers=headers)
        finally:
            w.in_flight -= 1

    async def _abort(self, w: PDWorker, rid: str, headers: dict) -> None:
        try:
            await self.client.post(w.url + "/abort_request", json={"rid": rid},
                                   headers=headers, timeout=10.0)
        except httpx.HTTPError as e:
            logger.warning("abort of %s on %s failed: %s", rid, w.url, e)

    def bodies(self, body: dict) -> tuple[PDWorker, PDWorker, dict, dict]:
        p, d = self.pick(self.prefill), self.pick(self.decode)
        body = dict(body, rid=body.get("rid") or uuid.uuid4().hex,
                    bootstrap_host=p.host, bootstrap_port=p.bootstrap_port,
                    bootstrap_room=random.getrandbits(63))
        return p, d, dict(body, stream=False), body

    async def forward(self, path: str, body: dict, headers: dict) -> Response:
        """`path`: /generate, /v1/completions or /v1/chat/completions (the decode server's
        answer in its own format; prompt logprobs are merged into /generate's)."""
        p, d, p_body, d_body = self.bodies(body)
        if path != "/generate":  # (the OpenAI routes: the prefill side's answer is discarded)
            p_body.pop("stream_options", None)
        p_task = asyncio.create_task(self._post(p, path, p_body, headers))
        if body.get("stream"):
            return StreamingResponse(self._stream(p, d, p_task, path, d_body, headers),
                                     media_type="text/event-stream")
        d_task = asyncio.create_task(self._post(d, path, d_body, headers))
        # whichever side fails first fails the request and frees the other side's at once
        await asyncio.wait({p_task, d_task}, return_when=asyncio.FIRST_COMPLETED)
        if not p_task.done() and _decode_failed(d_task):
            await self._abort(p, d_body["rid"], headers)
            p_task.cancel()
            await asyncio.gather(p_task, return_exceptions=True)
        else:
            failure = await _prefill_failure(p, p_task)
            if failure is not None:
                await self._abort(d, d_body["rid"], headers)
                d_task.cancel()
                await asyncio.gather(d_task, return_exceptions=True)
                return _error(*failure)
        try:
            r = await d_task
        except httpx.HTTPError as e:
            return _error(502, f"decode server {d.url}: {type(e).__name__}: {e}")
        if r.status_code != 200:
            return Response(r.content, r.status_code, media_type=r.headers.get("content-type"))
        out = r.json()
        if path == "/generate" and body.get("return_logprob"):
            _merge_input_logprobs(out, p_task.result().json())
        return JSONResponse(out)

    async def _stream(self, p: PDWorker, d: PDWorker, p_task, path: str, body: dict,
                      headers: dict):
        """The decode server's SSE, passed through; the prefill side's failure ends it with an
        error chunk (and aborts the decode side's request)."""
        want_lp = path == "/generate" and bool(body.get("return_logprob"))
        prefill_out = None
        d.in_flight += 1
        try:
            async with self.client.stream("POST", d.url + path, json=body,
                                          headers=headers) as r:
                if r.status_code != 200:
                    yield _sse({"error": {"message": (await r.aread()).decode(errors="replace"),
                                          "code": r.status_code}})
                    return
                lines = r.aiter_lines()
                while True:
                    nxt = asyncio.ensure_future(lines.__anext__())
                    await asyncio.wait({nxt, p_task}, return_when=asyncio.FIRST_COMPLETED)
                    if p_task.done() and not nxt.done():
                        failure = await _prefill_failure(p, p_task)
                        if failure is not None:
                            nxt.cancel()
                            await self._abort(d, body["rid"], headers)
                            yield _sse({"error": {"message": failure[1], "code": failure[0]}})
                            return
                    try:
                        line = await nxt
                    except StopAsyncIteration:
                        return
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data != "[DONE]" and want_lp:  # the prompt logprobs, in every chunk
                        if prefill_out is None:  # (as a colocated server's chunks carry them)
                            failure = await _prefill_failure(p, p_task)
                            if failure is not None:
                                await self._abort(d, body["rid"], headers)
                                yield _sse({"error": {"message": failure[1],
                                                      "code": failure[0]}})
                                return
                            prefill_out = p_task.result().json()
                        chunk = orjson.loads(data)
                        _merge_input_logprobs(chunk, prefill_out)
                        yield _sse(chunk)
                        continue
                    yield (line + "\n\n").encode()
        except httpx.HTTPError as e:
            await self._abort(p, body["rid"], headers)
            yield _sse({"error": {"message": f"decode server {d.url}: {type(e).__name__}: {e}",
                                  "code": 502}})
        finally:
            d.in_flight -= 1
            if not p_task.done():
                p_task.cancel()


def _decode_failed(d_task) -> bool:
    """The decode side's (finished) request failed: a transport error or a non-200."""
    if d_task.cancelled() or d_task.exception() is not None:
        return True
    return d_task.result().status_code != 200


async def _prefill_failure(p: PDWorker, p_task) -> Optional[tuple[int, str]]:
    """(status, message) when the prefill side's request failed, else None (waits for it)."""
    try:
        r = await p_task
    except asyncio.CancelledError:
        return 499, "cancelled"
    except httpx.HTTPError as e:
        return 502, f"prefill server {p.url}: {type(e).__name__}: {e}"
    if r.status_code != 200:
        return r.status_code, f"prefill server {p.url}: {r.text.strip()[:500]}"
    return None


def _not_disaggregated(path: str, body: dict) -> Optional[str]:
    """Why this body cannot be split over a prefill and a decode server, or None."""
    prompt = body.get("text") if path == "/generate" else body.get("prompt")
    ids = body.get("input_ids")
    if (isinstance(prompt, list) and prompt and not isinstance(prompt[0], int)) or (
            isinstance(ids, list) and ids and isinstance(ids[0], list)):
        return "a batch is not disaggregated: send one prompt per request"
    sp = body.get("sampling_params") if path == "/generate" else body
    if isinstance(sp, dict) and (sp.get("n") or 1) != 1:
        return "n > 1 is not disaggregated: send n requests"
    if path == "/v1/completions" and body.get("echo") and body.get("logprobs") is not None:
        return "echo with logprobs (prompt logprobs) is not disaggregated on /v1/completions"
    return None


def _merge_input_logprobs(out: dict, prefill_out: dict) -> None:
    meta, pmeta = out.get("meta_info"), prefill_out.get("meta_info") or {}
    if isinstance(meta, dict):
        for key in INPUT_LOGPROB_KEYS:
            if key in pmeta:
                meta[key] = pmeta[key]


def build_pd_app(router: PDRouter) -> FastAPI:
    app = FastAPI(title="radixlm PD router")

    @app.get("/health")
    async def health():
        return Response(status_code=200)

    @app.get("/list_workers")
    async def list_workers():
        return {"prefill": [{"url": w.url, "bootstrap_port": w.bootstrap_port,
                             "in_flight": w.in_flight} for w in router.prefill],
                "decode": [{"url": w.url, "in_flight": w.in_flight} for w in router.decode]}

    async def disaggregated(request: Request):
        try:
            body = orjson.loads(await request.body())
        except orjson.JSONDecodeError as e:
            return _error(400, f"the body is not JSON: {e}")
        if not isinstance(body, dict):
            return _error(400, "the body must be a JSON object")
        path = request.url.path
        problem = _not_disaggregated(path, body)
        if problem is not None:
            return _error(400, problem)
        headers = {k: v for k, v in request.headers.items() if k.lower() == "authorization"}
        return await router.forward(path, body, headers)

    for path in PD_PATHS:
        app.add_api_route(path, disaggregated, methods=["POST"])

    @app.api_route("/{path:path}", methods=["GET", "POST"])
    async def other(path: str):
        return _error(501, f"/{path}: the PD router disaggregates {', '.join(PD_PATHS)} only; "
                           f"send other routes to a colocated server")

    return app


def run_pd_router(args) -> None:
    """`radixlm router --pd-disaggregation`: serve until SIGTERM / Ctrl-C."""
    from contextlib import asynccontextmanager

    import uvicorn

    logging.basicConfig(level=args.log_level.upper(),
                        format="[router %(asctime)s] %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    if not args.prefill or not args.decode:
        raise SystemExit("radixlm router --pd-disaggregation: give at least one --prefill URL "
                         "[BOOTSTRAP_PORT] and one --decode URL")
    router = PDRouter(list(args.prefill), list(args.decode), args.request_timeout_secs)
    app = build_pd_app(router)

    @asynccontextmanager
    async def lifespan(a):
        await router.start(args.worker_startup_timeout_secs)
        print(f"radixlm router: prefill/decode over {len(router.prefill)} + "
              f"{len(router.decode)} worker(s) on http://{args.host}:{args.port}", flush=True)
        yield
        await router.client.aclose()

    app.router.lifespan_context = lifespan
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port,
                                           log_level=args.log_level, loop="asyncio",
                                           timeout_graceful_shutdown=
                                           args.timeout_graceful_shutdown))
    server.run()
    if not server.started:
        raise SystemExit(1)
