"""Stopping: SIGTERM drains running requests; what cannot finish in the grace period gets an error.

The test stops a private server; teardown still checks that nothing is left. A child process
killed mid-request: tests/e2e/test_faults.py.
"""

from __future__ import annotations

import signal
import threading
import time
from typing import Callable, Iterator

import pytest

from server_harness import http, ServerProcess, sse_events, start_server

GRACE_S = 8  # --timeout-graceful-shutdown of the SIGTERM test's server (a core decodes all along)
SHORT_TOKENS = 48  # long enough that the three are still running together on a busy machine
ARGS = ["--max-total-tokens", "8192", "--context-length", "4096"]


@pytest.fixture
def private_server() -> Iterator[Callable[..., ServerProcess]]:
    made: list[ServerProcess] = []

    def make(*extra: str, name: str) -> ServerProcess:
        made.append(start_server(ARGS + list(extra), name=name))
        return made[-1]

    yield make
    for srv in made:
        srv.stop()  # a no-op once the test stopped it; SIGKILLs any leftover of a failed test


def _background(fn) -> tuple[threading.Thread, dict]:
    box: dict = {}

    def run():
        try:
            box["result"] = fn()
        except Exception as e:  # noqa: BLE001 - the test inspects it
            box["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, box


def _wait_running(srv: ServerProcess, n: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while srv.stats()["num_running"] < n:
        assert time.monotonic() < deadline, f"{n} requests never ran: {srv.stats()}"
        time.sleep(0.05)


def _stream(srv: ServerProcess, body: dict) -> list:
    with http.stream("POST", srv.url + "/generate", json={**body, "stream": True},
                     timeout=300) as r:
        assert r.status_code == 200
        return list(sse_events(r))


def test_sigterm_drains_running_requests(private_server):
    srv = private_server("--timeout-graceful-shutdown", str(GRACE_S), name="sigterm")
    short = {"sampling_params": {"max_new_tokens": SHORT_TOKENS, "ignore_eos": True,
                                 "temperature": 0}}
    # requests that cannot finish within the grace period: they bound the shutdown. Running
    # before the short ones are sent: sent after them, on a loaded machine (the whole suite) the
    # short ones once finished before the long ones ran, and five never ran together
    never = {"sampling_params": {"max_new_tokens": 4000, "ignore_eos": True}}
    long_job = _background(lambda: srv.post("/generate", {"text": "Never ending", **never}))
    long_stream = _background(lambda: _stream(srv, {"text": "Never ending stream", **never}))
    _wait_running(srv, 2)
    jobs = [_background(lambda i=i: srv.post("/generate", {"text": f"Drain me {i}", **short}))
            for i in range(2)]
    jobs.append(_background(lambda: _stream(srv, {"text": "Drain my stream", **short})))
    _wait_running(srv, 5)

    t0 = time.monotonic()
    srv.proc.send_signal(signal.SIGTERM)
    for t, _ in jobs:
        t.join(GRACE_S + 30)
    # the short ones all finished, complete, although the server was stopping
    for _, box in jobs[:2]:
        assert "error" not in box, box.get("error")
        r = box["result"]
        assert r.status_code == 200, r.text
        assert r.json()["meta_info"]["completion_tokens"] == SHORT_TOKENS
    _, box = jobs[2]
    assert "error" not in box, box.get("error")
    assert box["result"][-1]["meta_info"]["completion_tokens"] == SHORT_TOKENS
    assert box["result"][-1]["meta_info"]["finish_reason"]["type"] == "length"

    # the server exits within the grace period (plus slack), cutting the long request off
    srv.proc.wait(timeout=GRACE_S + 30)
    elapsed = time.monotonic() - t0
    assert elapsed < GRACE_S + 15, f"the server took {elapsed:.1f}s to stop"
    # SmolLM2 needs minutes for 4000 tokens: both were cut off, and say so (not a lost
    # connection, not a complete-looking answer)
    for t, _ in (long_job, long_stream):
        t.join(30)
        assert not t.is_alive(), "a long request hangs after the server stopped"
    assert "error" not in long_job[1], long_job[1]["error"]
    cut = long_job[1]["result"]
    assert cut.status_code == 503 and "shutting down" in cut.json()["error"]["message"], cut.text
    assert "error" not in long_stream[1], long_stream[1]["error"]
    last = long_stream[1]["result"][-1]
    assert "shutting down" in last["error"]["message"], last
    left = srv.wait_gone(10)
    assert not left, f"processes left behind: {[p.pid for p in left]}\n{srv.log()}"
    srv.stop()
