"""The router's HTTP clients to its workers: many small httpx pools instead of one big one.

Why: httpcore's connection pool walks every pooled connection on each request start and each
response end (state checks and a poll() on every idle socket), so its cost per request grows with
the number of connections, and an HTTP/1.1 proxy holds one connection per request in flight. At
128 requests in flight, py-spy on the router (benchmarks/dp_router.py --spy-dir, 2 x H200,
2026-11-26) had a third of the router's time in `_assign_requests_to_connections` and the
client's latency 1.5 s above the workers' own (encode/httpcore#1035, pydantic/httpx2#1169).

So requests are spread over shards, each an `httpx.AsyncClient` that carries at most
`per_shard` requests at a time: a request takes the least-loaded shard, and a new shard is made
when all are full (up to `max_shards`; past that the least-loaded one takes more). A shard's
pool then scans a handful of connections whatever the router's concurrency.
"""

from __future__ import annotations

from typing import Callable

import httpx


class ClientShards:
    """`acquire()` -> a client to send one request with; `release(client)` once its response has
    ended (streamed or not). All on one event loop: no locks."""

    def __init__(self, make_client: Callable[[], httpx.AsyncClient], per_shard: int = 8,
                 max_shards: int = 128):
        if per_shard < 1 or max_shards < 1:
            raise ValueError("per_shard and max_shards must be >= 1")
        self._make, self.per_shard, self.max_shards = make_client, per_shard, max_shards
        self._shards: list[httpx.AsyncClient] = []
        self._load: dict[int, int] = {}  # id(client) -> requests in flight on it

    def acquire(self) -> httpx.AsyncClient:
        best = min(self._shards, key=lambda c: self._load[id(c)], default=None)
        if best is None or (self._load[id(best)] >= self.per_shard
                            and len(self._shards) < self.max_shards):
            best = self._make()
            self._shards.append(best)
            self._load[id(best)] = 0
        self._load[id(best)] += 1
        return best

    def release(self, client: httpx.AsyncClient) -> None:
        self._load[id(client)] -= 1

    @property
    def num_shards(self) -> int:
        return len(self._shards)

    def in_flight(self) -> int:
        return sum(self._load.values())

    async def aclose(self) -> None:
        for c in self._shards:
            await c.aclose()
        self._shards.clear()
        self._load.clear()
