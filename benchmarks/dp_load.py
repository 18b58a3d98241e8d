"""The client side of benchmarks/dp_router.py: a closed-loop load of token-id requests against one
URL (a server or a router), sampling the servers' scheduler state while it runs, and the cache
flush / warm-up between configurations. probes/dp_profile.py drives one server with it too.
"""

from __future__ import annotations

import asyncio
import json
import random
import ssl
import time

import httpx


async def _watch(client, urls: list[str], stop: asyncio.Event, every_s: float = 0.25) -> dict:
    """Sample each server's scheduler state (/get_server_info) while the load runs: mean running
    and waiting requests, mean KV use (in use or cached), forward steps and retractions taken."""
    acc = {u: {"samples": 0, "running": 0.0, "waiting": 0.0, "kv_used": 0.0} for u in urls}
    first: dict = {}
    last: dict = {}
    while True:
        for u in urls:
            try:
                st = (await client.get(u + "/get_server_info", timeout=10)).json()
                st = st["internal_states"][0]
            except (httpx.HTTPError, KeyError, ValueError):
                continue
            st["_t"] = time.perf_counter()
            a = acc[u]
            a["samples"] += 1
            a["running"] += st.get("num_running", 0)
            a["waiting"] += st.get("num_waiting", 0)
            a["kv_used"] += 1 - st.get("kv_free", 0) / max(1, st.get("kv_capacity", 1))
            first.setdefault(u, st)
            last[u] = st
        if stop.is_set():
            break
        try:
            await asyncio.wait_for(stop.wait(), every_s)
        except asyncio.TimeoutError:
            pass
    out = []
    for u in urls:
        a, n = acc[u], max(1, acc[u]["samples"])
        f, la = first.get(u, {}), last.get(u, {})
        delta = lambda k: la.get(k, 0) - f.get(k, 0)
        out.append({"mean_running": round(a["running"] / n, 1),
                    "mean_waiting": round(a["waiting"] / n, 1),
                    "mean_kv_used": round(a["kv_used"] / n, 3),
                    "forward_steps": delta("forward_steps"),
                    "extend_steps": delta("extend_steps"),
                    # time inside the scheduler's step() over the sampled span: ~1 = saturated
                    "busy_frac": round(delta("busy_s") / max(1e-9, la.get("_t", 0)
                                                             - f.get("_t", 0)), 3),
                    "retractions": delta("retractions")})
    return {"servers": out}


async def run_load(url: str, prompts: list[list[int]], args,
                   watch: tuple[str, ...] = ()) -> dict:
    """Closed loop of `max_concurrency` clients through `url`; `watch`: servers to sample."""
    sp = {"max_new_tokens": args.output_len, "temperature": 0, "ignore_eos": True}
    totals = {"prompt_tokens": 0, "cached_tokens": 0, "output_tokens": 0, "failed": 0}
    latencies: list[float] = []
    server_lat: list[float] = []  # the serving worker's own e2e_latency (its HTTP front onward)
    errors: list[str] = []
    # bodies encoded before the clock starts: the client's own work stays out of the timing
    bodies = [json.dumps({"input_ids": p, "sampling_params": sp}).encode() for p in prompts]
    headers = {"content-type": "application/json"}
    todo = iter(bodies)
    # One one-connection client per concurrency slot: a single httpx pool of 128 connections
    # costs its owner more CPU per request than the server spends (httpcore scans every
    # connection per request; py-spy, 2 x H200, 2026-11-26). Made before the clock starts, with
    # one shared TLS context (httpx builds a new one per client otherwise: ~22 ms each).
    tls = ssl.create_default_context()
    clients = [httpx.AsyncClient(timeout=3600, limits=httpx.Limits(max_connections=1),
                                 verify=tls)
               for _ in range(min(args.max_concurrency, len(bodies)))]

    async def slot(c: httpx.AsyncClient):
        """One closed-loop client: the next request as soon as its previous one is answered."""
        async with c:
            for body in todo:
                t = time.perf_counter()
                try:
                    r = await c.post(url + "/generate", content=body, headers=headers)
                except httpx.HTTPError as e:  # counted and reported, not fatal to the run
                    totals["failed"] += 1
                    errors.append(f"{type(e).__name__}: {e}")
                    continue
                latencies.append(time.perf_counter() - t)
                if r.status_code != 200:
                    totals["failed"] += 1
                    errors.append(f"HTTP {r.status_code}: {r.text[:200]}")
                    continue
                meta = r.json()["meta_info"]
                totals["prompt_tokens"] += meta["prompt_tokens"]
                totals["cached_tokens"] += meta.get("cached_tokens", 0)
                totals["output_tokens"] += meta["completion_tokens"]
                server_lat.append(meta.get("e2e_latency", 0.0))

    async with httpx.AsyncClient(timeout=60, verify=tls) as watch_client:
        stop = asyncio.Event()
        watcher = asyncio.create_task(_watch(watch_client, list(watch), stop)) if watch else None
        t0 = time.perf_counter()
        await asyncio.gather(*(slot(c) for c in clients))
        wall = time.perf_counter() - t0
        stop.set()
        watched = await watcher if watcher else {}
    n = len(prompts) - totals["failed"]
    lat = sorted(latencies) or [0.0]
    res = {"requests": n, "failed": totals["failed"], "wall_s": round(wall, 3),
           "req_s": round(n / wall, 3), "out_tok_s": round(totals["output_tokens"] / wall, 1),
           "prompt_tok_s": round(totals["prompt_tokens"] / wall, 1),
           "cache_hit_rate": round(totals["cached_tokens"] / max(1, totals["prompt_tokens"]), 4),
           "latency_p50_s": round(lat[len(lat) // 2], 3),
           "latency_p90_s": round(lat[int(len(lat) * 0.9)], 3),
           # client latency minus the worker's e2e_latency: time in the client and the router
           "latency_mean_s": round(sum(latencies) / max(1, len(latencies)), 3),
           "server_e2e_mean_s": round(sum(server_lat) / max(1, len(server_lat)), 3), **watched}
    if errors:
        res["errors"] = sorted(set(errors))[:5]
    return res


def flush(urls: list[str]) -> None:
    """Empty each worker's radix cache (waits until its requests are done)."""
    for u in urls:
        deadline = time.monotonic() + 120
        while httpx.post(u + "/flush_cache", timeout=60).status_code != 200:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{u}: /flush_cache kept failing")
            time.sleep(0.5)


def warm_up(urls: list[str], args, vocab: int) -> None:
    """A few requests of the benchmark's shapes on each server (first-use costs), then flush."""
    rng = random.Random(12345)
    prompts = [[rng.randrange(3, vocab) for _ in range(args.prefix_len + args.question_len)]
               for _ in range(min(8, args.max_concurrency))]
    for u in urls:
        asyncio.run(run_load(u, prompts, args))
    flush(urls)
