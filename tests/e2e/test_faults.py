"""Faults: SIGKILL of a child process while requests run on every route.

The server notices at once (/health 503 or gone), exits non-zero within 5 s with a log line that
names the dead process, leaves no process behind, and every client whose answer was cut off sees
an error in its API's own format, never a complete-looking answer:
- native /generate: streamed, a `data: {"error": ...}` chunk; not streamed, a 503 JSON error;
- OpenAI (completions, chat): the SDK raises (an error chunk in the stream; 503 otherwise);
- Anthropic: the SDK raises (an `event: error`; 503 otherwise);
- Responses: the stream ends with `response.failed` (its error names the cause); 503 otherwise.
The random tiny model (tests/tiny_models.py) starts in seconds and never stops by itself here
(greedy, ignore_eos where the API has it, outputs of thousands of tokens).
DP replica kills are tests/e2e/test_data_parallel.py's; a TP rank's,
tests/e2e/test_tensor_parallel_server.py's.
"""

from __future__ import annotations

import threading
import time

import anthropic
import httpx
import openai
import psutil
import pytest

from server_harness import http, ServerProcess, start_server

LONG = 1900  # tokens: no request ends before the kill (~10 s each, the kill comes after ~1 s)
ARGS = ["--context-length", "2048", "--max-total-tokens", "32768",
        "--timeout-graceful-shutdown", "10", "--served-model-name", "tiny"]
CHAT = [{"role": "user", "content": "Tell me a long story."}]
EXIT_WITHIN_S = 5.0


def _native(srv: ServerProcess, stream: bool):
    body = {"text": "Tell me a long story.", "stream": stream,
            "sampling_params": {"max_new_tokens": LONG, "ignore_eos": True, "temperature": 0}}
    with http.stream("POST", srv.url + "/generate", json=body, timeout=60) as r:
        return r.status_code, [line for line in r.iter_lines() if line]


def _openai(srv: ServerProcess, kind: str, stream: bool):
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=60)
    common = dict(model="tiny", max_tokens=LONG, temperature=0, stream=stream,
                  extra_body={"ignore_eos": True})
    if kind == "chat":
        out = client.chat.completions.create(messages=CHAT, **common)
    else:
        out = client.completions.create(prompt="Once upon a time", **common)
    return list(out) if stream else out


def _anthropic(srv: ServerProcess, stream: bool):
    client = anthropic.Anthropic(base_url=srv.url, api_key="none", max_retries=0, timeout=60)
    common = dict(model="tiny", max_tokens=LONG, messages=CHAT, extra_body={"temperature": 0})
    if stream:
        return list(client.messages.create(stream=True, **common))
    return client.messages.create(**common)


def _responses(srv: ServerProcess, stream: bool):
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=60)
    out = client.responses.create(model="tiny", input="Tell me a long story.", temperature=0,
                                  max_output_tokens=LONG, stream=stream)
    return list(out) if stream else out


CALLS = {f"{name}{'-stream' if stream else ''}": (fn, stream)
         for name, fn in [("generate", _native), ("chat", lambda s, st: _openai(s, "chat", st)),
                          ("completions", lambda s, st: _openai(s, "completions", st)),
                          ("messages", _anthropic), ("responses", _responses)]
         for stream in (True, False)}


def _check_cut(name: str, box: dict, victim: str) -> None:
    """The client of `name` saw an error naming the dead `victim` process."""
    dead = f"the {victim} process died"
    if name.startswith("generate"):  # raw SSE / JSON: nothing raises, the body tells
        status, lines = box["result"]
        if name == "generate-stream":
            assert status == 200
            data = [ln for ln in lines if ln.startswith("data:") and ln != "data: [DONE]"]
            assert '"error"' in data[-1] and dead in data[-1], lines[-3:]
            assert all('"finish_reason":null' in ln for ln in data[:-1]), "a chunk claims an end"
        else:
            assert status == 503 and dead in lines[0], lines
        return
    if name == "responses-stream":  # typed events: the last one is the failure
        events = box["result"]
        assert events[-1].type == "response.failed", [e.type for e in events[-3:]]
        assert dead in events[-1].response.error.message
        assert not any(e.type == "response.completed" for e in events)
        return
    err = box.get("error")
    assert err is not None, f"{name}: no error raised, got {str(box.get('result'))[:300]}"
    assert isinstance(err, (openai.APIError, anthropic.APIError)), repr(err)
    assert dead in str(err), repr(err)
    if not name.endswith("-stream"):
        assert err.status_code == 503, repr(err)


