"""Fake router workers for tests/unit/test_router_proxy.py: small FastAPI apps served by uvicorn
from threads of the test process (`ThreadServer`, `fake_worker`), raw sockets that break
connections (`BrokenWorker`), and a router in front of them (`start_router`)."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from radixlm.net import free_port
from radixlm.router.app import Router, build_app
from radixlm.router.args import RouterArgs


class ThreadServer:
    """An ASGI app served by uvicorn from a thread."""

    def __init__(self, app):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port,
                                                    log_level="error", loop="asyncio",
                                                    # a test's slow handler (5 s) is cut, not awaited
                                                    timeout_graceful_shutdown=0.5))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.02)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(10)


def fake_worker(name: str) -> FastAPI:
    """Answers like a radixlm server: /generate returns which worker served it."""
    app = FastAPI()
    app.state.healthy = True
    app.state.seen = []  # (path, body) of requests
    app.state.disconnected = []

    @app.get("/health")
    async def health():
        return Response(status_code=200 if app.state.healthy else 503)

    @app.post("/generate")
    async def generate(request: Request):
        body = await request.json()
        app.state.seen.append(("/generate", body))
        if body.get("stream"):
            async def events():
                try:
                    for i in range(3):
                        yield f"data: {json.dumps({'worker': name, 'i': i})}\n\n".encode()
                        await asyncio.sleep(body.get("gap", 0.0))
                    yield b"data: [DONE]\n\n"
                except asyncio.CancelledError:
                    app.state.disconnected.append(body.get("text"))
                    raise
            return StreamingResponse(events(), media_type="text/event-stream")
        await asyncio.sleep(body.get("sleep", 0.0))
        return {"worker": name, "text": body.get("text"),
                "auth": request.headers.get("authorization")}

    @app.get("/get_server_info")
    async def info():
        return {"model_path": "fake", "dp_size": 1, "internal_states": [{"worker": name}]}

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush():
        app.state.seen.append(("/flush_cache", None))
        return Response("Cache flushed.\n")

    app.state.responses = {}

    @app.post("/v1/responses")
    async def create_response(request: Request):
        """Like a radixlm worker's store: a continuation of a response held elsewhere is a 404."""
        body = await request.json()
        prev = body.get("previous_response_id")
        if prev is not None and prev not in app.state.responses:
            return JSONResponse({"error": {"message": f"{prev} not found"}}, status_code=404)
        rid = f"resp_{name}_{len(app.state.responses)}"
        app.state.responses[rid] = {"id": rid, "worker": name, "previous": prev}
        headers = {"x-radixlm-response-id": rid}
        if body.get("stream"):
            async def events():
                yield f"data: {json.dumps({'type': 'response.created', 'id': rid})}\n\n".encode()
            return StreamingResponse(events(), media_type="text/event-stream", headers=headers)
        return JSONResponse(app.state.responses[rid], headers=headers)

    @app.api_route("/v1/responses/{rid}", methods=["GET", "DELETE"])
    async def stored_response(request: Request, rid: str):
        if rid not in app.state.responses:
            return JSONResponse({"error": {"message": "not found"}}, status_code=404)
        if request.method == "DELETE":
            return {"id": rid, "deleted": True, "worker": app.state.responses.pop(rid)["worker"]}
        return app.state.responses[rid]

    @app.post("/bad")
    async def bad():
        return JSONResponse({"error": {"message": "nope"}}, status_code=400)

    return app


class BrokenWorker:
    """A raw socket 'worker': /health answers 200; any other request gets `reply` (bytes) and
    then the connection is closed (reply b'': closed before any answer, as a crashed worker)."""

    def __init__(self, reply: bytes = b""):
        self.reply = reply
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.requests = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                data = conn.recv(65536)
                if data.startswith(b"GET /health"):
                    conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
                    continue
                self.requests += 1
                if self.reply:
                    conn.sendall(self.reply)
                    time.sleep(0.2)

    def close(self):
        self.sock.close()


def start_router(urls, **kw) -> tuple[ThreadServer, Router]:
    router = Router(RouterArgs(worker_urls=tuple(urls), health_check_interval_secs=kw.pop(
        "interval", 60.0), **kw))
    for u in urls:
        router.pool.add(u)
    return ThreadServer(build_app(router)), router
