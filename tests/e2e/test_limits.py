"""--api-key and --max-queued-requests, on one server started with both.

The server runs at most 2 requests and queues at most 2 more: a 5th request in flight is refused
with 503 at once, while the 4 admitted ones finish normally.
"""

from __future__ import annotations

import threading
import time
from typing import Iterator

import anthropic
import openai
import pytest

from server_harness import http, ServerProcess, start_server, stop_and_check

API_KEY = "sk-e2e-" + "5ecret" * 4
MAX_RUNNING, MAX_QUEUED = 2, 2
# long enough that no admitted request finishes between the last arrival and the refusals: at 40
# a busy full-suite run once saw the first pair done by then, and the 5th request was admitted
QUEUE_TOKENS = 160


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    srv = start_server(["--max-running-requests", str(MAX_RUNNING),
                        "--max-queued-requests", str(MAX_QUEUED),
                        "--max-total-tokens", "8192", "--context-length", "2048"],
                       api_key=API_KEY, name="limits")
    yield srv
    stop_and_check(srv)


# --- API key --------------------------------------------------------------------------------------

ENDPOINTS = [
    ("GET", "/health_generate", None),
    ("GET", "/get_model_info", None),
    ("GET", "/get_server_info", None),
    ("GET", "/metrics", None),
    ("GET", "/debug/kv_integrity", None),
    ("GET", "/v1/models", None),
    ("GET", "/v1/models/default", None),
    ("POST", "/generate", {"text": "Hi", "sampling_params": {"max_new_tokens": 1}}),
    ("POST", "/flush_cache", None),
    ("POST", "/abort_request", {"rid": "x"}),
    ("POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 1}),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                      "max_tokens": 1}),
    ("POST", "/v1/messages", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}),
    ("POST", "/v1/messages/count_tokens", {"messages": [{"role": "user", "content": "Hi"}]}),
    ("GET", "/no/such/path", None),  # no probing for routes without the key either
]


@pytest.mark.parametrize("method,path,body", ENDPOINTS, ids=[e[1] for e in ENDPOINTS])
def test_api_key_required(server, method, path, body):
    url = server.url + path
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY},
                    {"x-api-key": "wrong"}, {"Authorization": "Basic " + API_KEY}):
        r = http.request(method, url, json=body, headers=headers, timeout=60)
        assert r.status_code == 401, f"{headers}: {r.status_code} {r.text[:200]}"
        assert API_KEY not in r.text
    # with the key the endpoint answers (anything but 401; /metrics is off here: 404)
    r = http.request(method, url, json=body, headers={"Authorization": f"Bearer {API_KEY}"},
                     timeout=120)
    assert r.status_code != 401, r.text
    if path not in ("/metrics", "/no/such/path"):
        assert r.status_code == 200, r.text


def test_health_needs_no_key(server):
    assert http.get(server.url + "/health", timeout=10).status_code == 200


def test_server_info_hides_the_key(server):
    r = server.get("/get_server_info")
    assert r.status_code == 200
    assert API_KEY not in r.text and "api_key" not in r.json()
    assert API_KEY not in server.get("/get_model_info").text


def test_sdks_with_and_without_the_key(server):
    good = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)
    r = good.completions.create(model="default", prompt="Hi", max_tokens=2)
    assert r.choices[0].text is not None
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model="default", prompt="Hi", max_tokens=2)

    # the Anthropic SDK sends the key as x-api-key
    m = anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0).messages.create(
        model="default", max_tokens=2, messages=[{"role": "user", "content": "Hi"}])
    assert m.usage.output_tokens >= 1
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0).messages.create(
            model="default", max_tokens=2, messages=[{"role": "user", "content": "Hi"}])
    server.check_integrity()


# --- --max-queued-requests ------------------------------------------------------------------------


def test_queue_limit_refuses_at_once_and_queued_finish(server):
    server.wait_idle()
    results: list = [None] * (MAX_RUNNING + MAX_QUEUED)

    def run(i):
        results[i] = server.post("/generate", {
            "text": f"Queued request {i}: write a list of words.",
            "sampling_params": {"max_new_tokens": QUEUE_TOKENS, "ignore_eos": True,
                                "temperature": 0}})

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(results))]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while True:  # all admitted requests have reached the scheduler
        s = server.stats()
        if s["num_running"] + s["num_waiting"] == len(results):
            break
        assert time.monotonic() < deadline, f"the requests never all arrived: {s}"
        time.sleep(0.02)
    assert s["num_running"] <= MAX_RUNNING

    # beyond the limit: 503 at once, on every API, while the others still run
    t0 = time.monotonic()
    r = server.post("/generate", {"text": "One too many", "sampling_params": {"max_new_tokens": 2}})
    assert r.status_code == 503, r.text
    assert "error" in r.json()
    oai = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)
    with pytest.raises(openai.APIStatusError) as e:
        oai.chat.completions.create(model="default", max_tokens=2,
                                    messages=[{"role": "user", "content": "One too many"}])
    assert e.value.status_code == 503
    claude = anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0)
    with pytest.raises(anthropic.APIStatusError) as e:
        claude.messages.create(model="default", max_tokens=2,
                               messages=[{"role": "user", "content": "One too many"}])
    assert e.value.status_code == 503
    assert time.monotonic() - t0 < 5, "the refusals were not immediate"
    assert server.stats()["num_running"] + server.stats()["num_waiting"] > 0, \
        "the test was too slow: the admitted requests had finished before the refusals"

    # the admitted ones all finish, complete
    for t in threads:
        t.join(180)
        assert not t.is_alive()
    for r in results:
        assert r.status_code == 200, r.text
        meta = r.json()["meta_info"]
        assert meta["finish_reason"]["type"] == "length"
        assert meta["completion_tokens"] == QUEUE_TOKENS
    server.check_integrity()
    server.assert_serving()  # and there is room again
