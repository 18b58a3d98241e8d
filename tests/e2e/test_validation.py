"""Bad input gets a 4xx with a message, before anything is queued; the server keeps serving.

Runs on the shared server (context length MAIN_CONTEXT_LEN, body limit MAIN_MAX_PAYLOAD).
"""

from __future__ import annotations

import json
import time

import pytest

from server_harness import http, MAIN_CONTEXT_LEN, MAIN_MAX_PAYLOAD

LONG_TEXT = "word " * (MAIN_CONTEXT_LEN + 200)  # more tokens than the context holds
USER = [{"role": "user", "content": "Hi"}]

# (case id, path, JSON body or raw bytes, allowed statuses)
CASES = [
    # a body that is not a JSON object
    ("generate-array", "/generate", [1, 2], {400}),
    ("generate-string", "/generate", "hello", {400}),
    ("generate-bad-json", "/generate", b"{not json", {400}),
    ("generate-empty-body", "/generate", b"", {400}),
    ("completions-array", "/v1/completions", [], {400}),
    ("chat-number", "/v1/chat/completions", 42, {400}),
    ("messages-null", "/v1/messages", None, {400}),
    ("chat-bad-json", "/v1/chat/completions", b'{"messages": [', {400}),
    # empty prompt
    ("generate-empty-text", "/generate", {"text": ""}, {400}),
    ("generate-empty-ids", "/generate", {"input_ids": []}, {400}),
    ("generate-no-prompt", "/generate", {"sampling_params": {}}, {400}),
    ("completions-empty", "/v1/completions", {"prompt": ""}, {400}),
    ("completions-empty-ids", "/v1/completions", {"prompt": []}, {400}),
    ("chat-no-messages", "/v1/chat/completions", {"messages": []}, {400}),
    ("messages-no-messages", "/v1/messages", {"messages": [], "max_tokens": 4}, {400}),
    # unknown model name
    ("completions-model", "/v1/completions", {"model": "gpt-nope", "prompt": "Hi"}, {404}),
    ("chat-model", "/v1/chat/completions", {"model": "gpt-nope", "messages": USER}, {404}),
    ("messages-model", "/v1/messages", {"model": "claude-nope", "messages": USER,
                                        "max_tokens": 4}, {404}),
    # temperature < 0
    ("generate-temperature", "/generate", {"text": "Hi", "sampling_params": {"temperature": -0.5}},
     {400}),
    ("completions-temperature", "/v1/completions", {"prompt": "Hi", "temperature": -1}, {400}),
    ("chat-temperature", "/v1/chat/completions", {"messages": USER, "temperature": -0.1}, {400}),
    ("messages-temperature", "/v1/messages", {"messages": USER, "max_tokens": 4,
                                              "temperature": -1}, {400}),
    # top_p outside (0, 1]
    ("generate-top-p-0", "/generate", {"text": "Hi", "sampling_params": {"top_p": 0}}, {400}),
    ("generate-top-p-big", "/generate", {"text": "Hi", "sampling_params": {"top_p": 1.5}}, {400}),
    ("completions-top-p", "/v1/completions", {"prompt": "Hi", "top_p": 0}, {400}),
    ("chat-top-p", "/v1/chat/completions", {"messages": USER, "top_p": 1.01}, {400}),
    ("messages-top-p", "/v1/messages", {"messages": USER, "max_tokens": 4, "top_p": 0}, {400}),
    # n above the bound
    ("completions-n", "/v1/completions", {"prompt": "Hi", "n": 17}, {400}),
    ("chat-n", "/v1/chat/completions", {"messages": USER, "n": 1000}, {400}),
    ("generate-n-zero", "/generate", {"text": "Hi", "sampling_params": {"n": 0}}, {400}),
    # max_tokens that overflows the context
    ("generate-max-new", "/generate", {"text": "Hi", "sampling_params":
                                       {"max_new_tokens": MAIN_CONTEXT_LEN}}, {400}),
    ("completions-max-tokens", "/v1/completions", {"prompt": "Hi", "max_tokens": 10**6}, {400}),
    ("chat-max-tokens", "/v1/chat/completions", {"messages": USER, "max_tokens": MAIN_CONTEXT_LEN},
     {400}),
    ("messages-max-tokens", "/v1/messages", {"messages": USER, "max_tokens": 10**6}, {400}),
    # a prompt longer than the context
    ("generate-long-text", "/generate", {"text": LONG_TEXT, "sampling_params":
                                         {"max_new_tokens": 1}}, {400}),
    ("generate-long-ids", "/generate", {"input_ids": [42] * MAIN_CONTEXT_LEN,
                                        "sampling_params": {"max_new_tokens": 1}}, {400}),
    ("completions-long", "/v1/completions", {"prompt": LONG_TEXT, "max_tokens": 1}, {400}),
    ("chat-long", "/v1/chat/completions", {"messages": [{"role": "user", "content": LONG_TEXT}],
                                           "max_tokens": 1}, {400}),
    ("messages-long", "/v1/messages", {"messages": [{"role": "user", "content": LONG_TEXT}],
                                       "max_tokens": 1}, {400}),
    ("generate-long-stream", "/generate", {"text": LONG_TEXT, "stream": True}, {400}),
    ("chat-long-stream", "/v1/chat/completions", {"messages": [{"role": "user",
                                                                "content": LONG_TEXT}],
                                                  "max_tokens": 1, "stream": True}, {400}),
    # invalid constraints (issue 5): a 400 naming the problem, before anything is queued
    ("generate-bad-regex", "/generate", {"text": "Hi", "sampling_params": {"regex": "[0-9"}}, {400}),
    ("generate-bad-schema", "/generate", {"text": "Hi", "sampling_params":
                                          {"json_schema": '{"type": "objectx"}'}}, {400}),
    ("generate-two-constraints", "/generate", {"text": "Hi", "sampling_params":
                                               {"regex": "a", "json_schema": "{}"}}, {400}),
    ("completions-bad-regex", "/v1/completions", {"prompt": "Hi", "regex": "(a|b"}, {400}),
    ("completions-bad-schema", "/v1/completions", {"prompt": "Hi", "json_schema": "{not json"},
     {400}),
    ("chat-bad-schema", "/v1/chat/completions", {"messages": USER, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
     {400}),
    # an oversized body (Content-Length above --max-payload-size)
    ("generate-oversized", "/generate", {"text": "x" * (MAIN_MAX_PAYLOAD + 10)}, {413}),
    ("chat-oversized", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x" * (MAIN_MAX_PAYLOAD + 10)}]}, {413}),
]


def _message_of(body: dict) -> str:
    err = body.get("error")
    assert isinstance(err, dict), body
    return err.get("message", "")


@pytest.mark.parametrize("path,body,statuses", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_request_is_4xx(main_server, path, body, statuses):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = http.post(main_server.url + path, content=content, timeout=60,
                  headers={"content-type": "application/json"})
    assert r.status_code in statuses, f"{r.status_code}: {r.text[:300]}"
    msg = _message_of(r.json())
    assert isinstance(msg, str) and len(msg) > 5, r.text
    main_server.assert_serving()


def test_oversized_chunked_body_is_413(main_server):
    """A body sent without Content-Length (chunked) is held to the same limit: the server must
    not read (and tokenize) an unbounded body. The request here would be valid if it were small."""
    body = json.dumps({"text": "Hi", "sampling_params": {"max_new_tokens": 1},
                       "lora_path": "x" * (MAIN_MAX_PAYLOAD * 2)}).encode()

    def chunks():
        for i in range(0, len(body), 8192):
            yield body[i:i + 8192]

    r = http.post(main_server.url + "/generate", content=chunks(), timeout=60)
    assert r.status_code == 413, f"{r.status_code}: {r.text[:300]}"
    main_server.assert_serving()


def test_no_request_was_queued(main_server):
    """None of the bad requests above reached the scheduler or left anything behind."""
    main_server.check_integrity()


def test_huge_native_n_is_refused_at_once(main_server):
    t0 = time.monotonic()
    r = main_server.post("/generate", {"text": ["Hi"], "sampling_params":
                                       {"max_new_tokens": 1, "n": 20_000}})
    assert 400 <= r.status_code < 500
    assert time.monotonic() - t0 < 1.0, f"took {time.monotonic() - t0:.1f}s to refuse"
