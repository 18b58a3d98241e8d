"""End-to-end harness: the real server (`python -m radixlm.launch_server`) as a subprocess.

Each server runs in its own process group on a free port. Teardown sends SIGTERM, waits for the
server to exit, asserts that none of its processes (scheduler, detokenizer, multiprocessing's
resource tracker) outlived it, and then SIGKILLs the whole group anyway so that a failing test
never leaks processes into the rest of the run.

Servers are expensive on a 2-core CPU (~20 s to start), so tests share them:
- `main_server` (session): fp32, metrics and cache report on, a small context and payload
  limit; every test whose settings allow it runs here (acceptance, validation, streaming, disconnects, load).
- `tiny_server` (session): the tiny random chat model, for checks that hold for any model (tool
  calling, most of the SGLang compatibility programs).
- modules with special flags (--api-key, --max-queued-requests) start their own;
- tests that kill or stop the server start a private one.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any, Iterator, Optional

import httpx
import psutil

from radixlm.net import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
START_TIMEOUT_S = 240.0  # generous: CI machines are shared and torch imports are slow there
STOP_TIMEOUT_S = 45.0

# Settings of the shared server. The context is small so that "prompt longer than the context"
# needs only a short prompt; the KV pool is small to keep memory and start-up down.
MAIN_CONTEXT_LEN = 1024
MAIN_MAX_PAYLOAD = 64 * 1024
MAIN_ARGS = ["--dtype", "float32", "--enable-metrics", "--context-length", str(MAIN_CONTEXT_LEN),
             "--max-total-tokens", "24576", "--max-payload-size", str(MAIN_MAX_PAYLOAD),
             "--timeout-graceful-shutdown", "10", "--enable-cache-report"]
# Settings of the shared tiny-model server (tests/conftest.py `tiny_server`; the model path comes
# first): room for the tool-calling batch (150 concurrent forced calls), the cache report for the
# SGLang compatibility programs' cached-token facts.
TINY_ARGS = ["--dtype", "float32", "--context-length", "2048", "--max-total-tokens", "65536",
             "--timeout-graceful-shutdown", "10", "--enable-cache-report"]


# The harness's own requests share one client: httpx.get/post build a new client, and with it a
# TLS context, on every call (~27 ms of CPU, far more than a local request; the harness polls
# /health and the stats). No keep-alive: every request still has its own connection, as before
# (tests count the server's connections).
http = httpx.Client(limits=httpx.Limits(max_connections=None, max_keepalive_connections=0))


def _group_members(pgid: int) -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter():
        try:
            if os.getpgid(p.pid) == pgid and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except (psutil.Error, ProcessLookupError, PermissionError):
            pass
    return out


class ServerProcess:
    """One `radixlm.launch_server` subprocess. `url`, `pid`, `headers` (with the API key)."""

    def __init__(self, args: list[str], api_key: Optional[str] = None, name: str = "server",
                 module: str = "radixlm.launch_server"):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        fd, self.log_path = tempfile.mkstemp(prefix=f"radixlm-e2e-{name}-", suffix=".log")
        os.close(fd)
        cmd = [sys.executable, "-m", module, "--port", str(self.port), *args]
        if api_key:
            cmd += ["--api-key", api_key]
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)  # its own process group
        self.pid = self.proc.pid
        self.pgid = self.pid
        self.known_children: list[psutil.Process] = []
        self.stopped = False

    # --- life cycle -------------------------------------------------------------------------------
    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> "ServerProcess":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited during start-up (code {self.proc.returncode})"
                                   f":\n{self.log()}")
            try:
                if http.get(self.url + "/health", timeout=2).status_code == 200:
                    self.known_children = self.children()
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)  # a poll costs ~0.2 ms of CPU with the shared client
        self.kill()
        raise RuntimeError(f"the server was not ready in {timeout:.0f}s:\n{self.log()}")

    def children(self) -> list[psutil.Process]:
        try:
            return psutil.Process(self.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def log(self) -> str:
        self._log.flush()
        with open(self.log_path, "rb") as f:
            return f.read().decode("utf-8", "replace")[-6000:]

    def alive_processes(self) -> list[psutil.Process]:
        """Every process of this server still running: the main one, the children seen at
        start-up, and anything else in its process group."""
        procs = {p.pid: p for p in _group_members(self.pgid)}
        for p in [*self.known_children]:
            try:
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    procs[p.pid] = p
            except psutil.Error:
                pass
        if self.proc.poll() is None:
            procs[self.pid] = psutil.Process(self.pid)
        return list(procs.values())

    def wait_gone(self, timeout: float) -> list[psutil.Process]:
        """Wait until the server and all its processes are gone; returns the ones left."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.proc.poll()
            left = self.alive_processes()
            if not left:
                return []
            time.sleep(0.1)
        return self.alive_processes()

    def kill(self) -> None:
        """SIGKILL the whole process group (and any child seen at start-up that left it)."""
        try:
            os.killpg(self.pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        for p in self.known_children:
            try:
                p.kill()
            except psutil.Error:
                pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        self._log.close()

    def stop(self) -> list[str]:
        """SIGTERM, wait; always SIGKILL the group at the end. Returns descriptions of the
        processes that were still alive after the graceful stop (empty when all went)."""
        if self.stopped:
            return []
        self.stopped = True
        try:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)
            left = self.wait_gone(STOP_TIMEOUT_S)
            return [f"pid {p.pid}: {' '.join(p.cmdline())[:120]}" for p in left
                    if _safe_running(p)]
        finally:
            self.kill()

    # --- HTTP helpers -----------------------------------------------------------------------------
    def get(self, path: str, **kw) -> httpx.Response:
        kw.setdefault("timeout", 60)
        return http.get(self.url + path, headers={**self.headers, **kw.pop("headers", {})}, **kw)

    def post(self, path: str, body: Any = None, **kw) -> httpx.Response:
        kw.setdefault("timeout", 300)
        if body is not None:
            kw["json"] = body
        return http.post(self.url + path, headers={**self.headers, **kw.pop("headers", {})}, **kw)

    def generate(self, text: str, **sp) -> dict:
        r = self.post("/generate", {"text": text, "sampling_params": sp})
        assert r.status_code == 200, r.text
        return r.json()

    def stats(self) -> dict:
        r = self.get("/get_server_info")
        assert r.status_code == 200, r.text
        return r.json()["internal_states"][0]

    def wait_idle(self, timeout: float = 60.0) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            s = self.stats()
            if s["num_running"] == 0 and s["num_waiting"] == 0:
                return s
            if time.monotonic() > deadline:
                raise AssertionError(f"the server is not idle after {timeout}s: {s}")
            time.sleep(0.1)

    def check_integrity(self, timeout: float = 60.0) -> dict:
        """Wait until no request runs or waits, then the KV accounting check (must pass)."""
        self.wait_idle(timeout)
        r = self.get("/debug/kv_integrity")
        assert r.status_code == 200, f"KV integrity check failed: {r.text}"
        body = r.json()
        assert body["ok"] is True, body
        return body

    def assert_serving(self) -> None:
        """The server is up and still generates."""
        assert http.get(self.url + "/health", timeout=10).status_code == 200
        out = self.generate("Hello", max_new_tokens=2, temperature=0)
        assert out["meta_info"]["completion_tokens"] >= 1


