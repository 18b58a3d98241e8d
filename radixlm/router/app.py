"""The router's HTTP front: FastAPI routes over a WorkerPool and a Proxy.

Routes of the router itself:
  /health                 200 while at least one worker is in the pool (and, under --dp-size,
                          the launcher reports nothing wrong), else 503
  /list_workers           the pool: URLs, per-worker load and tree sizes, removed workers
  /add_worker?url=        (POST) added once its /health answers 200
  /remove_worker?url=     (POST)
  /get_server_info        the first worker's info, plus dp_size, load_balance_method, every
  (/server_info)          worker's internal_states (one entry per worker) and the router's view
  /flush_cache, /abort_request, /start_profile, /stop_profile, /update_weights_from_disk,
  /debug/kv_integrity     sent to every worker (an abort's rid lives on one of them); the answer
                          is 200 when every worker answered 200
Everything else (/generate, /v1/chat/completions, /v1/completions, /v1/messages,
/v1/embeddings, /v1/models, /get_model_info, /tokenize, ...) is forwarded to the policy's choice
by proxy.py, streamed when the body says `"stream": true`.
/metrics merges the workers' (each sample labelled with its worker).
/v1/responses: a continuation (previous_response_id) and GET / DELETE /v1/responses/{id} go to
the worker that created the response (affinity.py); an id the router does not know is asked of
every worker, and the first answer other than 404 is returned.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from contextlib import asynccontextmanager
from typing import Callable, Optional

import httpx
import orjson
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from radixlm.router.affinity import stored_response_id
from radixlm.router.args import RouterArgs
from radixlm.router.client_shards import ClientShards
from radixlm.router.keys import routing_key
from radixlm.router.policy import make_policy
from radixlm.router.proxy import Proxy, error_response, forward_headers, sent_path
from radixlm.router.workers import WorkerPool, normalize_url
from radixlm.server.admin_api import ADMIN_DISABLED, ADMIN_PATHS, admin_key, is_loopback
from radixlm.server.http_server import KEEP_ALIVE_S, _Guard

logger = logging.getLogger("radixlm.router")

BROADCAST = ("/flush_cache", "/abort_request", "/start_profile", "/stop_profile",
             "/update_weights_from_disk", "/debug/kv_integrity")


ROUTER_ADMIN_PATHS = ADMIN_PATHS | {"/add_worker", "/remove_worker"}


def merge_metrics(texts: list[tuple[str, str]]) -> str:
    """Several workers' Prometheus texts as one: every sample gains a `worker` label, and each
    metric family's HELP / TYPE lines and samples stay together (the exposition format wants one
    group per family)."""
    families: dict[str, list[str]] = {}
    for url, text in texts:
        family = ""
        for line in text.splitlines():
            if not line.strip():
                continue
            if line.startswith("#"):
                parts = line.split(None, 3)
                if len(parts) >= 3 and parts[1] in ("HELP", "TYPE"):
                    family = parts[2]
                    head = families.setdefault(family, [])
                    if line not in head:
                        head.append(line)
                continue
            name, brace, rest = line.partition("{")
            label = f'worker="{url}"'
            if brace and " " not in name:
                line = f"{name}{{{label},{rest}" if not rest.startswith("}") else \
                    f"{name}{{{label}{rest}"
            else:
                name, _, value = line.partition(" ")
                line = f"{name}{{{label}}} {value}"
            families.setdefault(family, []).append(line)
    return "".join(line + "\n" for lines in families.values() for line in lines)


class Router:
    """The pool, the proxy and their HTTP client, built from RouterArgs."""

    def __init__(self, args: RouterArgs, on_remove=None):
        self.args = args
        self.policy = make_policy(args.policy, args.cache_threshold, args.balance_abs_threshold,
                                  args.balance_rel_threshold, args.max_tree_size)
        # no pool limit: the router's concurrency is its clients'; the workers queue. Idle
        # connections expire before the 5 s after which uvicorn-served workers (SGLang's too)
        # close them, so a reused connection is never one the worker is closing.
        tls = ssl.create_default_context()  # one for all shards (httpx: ~22 ms per client)

        def make_client() -> httpx.AsyncClient:
            return httpx.AsyncClient(
                timeout=httpx.Timeout(args.request_timeout_secs, connect=10.0, pool=None),
                limits=httpx.Limits(max_connections=None, max_keepalive_connections=256,
                                    keepalive_expiry=4.0), verify=tls)

        self.client = make_client()  # health checks and broadcasts
        self.shards = ClientShards(make_client)  # forwarded requests
        self.pool = WorkerPool(self.policy, self.client, args.health_failure_threshold,
                               args.health_check_interval_secs, args.health_check_timeout_secs,
                               on_remove)
        self.proxy = Proxy(self.pool, self.client, self.shards, args.retry_max_retries)

    async def add_initial_workers(self) -> None:
        """Standalone start-up: every --worker-urls worker must answer /health within
        --worker-startup-timeout-secs (as in sgl-router), else the router does not start."""
        urls = [normalize_url(u) for u in self.args.worker_urls]
        problems = await asyncio.gather(*(self.pool.wait_healthy(
            u, self.args.worker_startup_timeout_secs) for u in urls))
        bad = [f"{u}: {p}" for u, p in zip(urls, problems) if p is not None]
        if bad:
            raise RuntimeError("workers not healthy in time: " + "; ".join(bad))
        for u in urls:
            self.pool.add(u)


def _ok(r) -> bool:
    return isinstance(r, httpx.Response) and r.status_code == 200


def _describe(w, r) -> str:
    if isinstance(r, httpx.Response):
        return f"{w.url}: {r.status_code} {r.text.strip()[:300]}"
    return f"{w.url}: {type(r).__name__}: {r}"


def build_app(router: Router, health: Optional[Callable[[], Optional[str]]] = None,
              info_extra: Optional[dict] = None) -> FastAPI:
    """`health()` -> None, or why the whole service is unhealthy (the DP launcher's watchdog);
    `info_extra`: fields /get_server_info reports over the workers' (dp_size, the main flags)."""
    pool, proxy, args = router.pool, router.proxy, router.args

    @asynccontextmanager
    async def lifespan(app):
        checker = asyncio.create_task(pool.health_loop())
        try:
            yield
        finally:
            checker.cancel()
            await asyncio.gather(checker, return_exceptions=True)
            await router.client.aclose()
            await router.shards.aclose()

    app = FastAPI(title="radixlm router", lifespan=lifespan)
    app.state.router = router
    # the workers' admin routes (sent to every worker) and the pool's own: same rule as a server's
    admin_open = is_loopback(args.host)
    if not admin_key(args) and not admin_open:
        logger.warning("%s (--host %s)", ADMIN_DISABLED, args.host)
    app.add_middleware(_Guard, api_key=args.api_key, max_payload_size=args.max_payload_size,
                       admin_api_key=admin_key(args), admin_open=admin_open,
                       admin_paths=ROUTER_ADMIN_PATHS)

    # errors are JSON with a message, as the workers' (a method the catch-all route does not
    # take, e.g. OPTIONS, is FastAPI's {"detail"} otherwise); success texts stay SGLang's
    @app.exception_handler(StarletteHTTPException)
    async def framework_error(request, exc: StarletteHTTPException):
        return error_response(request.url.path, exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def internal_error(request, exc: Exception):  # a bug; Starlette logs the traceback
        return error_response(request.url.path, 500,
                              f"internal router error: {type(exc).__name__}: {exc}")

    @app.get("/health")
    async def health_route():
        problem = health() if health is not None else None
        if problem is None and not pool.workers:
            problem = "no live worker"
        return Response(status_code=200) if problem is None else error_response("", 503, problem)

    @app.get("/list_workers")
    async def list_workers():
        workers = [{**w.info(), **router.policy.stats(w.url)} for w in pool.live()]
        out = {"urls": [w["url"] for w in workers], "workers": workers,
               "removed": pool.removed, "policy": router.policy.name}
        if hasattr(router.policy, "decisions"):
            out["decisions"] = dict(router.policy.decisions)
        return out

    @app.post("/add_worker")
    async def add_worker(url: Optional[str] = None):
        if not url:
            return error_response("", 400, "url query parameter is required")
        url = normalize_url(url)
        if url in pool.workers:
            return error_response("", 400, f"Worker {url} already exists")
        problem = await pool.wait_healthy(url, args.worker_startup_timeout_secs)
        if problem is not None:
            return error_response("", 400, f"Failed to add worker {url}: {problem}")
        pool.add(url)
        return PlainTextResponse(f"Successfully added worker: {url}")

    @app.post("/remove_worker")
    async def remove_worker(url: Optional[str] = None):
        if not url or not pool.remove(url, "removed by /remove_worker"):
            return error_response("", 404, f"Worker {url} not found")
        return PlainTextResponse(f"Successfully removed worker: {normalize_url(url)}")

    @app.get("/get_server_info")
    @app.get("/server_info")
    async def server_info(request: Request):
        results = await proxy.to_all("GET", "/get_server_info", forward_headers(request),
                                     timeout=60.0)
        infos = [r.json() for _, r in results if _ok(r)]
        if not infos:
            detail = "; ".join(_describe(w, r) for w, r in results) or "no live worker"
            return error_response("", 503, f"no worker answered /get_server_info: {detail}")
        info = dict(infos[0])
        info["internal_states"] = [s for i in infos for s in i.get("internal_states", [])]
        info["dp_size"] = len(pool.workers)  # standalone: the workers it routes to
        info.update(info_extra or {})  # --dp-size: the configured replicas
        info["load_balance_method"] = router.policy.name
        info["router"] = {"policy": router.policy.name, "cache_threshold": args.cache_threshold,
                          "balance_abs_threshold": args.balance_abs_threshold,
                          "balance_rel_threshold": args.balance_rel_threshold,
                          "workers": [w.info() for w in pool.live()]}
        return info

    async def broadcast(request: Request):
        body = await request.body()
        path = request.url.path
        path_q = path + ("?" + request.url.query if request.url.query else "")
        results = await proxy.to_all(request.method, path_q, forward_headers(request), body)
        if not results:
            return error_response(path, 503, "no live worker")
        bad = [(w, r) for w, r in results if not _ok(r)]
        if path == "/update_weights_from_disk":
            msgs = [_describe(w, r) for w, r in results]
            return JSONResponse({"success": not bad, "message": "; ".join(msgs),
                                 "num_paused_requests": 0}, status_code=200 if not bad else 400)
        if bad:
            w, r = bad[0]
            status = r.status_code if isinstance(r, httpx.Response) else 502
            return error_response(path, status, "; ".join(_describe(w, r) for w, r in bad))
        first = results[0][1]
        return Response(first.content, 200, media_type=first.headers.get("content-type"))

    for path in BROADCAST:
        app.add_api_route(path, broadcast, methods=["GET", "POST"])

    @app.get("/metrics")
    async def metrics(request: Request):
        results = await proxy.to_all("GET", "/metrics", forward_headers(request), timeout=60.0)
        texts = [(w.url, r.text) for w, r in results if _ok(r)]
        if not texts:
            w, r = results[0] if results else (None, None)
            status = r.status_code if isinstance(r, httpx.Response) else 503
            return error_response("", status, _describe(w, r) if w else "no live worker")
        return PlainTextResponse(merge_metrics(texts), media_type="text/plain; version=0.0.4")

    async def stored_response(request: Request, rid: str):
        """GET / DELETE of a stored response the router has no owner for: every worker is
        asked; the first answer that is not a 404 wins (at most one worker holds it)."""
        results = await proxy.to_all(request.method, sent_path(request),
                                     forward_headers(request), timeout=60.0)
        answers = [r for _, r in results if isinstance(r, httpx.Response)]
        found = next((r for r in answers if r.status_code != 404), None)
        if found is None and not answers:
            return error_response("", 503, "no live worker")
        r = found if found is not None else answers[0]
        if request.method == "DELETE" and r.status_code == 200:
            proxy.owners.forget(rid)
        return Response(r.content, r.status_code, media_type=r.headers.get("content-type"))

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH"])
    async def routed(request: Request, path: str):
        body = await request.body()
        parsed = None
        if body and request.method == "POST":
            try:
                parsed = orjson.loads(body)
            except orjson.JSONDecodeError:
                parsed = None  # the worker answers the 400, in its own words
        path = "/" + path
        target = sent_path(request)
        try:  # the worker's URL is built from it: refuse what cannot be one, not a 500
            httpx.URL(target)
        except httpx.InvalidURL as e:
            return error_response(path, 400, f"invalid request path: {e}")
        rid = stored_response_id(request.method, path, parsed)
        owner = proxy.owners.owner(rid)
        if rid is not None and owner is None and request.method != "POST":
            return await stored_response(request, rid)
        stream = isinstance(parsed, dict) and bool(parsed.get("stream"))
        return await proxy.forward(request, path, body, routing_key(path, parsed), stream,
                                   prefer=owner, target=target)

    return app


def run_router(args: RouterArgs) -> None:
    """`radixlm router` / `python -m radixlm.router`: serve until SIGTERM / Ctrl-C."""
    if args.pd_disaggregation:
        from radixlm.router.pd import run_pd_router

        return run_pd_router(args)
    import uvicorn

    logging.basicConfig(level=args.log_level.upper(),
                        format="[router %(asctime)s] %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per forwarded request
    if not args.worker_urls:
        logger.warning("no --worker-urls: add workers with POST /add_worker?url=...")
    router = Router(args)
    app = build_app(router)
    inner = app.router.lifespan_context

    @asynccontextmanager
    async def lifespan(a):
        await router.add_initial_workers()
        async with inner(a):
            print(f"radixlm router: {router.policy.name} over {len(router.pool.workers)} "
                  f"worker(s) on http://{args.host}:{args.port}", flush=True)
            yield

    app.router.lifespan_context = lifespan
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=args.timeout_graceful_shutdown,
                            timeout_keep_alive=KEEP_ALIVE_S, loop="asyncio")
    server = uvicorn.Server(config)
    server.run()
    if not server.started:
        raise SystemExit(1)
