"""Acceptance, operational endpoints against the real server: health and server info, cache
flush, abort, Prometheus metrics, native `n`. The SDK and generation paths are in
test_acceptance.py.

All tests share the session's fp32 server (`main_server`; `model_name` is its served name, both
from conftest.py); every test that generates ends with the KV integrity check once the server is
idle.
"""

from __future__ import annotations

import threading
import time
import uuid

import httpx
from prometheus_client.parser import text_string_to_metric_families

from server_harness import http, MAIN_CONTEXT_LEN, sse_events

# --- operational endpoints ------------------------------------------------------------------------


def test_health_and_info(main_server, model_name):
    assert main_server.get("/health").status_code == 200
    before = main_server.stats()["generated_tokens"]
    assert main_server.get("/health_generate").status_code == 200
    assert main_server.stats()["generated_tokens"] > before  # it really generated

    info = main_server.get("/get_model_info").json()
    assert info["is_generation"] is True
    assert info["context_length"] == MAIN_CONTEXT_LEN
    assert info["model_path"].endswith(".gguf") and info["served_model_name"] == model_name

    server = main_server.get("/get_server_info").json()
    assert "api_key" not in server
    assert server["port"] == main_server.port and server["dtype"] == "float32"
    assert server["enable_metrics"] is True
    st = server["internal_states"][0]
    assert {"num_running", "num_waiting", "kv_capacity", "kv_free", "kv_cached"} <= set(st)
    # the serve loop's own costs (server/loop_stats.py): it has served requests by now
    assert st["gc_pauses"] >= 0 and st["gc_pause_s_max"] >= 0 and st["loop_turn_s_max"] > 0
    assert set(st["loop_turns_over_s"]) == {"0.01", "0.02", "0.05", "0.1"}
    assert server["max_total_num_tokens"] == st["kv_capacity"]
    main_server.check_integrity()


def _stream_in_background(main_server, body: dict, path: str = "/generate"):
    """Start a streaming request in a thread; returns (thread, events list, started event)."""
    events: list = []
    started = threading.Event()

    def run():
        try:
            with http.stream("POST", main_server.url + path, json=body, timeout=300) as r:
                for e in sse_events(r):
                    events.append(e)
                    started.set()
        except httpx.HTTPError as e:  # recorded for the test to look at
            events.append(e)
        finally:
            started.set()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, events, started


def test_flush_cache(main_server):
    main_server.generate("Flush me: " + "cached words " * 20, max_new_tokens=4, temperature=0)
    main_server.wait_idle()
    assert main_server.stats()["kv_cached"] > 0
    r = main_server.post("/flush_cache")
    assert r.status_code == 200, r.text
    st = main_server.check_integrity()
    assert st["kv_cached"] == 0 and st["kv_free"] == st["kv_capacity"]

    # refused (not half-done) while a request runs; the request is unaffected
    rid = uuid.uuid4().hex
    t, events, started = _stream_in_background(main_server, {
        "rid": rid, "text": "Count to one hundred:", "stream": True,
        "sampling_params": {"max_new_tokens": 400, "ignore_eos": True, "temperature": 0}})
    assert started.wait(60)
    r = main_server.post("/flush_cache")
    assert r.status_code == 400 and "running" in r.text
    main_server.post("/abort_request", {"rid": rid})
    t.join(60)
    assert not t.is_alive()
    assert events[-1]["meta_info"]["finish_reason"]["type"] == "abort"
    main_server.check_integrity()


def test_abort_request(main_server):
    rid = "abort-" + uuid.uuid4().hex
    result: dict = {}

    def run():
        result["r"] = main_server.post("/generate", {
            "rid": rid, "text": "Write a very long essay about rivers.",
            "sampling_params": {"max_new_tokens": 900, "ignore_eos": True}})

    t = threading.Thread(target=run, daemon=True)
    t.start()
    deadline = time.monotonic() + 60
    while main_server.stats()["num_running"] == 0:
        assert time.monotonic() < deadline, "the request never started"
        time.sleep(0.05)
    t0 = time.monotonic()
    assert main_server.post("/abort_request", {"rid": rid}).status_code == 200
    t.join(30)
    assert not t.is_alive() and time.monotonic() - t0 < 15
    out = result["r"].json()
    assert out["meta_info"]["id"] == rid
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert out["meta_info"]["completion_tokens"] < 900

    # aborting an unknown rid is harmless; a body without a rid is a 400
    assert main_server.post("/abort_request", {"rid": "no-such-request"}).status_code == 200
    assert main_server.post("/abort_request", {"id": 3}).status_code == 400
    main_server.check_integrity()
    main_server.assert_serving()


def _scrape(main_server) -> dict[str, float]:
    """Every sample by name; each must carry SGLang's label set (model_name, the served name)."""
    r = main_server.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    served = main_server.get("/get_model_info").json()["served_model_name"]
    values = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            if not s.name.startswith("sglang:"):
                continue
            labels = dict(s.labels)
            assert labels.pop("model_name", None) == served, s
            if not labels or labels == {"le": "+Inf"}:
                values[s.name] = s.value
    return values


def test_metrics(main_server):
    """SGLang's names (what SGLang dashboards read) for what both servers measure."""
    before = _scrape(main_server)
    for name in ("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage",
                 "sglang:cache_hit_rate", "sglang:num_requests_total",
                 "sglang:prompt_tokens_total", "sglang:generation_tokens_total",
                 "sglang:time_to_first_token_seconds_count",
                 "sglang:inter_token_latency_seconds_count",
                 "sglang:e2e_request_latency_seconds_count",
                 "sglang:e2e_request_latency_seconds_bucket", "sglang:spec_accept_length"):
        assert name in before, f"{name} missing from /metrics"

    out = main_server.post("/generate", {"text": "Metrics move when", "stream": True,
                                         "sampling_params": {"max_new_tokens": 8,
                                                             "ignore_eos": True}})
    assert out.status_code == 200
    after = _scrape(main_server)
    d = {k: after[k] - before.get(k, 0) for k in after}
    assert d["sglang:num_requests_total"] >= 1
    assert d["sglang:generation_tokens_total"] >= 8
    assert d["sglang:prompt_tokens_total"] >= 3
    assert d["sglang:time_to_first_token_seconds_count"] >= 1
    assert d["sglang:inter_token_latency_seconds_count"] >= 1
    assert d["sglang:e2e_request_latency_seconds_count"] >= 1
    assert d["sglang:e2e_request_latency_seconds_sum"] > 0
    assert after["sglang:e2e_request_latency_seconds_bucket"] == \
        after["sglang:e2e_request_latency_seconds_count"]  # +Inf bucket holds every request
    assert 0 <= after["sglang:token_usage"] <= 1 and 0 <= after["sglang:cache_hit_rate"] <= 1
    main_server.check_integrity()


def test_generate_native_n(main_server):
    sp = {"max_new_tokens": 4, "temperature": 0, "n": 2}
    r = main_server.post("/generate", {"text": ["Hello", "Goodbye"], "sampling_params": sp})
    assert r.status_code == 200, r.text
    out = r.json()
    assert len(out) == 4  # prompt-major: both samples of "Hello", then both of "Goodbye"
    assert out[0]["text"] == out[1]["text"] and out[2]["text"] == out[3]["text"]
    one = main_server.post("/generate", {"text": "Hello", "sampling_params": sp})
    assert one.status_code == 200, one.text
    assert [o["text"] for o in one.json()] == [out[0]["text"]] * 2