def _child_bound(srv: ServerProcess, socket_name: str) -> psutil.Process:
    """The child process that bound the server's ZMQ socket ipc://.../<socket_name>."""
    for child in psutil.Process(srv.pid).children():
        try:
            socks = [c.laddr for c in child.net_connections(kind="unix")]
        except psutil.Error:
            continue
        if any(isinstance(a, str) and a.endswith("/" + socket_name) for a in socks):
            return child
    raise AssertionError(f"no child process bound the {socket_name} socket")


def _wait_connected(srv: ServerProcess, n: int, timeout: float = 60) -> None:
    """n client connections are open to the server (their requests sent or on their way)."""
    deadline = time.monotonic() + timeout
    while True:
        conns = [c for c in psutil.Process(srv.pid).net_connections(kind="tcp")
                 if c.status == psutil.CONN_ESTABLISHED and c.laddr.port == srv.port]
        if len(conns) >= n:
            return
        assert time.monotonic() < deadline, f"{len(conns)} of {n} clients connected"
        time.sleep(0.05)


def _wait_running(srv: ServerProcess, n: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while srv.stats()["num_running"] < n:
        assert time.monotonic() < deadline, f"{n} requests never ran: {srv.stats()}"
        time.sleep(0.05)


@pytest.mark.parametrize("victim", ["scheduler", "detokenizer"])
def test_child_killed_mid_request(victim, tiny_chat_path):
    srv = start_server([*ARGS, "--model-path", tiny_chat_path], name=f"kill-{victim}")
    try:
        boxes = {name: {} for name in CALLS}

        def run(name):
            fn, stream = CALLS[name]
            try:
                boxes[name]["result"] = fn(srv, stream)
            except Exception as e:  # noqa: BLE001 - checked below
                boxes[name]["error"] = e

        # The scheduler is paused while the requests arrive, so that all of them enter one
        # batch and are mid-generation together at the kill (one at a time, the tiny model
        # finishes a request in ~2 s, before the slowest client has even sent its own).
        scheduler = _child_bound(srv, "scheduler")
        scheduler.suspend()
        threads = [threading.Thread(target=run, args=(n,), daemon=True) for n in CALLS]
        for t in threads:
            t.start()
        _wait_connected(srv, len(CALLS))
        time.sleep(0.3)  # the requests reach the scheduler's queue
        scheduler.resume()
        _wait_running(srv, len(CALLS))
        time.sleep(0.3)  # every stream has sent some chunks
        _child_bound(srv, victim).kill()
        t0 = time.monotonic()

        noticed = None  # /health turns 503, or the server is gone
        while noticed is None and time.monotonic() - t0 < EXIT_WITHIN_S:
            try:
                code = http.get(srv.url + "/health", timeout=1).status_code
                noticed = "503" if code == 503 else None
                assert code in (200, 503), code
            except httpx.TransportError:
                noticed = "gone"
            time.sleep(0.05)
        assert noticed, f"/health still answers 200 {EXIT_WITHIN_S}s after the {victim} died"
        srv.proc.wait(timeout=EXIT_WITHIN_S + 5)
        took = time.monotonic() - t0
        assert took < EXIT_WITHIN_S, f"the server took {took:.1f}s to exit"
        assert srv.proc.returncode != 0
        assert f"ERROR the {victim} process died (exit code -9); shutting down" in srv.log()

        for t in threads:  # no client waits on: each has its answer already
            t.join(10)
        hung = [n for n, t in zip(CALLS, threads) if t.is_alive()]
        assert not hung, f"clients still waiting after the server exited: {hung}"
        for name, box in boxes.items():
            _check_cut(name, box, victim)
        left = srv.wait_gone(10)
        assert not left, f"processes left behind: {[p.pid for p in left]}\n{srv.log()}"
    finally:
        srv.stop()
