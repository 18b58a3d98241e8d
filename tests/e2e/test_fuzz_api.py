"""A short fuzz of the whole HTTP API from the server's own /openapi.json (schemathesis).

Every operation (native, OpenAI, Anthropic, Responses, admin) gets a few valid and a few
schema-breaking requests from a fixed seed: none may answer 5xx, hang, or give an error without
a JSON message; afterwards the server still serves and its KV accounting holds. The long run is
benchmarks/probes/fuzz_api.py (its figures: docs/reliability.md). On the random tiny model with a
256-token context, so that a valid request generates at most 256 fast tokens.
"""

from __future__ import annotations

import json
import os
import sys

import pytest

from server_harness import http, start_server, stop_and_check

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from benchmarks.probes import fuzz_api  # noqa: E402

pytest.importorskip("schemathesis")

EXAMPLES = 3  # per operation and mode (hypothesis drops repeats): ~120 requests, ~7 s
SEED = 20261127
DEADLINE_S = 20.0


@pytest.fixture(scope="module")
def fuzz_server(tiny_chat_path, tmp_path_factory):
    # /start_profile without an output_dir writes to $SGLANG_TORCH_PROFILER_DIR (else the temp
    # folder, where every run of this test left its traces): a folder of this session's
    traces = str(tmp_path_factory.mktemp("fuzz-traces"))
    old = os.environ.get("SGLANG_TORCH_PROFILER_DIR")
    os.environ["SGLANG_TORCH_PROFILER_DIR"] = traces  # the server inherits it
    try:
        srv = start_server(["--model-path", tiny_chat_path, "--context-length", "256",
                            "--max-total-tokens", "8192", "--enable-metrics",
                            "--served-model-name", "tiny"], name="fuzz")
    finally:
        if old is None:
            os.environ.pop("SGLANG_TORCH_PROFILER_DIR")
        else:
            os.environ["SGLANG_TORCH_PROFILER_DIR"] = old
    yield srv
    stop_and_check(srv)


def test_fuzz_every_route(fuzz_server):
    ops = fuzz_api.operations(fuzz_server.url)
    paths = {op.path for op in ops}
    # every API family is in the schema, with its request body
    assert {"/generate", "/v1/chat/completions", "/v1/messages", "/v1/responses",
            "/v1/responses/{response_id}", "/flush_cache", "/abort_request"} <= paths
    assert all(op.body for op in ops if op.path in ("/generate", "/v1/messages"))
    report = fuzz_api.Report()
    caller = fuzz_api.Caller(fuzz_server.url, DEADLINE_S, report, {})
    try:
        caller.prime()
        assert caller.response_ids, "no stored response to chain the routes with"
        fuzz_api.fuzz_round(ops, caller, EXAMPLES, SEED)
    finally:
        caller.close()
    summary = report.summary()
    assert report.requests >= 100, summary
    bad = [f for f in report.findings if f["problem"] in ("5xx", "hang", "no_message")]
    assert not bad, json.dumps(bad[:5], indent=1)
    fuzz_server.assert_serving()
    fuzz_server.check_integrity()


# What the long runs found (each a 500 or an error without a JSON message before its fix)
FOUND = [
    ("POST", "/generate", {"input_ids": True}, 400, "input_ids"),
    ("PUT", "/generate", {"text": 112}, 400, "text"),
    ("POST", "/generate", {"input_ids": None, "text": False}, 400, "text"),
    ("POST", "/generate", {"input_ids": [[1], 2]}, 400, "input_ids"),
    ("POST", "/encode", {"text": [174867911, 291]}, 400, "text"),
    ("POST", "/encode", {"input_ids": True}, 400, "input_ids"),
    ("PUT", "/encode", {"input_ids": {"": None}, "rid": ""}, 400, "input_ids"),
    ("POST", "/encode", {"text": "SM", "rid": {"9": {}}}, 400, "rid"),
    ("POST", "/generate", {"text": "x", "rid": {"a": 1}}, 400, "rid"),
    ("POST", "/v1/chat/completions", {"model": "tiny", "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": 1.5}]}]}, 400, "content"),
    ("POST", "/generate", {"text": "x", "rid": []}, 400, "rid"),
    ("GET", "/v1/models/%0A0", None, 404, "Not Found"),  # no route: FastAPI's {"detail"}
    ("DELETE", "/generate", None, 405, "Method Not Allowed"),
]


@pytest.mark.parametrize("method,path,body,status,message", FOUND)
def test_fuzz_findings_stay_fixed(fuzz_server, method, path, body, status, message):
    
    r = http.request(method, fuzz_server.url + path, json=body, timeout=30)
    assert r.status_code == status, r.text
    assert message in r.json()["error"]["message"], r.text
