"""The router's HTTP layer (radixlm/router/app.py, proxy.py, workers.py) against fake workers:
small FastAPI apps (and raw sockets that break connections) served from threads of this process,
so forwarding, SSE passthrough, retries, removal and the admin routes are checked in seconds,
without models. The real servers are in tests/e2e/test_data_parallel.py."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from radixlm.net import free_port
from router_fakes import BrokenWorker, ThreadServer, fake_worker, start_router

# one client for the module: httpx.get/post build a client, TLS context included, per call (~27 ms
# of CPU each); without keep-alive every request still opens its own connection, as they did
http = httpx.Client(limits=httpx.Limits(max_connections=None, max_keepalive_connections=0))


@pytest.fixture
def two_workers():
    apps = [fake_worker("A"), fake_worker("B")]
    servers = [ThreadServer(a) for a in apps]
    yield apps, servers
    for s in servers:
        s.stop()


def test_forwarding_and_cache_aware_stickiness(two_workers):
    apps, servers = two_workers
    front, router = start_router([s.url for s in servers])
    try:
        prefix = "You are a helpful assistant who answers in French. " * 4
        got = {}
        for g in ("alpha", "beta"):
            for q in range(6):
                r = http.post(front.url + "/generate", json={"text": f"{g}: {prefix} Q{q}"})
                assert r.status_code == 200, r.text
                got.setdefault(g, set()).add(r.json()["worker"])
        # each group sticks to one worker, and the two groups went to different workers
        assert all(len(v) == 1 for v in got.values()) and got["alpha"] != got["beta"]
        # a worker's 4xx is the answer: passed through, no retry, worker kept
        r = http.post(front.url + "/bad", json={})
        assert r.status_code == 400 and r.json()["error"]["message"] == "nope"
        listed = http.get(front.url + "/list_workers").json()
        assert sorted(listed["urls"]) == sorted(s.url for s in servers)
        assert sum(w["routed"] for w in listed["workers"]) == 13
        assert all(w["in_flight"] == 0 and w["tree_chars"] > 0 for w in listed["workers"])
        assert listed["decisions"]["cache_hit"] == 10
        info = http.get(front.url + "/get_server_info").json()
        assert info["dp_size"] == 2 and info["load_balance_method"] == "cache_aware"
        assert sorted(s["worker"] for s in info["internal_states"]) == ["A", "B"]
        r = http.post(front.url + "/flush_cache")
        assert r.status_code == 200
        assert all(("/flush_cache", None) in a.state.seen for a in apps)
    finally:
        front.stop()


def test_paths_go_to_the_worker_as_sent_and_errors_are_json(two_workers):
    """Found by fuzzing the router: a %13 in a path, decoded, made the worker URL invalid (a
    500 in plain text); FastAPI's own errors were {"detail"} and the pool's plain text."""
    apps, servers = two_workers
    front, router = start_router([s.url for s in servers])
    try:
        for path in ("/v1/models/%13x%0A", "/v1/models/a%09b", "/v1/models/x%1B"):
            r = http.get(front.url + path)
            assert r.status_code == 404, r.text  # the worker's answer: it has no such route
        r = httpx.delete(front.url + "/v1/responses/%13x")  # asked of every worker
        assert r.status_code == 404, r.text
        for r in (httpx.options(front.url + "/generate"),
                  http.post(front.url + "/remove_worker", params={"url": "http://nowhere"}),
                  http.post(front.url + "/add_worker")):
            assert r.status_code in (400, 404, 405) and r.json()["error"]["message"], r.text
    finally:
        front.stop()


def test_streaming_is_passed_through_unbuffered(two_workers):
    apps, servers = two_workers
    front, router = start_router([s.url for s in servers], policy="round_robin")
    try:
        t0 = time.monotonic()
        arrivals, events = [], []
        with httpx.stream("POST", front.url + "/generate",
                          json={"text": "s", "stream": True, "gap": 0.5}) as r:
            assert r.headers["content-type"].startswith("text/event-stream")
            for line in r.iter_lines():
                if line.startswith("data:"):
                    arrivals.append(time.monotonic() - t0)
                    events.append(line[5:].strip())
        assert events[-1] == "[DONE]" and len(events) == 4
        # the first event left the worker 1 s before the last: it must not wait for it
        assert arrivals[0] < arrivals[-1] - 0.7, arrivals
        assert all(w.in_flight == 0 for w in router.pool.live())
    finally:
        front.stop()


def test_client_disconnect_reaches_the_worker(two_workers):
    apps, servers = two_workers
    front, router = start_router([servers[0].url])
    try:
        with httpx.stream("POST", front.url + "/generate",
                          json={"text": "leaving", "stream": True, "gap": 2.0}) as r:
            next(r.iter_lines())  # the first event, then hang up
        deadline = time.monotonic() + 10
        while "leaving" not in apps[0].state.disconnected:
            assert time.monotonic() < deadline, "the worker never saw the disconnect"
            time.sleep(0.05)
        while router.pool.live()[0].in_flight:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        front.stop()


def test_non_streamed_request_is_dropped_when_its_client_leaves(two_workers):
    apps, servers = two_workers
    front, router = start_router([servers[0].url])
    try:
        t0 = time.monotonic()
        with pytest.raises(httpx.ReadTimeout):
            http.post(front.url + "/generate", json={"text": "slow", "sleep": 5.0}, timeout=0.5)
        w = router.pool.live()[0]
        while w.in_flight:  # the router let go of the upstream request without waiting 5 s
            assert time.monotonic() - t0 < 3.0, "the router kept waiting for a departed client"
            time.sleep(0.05)
    finally:
        front.stop()


def test_refused_worker_is_removed_and_the_request_retried(two_workers):
    apps, servers = two_workers
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    front, router = start_router([dead, servers[0].url], policy="round_robin")
    try:
        for i in range(4):
            r = http.post(front.url + "/generate", json={"text": f"q{i}"})
            assert r.status_code == 200 and r.json()["worker"] == "A"
        listed = http.get(front.url + "/list_workers").json()
        assert listed["urls"] == [servers[0].url]
        assert listed["removed"][0]["url"] == dead
        assert "connection" in listed["removed"][0]["reason"]
    finally:
        front.stop()


def test_worker_dying_mid_request_is_retried_elsewhere(two_workers):
    apps, servers = two_workers
    broken = BrokenWorker()  # accepts, reads, closes: no answer at all
    front, router = start_router([broken.url, servers[1].url], policy="round_robin")
    try:
        for i in range(4):
            r = http.post(front.url + "/generate", json={"text": f"q{i}"})
            assert r.status_code == 200 and r.json()["worker"] == "B", r.text
        assert broken.requests >= 1
        w = router.pool.workers.get(broken.url)
        assert w is None or w.failed >= 1
    finally:
        front.stop()
        broken.close()


@pytest.mark.parametrize("path", ["/generate", "/v1/messages", "/v1/responses"])
def test_broken_stream_ends_with_an_error_event(two_workers, path):
    """In the API's own format: Anthropic's and the Responses SDKs act on `event: error` only."""
    head = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"transfer-encoding: chunked\r\n\r\n")
    chunk = b'data: {"i": 0}\n\n'
    broken = BrokenWorker(head + hex(len(chunk))[2:].encode() + b"\r\n" + chunk + b"\r\n")
    front, router = start_router([broken.url])
    try:
        with httpx.stream("POST", front.url + path, json={"text": "x", "stream": True}) as r:
            assert r.status_code == 200
            lines = [line for line in r.iter_lines() if line]
        events = [json.loads(line[5:]) for line in lines if line.startswith("data:")]
        assert events[0] == {"i": 0}
        if path == "/generate":
            assert "error" in events[-1] and events[-1]["error"]["code"] == 502
        else:
            assert lines[-2] == "event: error" and events[-1]["type"] == "error"
            message = events[-1].get("message") or events[-1]["error"]["message"]
            assert "failed" in message
    finally:
        front.stop()
        broken.close()


def test_unhealthy_worker_removed_after_threshold(two_workers):
    apps, servers = two_workers
    front, router = start_router([s.url for s in servers], interval=0.1,
                                 health_failure_threshold=3)
    try:
        apps[0].state.healthy = False
        deadline = time.monotonic() + 10
        while servers[0].url in router.pool.workers:
            assert time.monotonic() < deadline, "the unhealthy worker was not removed"
            time.sleep(0.05)
        assert [w.url for w in router.pool.live()] == [servers[1].url]
        assert "/health answered 503" in router.pool.removed[0]["reason"]
        # the router stays healthy with one worker; /remove_worker of the last one -> 503
        assert http.get(front.url + "/health").status_code == 200
        r = http.post(front.url + "/remove_worker", params={"url": servers[1].url})
        assert r.status_code == 200 and "Successfully removed" in r.text
        assert http.get(front.url + "/health").status_code == 503
        r = http.post(front.url + "/generate", json={"text": "x"})
        assert r.status_code == 503 and "no live worker" in r.text
        # /add_worker brings a healthy one back
        r = http.post(front.url + "/add_worker", params={"url": servers[1].url})
        assert r.status_code == 200 and "Successfully added" in r.text
        assert http.post(front.url + "/generate", json={"text": "x"}).json()["worker"] == "B"
        r = http.post(front.url + "/add_worker", params={"url": servers[1].url})
        assert r.status_code == 400  # already there
    finally:
        front.stop()


def test_api_key_checked_and_forwarded(two_workers):
    apps, servers = two_workers
    front, router = start_router([servers[0].url], api_key="sekret")
    try:
        assert http.get(front.url + "/health").status_code == 200  # /health is open
        assert http.post(front.url + "/generate", json={"text": "x"}).status_code == 401
        r = http.post(front.url + "/generate", json={"text": "x"},
                      headers={"Authorization": "Bearer sekret"})
        assert r.status_code == 200 and r.json()["auth"] == "Bearer sekret"
        assert http.get(front.url + "/list_workers").status_code == 401
    finally:
        front.stop()


def test_merge_metrics_labels_each_worker_and_groups_families():
    from radixlm.router.app import merge_metrics

    a = ("# HELP reqs Requests.\n# TYPE reqs counter\nreqs_total 3.0\n"
         "# HELP lat Latency.\n# TYPE lat histogram\nlat_bucket{le=\"0.1\"} 1.0\nlat_count 1.0\n")
    b = a.replace("3.0", "5.0")
    out = merge_metrics([("http://a", a), ("http://b", b)]).splitlines()
    assert out == [
        "# HELP reqs Requests.", "# TYPE reqs counter",
        'reqs_total{worker="http://a"} 3.0', 'reqs_total{worker="http://b"} 5.0',
        "# HELP lat Latency.", "# TYPE lat histogram",
        'lat_bucket{worker="http://a",le="0.1"} 1.0', 'lat_count{worker="http://a"} 1.0',
        'lat_bucket{worker="http://b",le="0.1"} 1.0', 'lat_count{worker="http://b"} 1.0']


@pytest.mark.parametrize("policy", ["cache_aware", "round_robin"])
def test_stored_responses_go_to_the_worker_holding_them(two_workers, policy):
    """previous_response_id and GET / DELETE /v1/responses/{id} reach the response's owner,
    whatever the policy would pick (round robin would alternate); conversations with their own
    long instructions still spread by the cache-aware policy. A router that never saw the
    response (restarted) finds it by asking every worker."""
    apps, servers = two_workers
    front, router = start_router([s.url for s in servers], policy=policy)
    try:
        owners = set()
        for conv in range(2):
            rules = f"Conversation {conv}: answer as a pirate would, briefly. " * 6
            r = http.post(front.url + "/v1/responses", json={"instructions": rules, "input": "hi"})
            assert r.status_code == 200, r.text
            first = r.json()
            owners.add(first["worker"])
            prev = first["id"]
            for turn in range(3):
                body = {"instructions": rules, "input": f"turn {turn}",
                        "previous_response_id": prev, "stream": turn == 1}
                r = http.post(front.url + "/v1/responses", json=body)
                assert r.status_code == 200, r.text
                prev = r.headers["x-radixlm-response-id"]
                assert prev.startswith(f"resp_{first['worker']}_")
            r = http.get(front.url + f"/v1/responses/{prev}")
            assert r.status_code == 200 and r.json()["worker"] == first["worker"]
        if policy == "cache_aware":
            assert owners == {"A", "B"}  # the two conversations went to different workers
        fresh, _ = start_router([s.url for s in servers], policy=policy)
        try:
            r = http.get(fresh.url + f"/v1/responses/{prev}")
            assert r.status_code == 200 and r.json()["id"] == prev
            assert httpx.delete(fresh.url + f"/v1/responses/{prev}").status_code == 200
            assert http.get(fresh.url + f"/v1/responses/{prev}").status_code == 404
        finally:
            fresh.stop()
    finally:
        front.stop()