def _safe_running(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def start_server(args: list[str], api_key: Optional[str] = None, name: str = "server",
                 wait: bool = True, module: str = "radixlm.launch_server") -> ServerProcess:
    """`module`: what `python -m` runs (radixlm.router for the standalone router)."""
    for attempt in range(3):
        srv = ServerProcess(args, api_key=api_key, name=name, module=module)
        if not wait:
            return srv
        try:
            return srv.wait_ready()
        except RuntimeError as e:
            srv.kill()
            # another process (a server of the other pytest worker) bound the port between
            # free_port() and the server's bind: a new port, not a failed test
            if "address already in use" not in str(e) or attempt == 2:
                raise
        except BaseException:
            srv.kill()
            raise
    raise AssertionError("unreachable")


def stop_and_check(srv: ServerProcess) -> None:
    """Teardown: stop the server and assert that it left no process behind."""
    left = srv.stop()
    assert not left, f"processes left after the server stopped: {left}\n{srv.log()}"
    os.unlink(srv.log_path)  # kept (and named in messages) only when something went wrong


def sse_events(response: httpx.Response) -> Iterator[Any]:
    """Parse an SSE stream of `data: ...` lines: yields decoded JSON objects, stops at [DONE]."""
    for line in response.iter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        yield json.loads(data)
