"""The router's pool of workers: their load counters, health checks and removal.

A worker leaves the pool when
  - a connection to it is refused (its server is gone: no point waiting for N more failures),
  - its /health fails `failure_threshold` times in a row (polled every `check_interval` s; a
    timeout or a 5xx counts as a failure), or
  - an admin calls /remove_worker.
Removal only stops new requests from going there; requests already streaming from a live worker
are never touched. A removed worker does not come back by itself (as in sgl-router): /add_worker
puts it back once its /health answers 200.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import httpx

logger = logging.getLogger("radixlm.router")


def normalize_url(url: str) -> str:
    url = url.strip().rstrip("/")
    if "://" not in url:
        url = "http://" + url
    return url


@dataclass(eq=False)
class Worker:
    url: str
    pid: Optional[int] = None  # a replica this process started (--dp-size); None: external
    in_flight: int = 0  # routed here and not yet answered in full
    in_flight_units: int = 0  # prompt characters / ids of those (the minimum_tokens load)
    routed: int = 0  # requests sent here, ever
    failed: int = 0  # requests whose connection to this worker broke
    health_failures: int = 0  # consecutive failed health checks
    added_at: float = field(default_factory=time.time)

    def begin(self, units: int) -> None:
        self.in_flight += 1
        self.in_flight_units += units
        self.routed += 1

    def end(self, units: int) -> None:
        self.in_flight -= 1
        self.in_flight_units -= units

    def info(self) -> dict:
        return {"url": self.url, "pid": self.pid, "in_flight": self.in_flight,
                "routed": self.routed, "failed": self.failed,
                "health_failures": self.health_failures}


class WorkerPool:
    """Workers by URL (in the order added) and the policy that picks among them."""

    def __init__(self, policy, client: httpx.AsyncClient, failure_threshold: int = 3,
                 check_interval: float = 5.0, check_timeout: float = 5.0,
                 on_remove: Optional[Callable[[Worker, str], None]] = None):
        self.policy = policy
        self.client = client
        self.failure_threshold = max(1, failure_threshold)
        self.check_interval = check_interval
        self.check_timeout = check_timeout
        self.on_remove = on_remove
        self.workers: dict[str, Worker] = {}
        self.removed: list[dict] = []  # url, reason, time: what /list_workers reports as gone

    # --- membership -------------------------------------------------------------------------------
    def add(self, url: str, pid: Optional[int] = None) -> Worker:
        url = normalize_url(url)
        w = self.workers.get(url)
        if w is None:
            w = self.workers[url] = Worker(url, pid)
            logger.info("worker added: %s", url)
        return w

    def remove(self, url: str, reason: str) -> bool:
        w = self.workers.pop(normalize_url(url), None)
        if w is None:
            return False
        self.policy.remove(w.url)
        self.removed.append({"url": w.url, "reason": reason, "time": time.time()})
        del self.removed[:-64]
        logger.warning("worker removed: %s (%s); %d left", w.url, reason, len(self.workers))
        if self.on_remove is not None:
            self.on_remove(w, reason)
        return True

    def live(self, exclude=()) -> list[Worker]:
        return [w for w in self.workers.values() if w.url not in exclude]

    def pick(self, key: Optional[str], exclude=(), prefer: Optional[str] = None
             ) -> Optional[Worker]:
        """The policy's choice among live workers not in `exclude`; None when there is none.
        `prefer`: a worker that must serve the request when it is live (it holds what the
        request needs): the policy still sees it chosen (a cache-aware policy records the key)."""
        if prefer is not None and prefer in self.workers and prefer not in exclude:
            return self.policy.select([self.workers[prefer]], key)
        cands = self.live(exclude)
        return self.policy.select(cands, key) if cands else None

    # --- health -----------------------------------------------------------------------------------
    async def probe(self, url: str) -> Optional[str]:
        """None when GET /health answers 200, else why not."""
        try:
            r = await self.client.get(url + "/health", timeout=self.check_timeout)
        except httpx.ConnectError as e:
            return f"connection refused ({e})" if str(e) else "connection refused"
        except httpx.HTTPError as e:
            return f"{type(e).__name__}: {e}"
        return None if r.status_code == 200 else f"/health answered {r.status_code}"

    async def check(self, w: Worker) -> bool:
        """One health check of a pooled worker; removes it when it is gone or failed too often."""
        problem = await self.probe(w.url)
        if w.url not in self.workers:  # removed meanwhile
            return False
        if problem is None:
            w.health_failures = 0
            return True
        w.health_failures += 1
        if problem.startswith("connection refused") or w.health_failures >= self.failure_threshold:
            self.remove(w.url, f"health check failed: {problem}")
        return False

    async def report_failure(self, w: Worker, exc: BaseException) -> None:
        """The proxy lost a connection to `w`: refused -> remove now; else check its health now
        (a worker that died mid-request refuses the probe and goes at once)."""
        w.failed += 1
        if w.url not in self.workers:
            return
        if isinstance(exc, httpx.ConnectError):
            self.remove(w.url, f"connection failed: {exc or type(exc).__name__}")
        else:
            await self.check(w)

    async def wait_healthy(self, url: str, timeout: float) -> Optional[str]:
        """Poll /health until 200 (None) or `timeout` seconds passed (the last problem)."""
        deadline = time.monotonic() + timeout
        while True:
            problem = await self.probe(normalize_url(url))
            if problem is None or time.monotonic() >= deadline:
                return problem
            await asyncio.sleep(min(0.5, max(0.0, deadline - time.monotonic())))

    async def health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.check_interval)
            workers = list(self.workers.values())
            if workers:
                await asyncio.gather(*(self.check(w) for w in workers))
