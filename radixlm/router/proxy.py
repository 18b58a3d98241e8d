"""Forwarding one request to one worker, streamed or not, with retry on a broken worker.

Streaming (`"stream": true` in the body): the worker's bytes go to the client as they arrive
(`aiter_raw`, no buffering, no re-encoding), so SSE chunks keep their timing. The client's
disconnect cancels the body iterator, which closes the upstream connection, which the worker sees
as a disconnect and aborts the request (its KV is freed there, not left running).

Not streaming: the whole response is read from the worker before anything goes to the client, and
the client's disconnect is watched meanwhile (and propagated the same way).

Retries: a request whose worker fails *before anything was sent back to the client* (connection
refused or reset, the worker died mid-request) is sent again to another live worker, up to
`retries` more times. That is safe because the client never saw the first attempt's output: a
generation has no side effect beyond the worker's cache, and a sampled request re-run elsewhere is
just another sample. A stream that breaks after its first bytes cannot be retried (the client
already has part of it): it ends with an error event in the called API's format (OpenAI and
native: `data: {"error": ...}`; Anthropic and Responses: `event: error`, which their SDKs surface),
and the client sees the stream end without `[DONE]`. HTTP errors a worker answers (4xx, 5xx) are passed through as they
are: they are the request's answer, not a broken worker.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import AsyncIterator, Optional

import httpx
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from radixlm.router.affinity import ResponseOwners
from radixlm.router.client_shards import ClientShards
from radixlm.router.keys import key_units
from radixlm.router.workers import Worker, WorkerPool

logger = logging.getLogger("radixlm.router")

# hop-by-hop headers (RFC 9110 7.6.1) and those the proxy recomputes; accept-encoding is dropped
# so workers answer uncompressed (SSE through a compressor would be buffered)
_REQ_DROP = {"host", "content-length", "connection", "keep-alive", "transfer-encoding", "te",
             "trailer", "upgrade", "proxy-connection", "accept-encoding"}
_RESP_DROP = {"content-length", "connection", "keep-alive", "transfer-encoding", "te", "trailer",
              "upgrade", "proxy-connection", "date", "server"}


def error_response(path: str, status: int, message: str) -> JSONResponse:
    """An error in the dialect of the API called (Anthropic's shape for /v1/messages)."""
    if path.startswith("/v1/messages"):
        kind = "overloaded_error" if status == 503 else "api_error"
        return JSONResponse({"type": "error", "error": {"type": kind, "message": message}},
                            status_code=status)
    return JSONResponse({"error": {"message": message, "type": "router_error", "code": status}},
                        status_code=status)


def stream_error_event(path: str, status: int, message: str) -> bytes:
    """The SSE error event that ends a broken stream, in the dialect of the API called."""
    if path.startswith("/v1/messages"):
        kind = "overloaded_error" if status == 503 else "api_error"
        body = {"type": "error", "error": {"type": kind, "message": message}}
        return b"event: error\ndata: " + json.dumps(body).encode() + b"\n\n"
    if path.startswith("/v1/responses"):
        body = {"type": "error", "code": "server_error", "message": message, "param": None}
        return b"event: error\ndata: " + json.dumps(body).encode() + b"\n\n"
    return b"data: " + json.dumps({"error": {"message": message, "code": status}}).encode() + \
        b"\n\n"


def sent_path(request: Request) -> str:
    """The path as the client sent it, percent-encoding kept, for the worker's URL: decoded, a
    %13 in it made that URL invalid (httpx.InvalidURL, a 500; found by fuzzing)."""
    raw = request.scope.get("raw_path")
    return raw.decode("ascii", "replace") if raw else request.url.path


def forward_headers(request: Request) -> dict[str, str]:
    return {k: v for k, v in request.headers.items() if k.lower() not in _REQ_DROP}


def _response_headers(resp: httpx.Response) -> dict[str, str]:
    return {k: v for k, v in resp.headers.items() if k.lower() not in _RESP_DROP}


async def _until_disconnect(request: Request) -> None:
    """Returns when the client disconnects (the body was read already, so the next ASGI
    message is the disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _unless_disconnected(request: Request, coro) -> tuple[bool, object]:
    """(True, coro's result), or (False, None) when the client disconnects first: then coro is
    cancelled, which closes its connection to the worker (the worker aborts the request)."""
    task = asyncio.ensure_future(coro)
    gone = asyncio.ensure_future(_until_disconnect(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return True, task.result()  # raises the worker's TransportError, if any
        return False, None
    finally:
        for t in (task, gone):
            if not t.done():
                t.cancel()
        await asyncio.gather(task, gone, return_exceptions=True)


class Proxy:
    """`clients` carry the forwarded requests (see client_shards.py); `client` the few
    broadcasts (`to_all`)."""

    def __init__(self, pool: WorkerPool, client: httpx.AsyncClient, clients: ClientShards,
                 retries: int = 2):
        self.pool, self.client, self.clients, self.retries = pool, client, clients, retries
        self.owners = ResponseOwners()  # stored /v1/responses -> the worker holding each

    async def forward(self, request: Request, path: str, body: bytes, key: Optional[str],
                      stream: bool, prefer: Optional[str] = None,
                      target: Optional[str] = None) -> Response:
        """Send to the policy's choice (`prefer`, a worker URL, first when it is live); on a
        broken worker, to another (see module doc). `target`: the path for the worker's URL as
        the client sent it (sent_path), where it differs from the decoded `path`."""
        tried: set[str] = set()
        last_problem, status = "no live worker", 503
        units = key_units(key)
        headers = forward_headers(request)
        query = request.url.query
        url_path = (target or path) + ("?" + query if query else "")
        for _ in range(1 + self.retries):
            w = self.pool.pick(key, exclude=tried, prefer=prefer)
            if w is None:
                break
            tried.add(w.url)
            w.begin(units)
            client = self.clients.acquire()
            ended = False
            try:
                req = client.build_request(request.method, w.url + url_path, headers=headers,
                                           content=body)
                done, result = await _unless_disconnected(request,
                                                          self._exchange(client, req, stream))
                if not done:  # the client left: nobody to answer (the worker saw us go)
                    return Response(status_code=499)
                self.owners.learn((result if stream else result[0]).headers, w.url)
                if stream:
                    ended = True  # the stream's finally ends it from now on
                    return StreamingResponse(self._relay(result, w, units, client, path),
                                             result.status_code,
                                             headers=_response_headers(result))
                resp, content = result
                return Response(content, resp.status_code, headers=_response_headers(resp))
            except httpx.TransportError as e:
                if isinstance(e, httpx.TimeoutException) and not isinstance(
                        e, httpx.ConnectTimeout):  # slow, not broken: a retry would double it
                    return error_response(path, 504, f"worker {w.url} sent nothing for "
                                                     f"--request-timeout-secs ({e})")
                last_problem, status = f"worker {w.url} failed: {type(e).__name__}: {e}", 502
                logger.warning("%s; %s", last_problem,
                               "retrying on another worker" if self.retries else "giving up")
                await self.pool.report_failure(w, e)
            finally:
                if not ended:
                    w.end(units)
                    self.clients.release(client)
        return error_response(path, status, last_problem)

    @staticmethod
    async def _exchange(client: httpx.AsyncClient, req: httpx.Request, stream: bool):
        """stream: the response, its body still to come; else (response, whole body)."""
        resp = await client.send(req, stream=True)
        if stream:
            return resp
        try:
            return resp, await resp.aread()
        finally:
            await resp.aclose()

    async def _relay(self, resp: httpx.Response, w: Worker, units: int,
                     client: httpx.AsyncClient, path: str) -> AsyncIterator[bytes]:
        sse = resp.headers.get("content-type", "").startswith("text/event-stream")
        try:
            async for chunk in resp.aiter_raw():
                yield chunk
        except httpx.TransportError as e:
            logger.warning("stream from %s broke: %s: %s", w.url, type(e).__name__, e)
            await self.pool.report_failure(w, e)
            if sse:
                yield stream_error_event(path, 502, f"the worker serving this stream failed "
                                                    f"({type(e).__name__})")
        finally:
            w.end(units)
            self.clients.release(client)
            await resp.aclose()

    async def to_all(self, method: str, path: str, headers: dict, body: bytes = b"",
                     timeout: float = 600.0) -> list[tuple[Worker, object]]:
        """The same request to every live worker, concurrently: [(worker, response or error)]."""
        workers = self.pool.live()

        async def one(w):
            try:
                return w, await self.client.request(method, w.url + path, headers=headers,
                                                    content=body, timeout=timeout)
            except httpx.HTTPError as e:
                return w, e

        return list(await asyncio.gather(*(one(w) for w in workers)))
