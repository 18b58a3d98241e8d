"""The OpenAI-compatible routes' errors (400/404/503 in OpenAI's shape, aborts, failing
choices), then the real openai SDK and httpx against a uvicorn server in a thread, all over the
scripted fake TokenizerManager (openai_fake.py).
"""

from __future__ import annotations

import socket
import threading
import time

import httpx
import pytest
from fastapi.testclient import TestClient

from openai_fake import MSGS, FakeTM, assert_openai_error, make_app, sse_data
from radixlm.server.errors import QueueFullError


@pytest.fixture(scope="module")
def fake():
    return FakeTM()


@pytest.fixture(scope="module")
def app(fake):
    return make_app(fake)


@pytest.fixture
def client(app, fake):
    fake.reset()
    with TestClient(app) as c:
        yield c


# --- errors -----------------------------------------------------------------------------------


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": ""}, "prompt"),
    ("/v1/completions", {"prompt": []}, "prompt"),
    ("/v1/completions", {"prompt": [[]]}, "prompt"),
    ("/v1/completions", {"prompt": [1.5]}, "prompt"),
    ("/v1/completions", {}, "prompt"),
    ("/v1/completions", {"prompt": "x", "temperature": -0.1}, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, "top_p"),
    ("/v1/completions", {"prompt": "x", "top_p": 1.5}, "top_p"),
    ("/v1/completions", {"prompt": "x", "n": 17}, "n"),
    ("/v1/completions", {"prompt": "x", "n": 0}, "n"),
    ("/v1/completions", {"prompt": "x", "max_tokens": -1}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "stop": [""]}, "stop"),
    ("/v1/completions", {"prompt": "x", "top_k": 0}, "top_k"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"1": 500}}, "logit_bias"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {}, "messages"),
    ("/v1/chat/completions", {"messages": "hi"}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, "messages.0"),
    ("/v1/chat/completions", {"messages": [{"content": "x"}]}, "messages.0.role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]}, "messages.0.content"),
    ("/v1/chat/completions", {"messages": MSGS, "temperature": -1}, "temperature"),
    ("/v1/chat/completions", {"messages": MSGS, "n": 100}, "n"),
    ("/v1/chat/completions", {"messages": MSGS, "top_logprobs": 2}, None),
    ("/v1/chat/completions", {"messages": MSGS, "response_format": {"type": "xml"}}, "response_format.type"),
    ("/v1/chat/completions", {"messages": MSGS, "response_format": {"type": "json_schema"}}, "response_format"),
])
def test_validation_errors_are_400_in_openai_shape(client, fake, path, body, param):
    resp = client.post(path, json=body)
    assert_openai_error(resp, 400, param=param)
    assert fake.calls == [], "nothing reaches the manager"


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("raw", [b"[1, 2]", b'"text"', b"3", b"null", b"{not json", b"", b"\xff\xfe"])
def test_non_object_bodies_are_400(client, path, raw):
    assert_openai_error(client.post(path, content=raw, headers={"content-type": "application/json"}), 400)


@pytest.mark.parametrize("stream", [False, True])
def test_unknown_model_is_404(client, stream):
    for path, body in (("/v1/completions", {"prompt": "x"}), ("/v1/chat/completions", {"messages": MSGS})):
        resp = client.post(path, json={**body, "model": "gpt-9", "stream": stream})
        assert_openai_error(resp, 404, param="model", code="model_not_found")


@pytest.mark.parametrize("stream", [False, True])
def test_manager_errors_before_queueing_map_to_status(client, fake, stream):
    # The runtime's own checks (here SamplingParams.verify and the context bound) give 400s.
    r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 500, "stream": stream})
    assert_openai_error(r, 400)
    assert "context" in r.json()["error"]["message"]
    r = client.post("/v1/completions", json={"prompt": "x", "regex": "a", "json_schema": "{}", "stream": stream})
    assert_openai_error(r, 400)
    fake.error = ValueError("regex: constrained decoding is not supported yet")
    r = client.post("/v1/chat/completions", json={"messages": MSGS, "regex": "a", "stream": stream})
    assert_openai_error(r, 400)
    assert "regex" in r.json()["error"]["message"]
    fake.error = QueueFullError("too many queued requests")
    r = client.post("/v1/completions", json={"prompt": "x", "n": 3, "stream": stream})
    assert_openai_error(r, 503)


def test_one_failing_choice_fails_the_request_at_once(client, fake):
    fake.first_delay, fake.fail_call, fake.error = 30.0, 2, QueueFullError("full")
    t0 = time.time()
    assert_openai_error(client.post("/v1/completions", json={"prompt": "x", "n": 3}), 503)
    assert time.time() - t0 < 5 and fake.closed == 2 and fake.completed == 0


def test_abort_is_an_error_not_a_finish_reason(client, fake):
    fake.abort_after = 4
    assert_openai_error(client.post("/v1/completions", json={"prompt": "x"}), 503)
    events = sse_data(client.post("/v1/chat/completions", json={"messages": MSGS, "stream": True}))
    assert events[-1] == "[DONE]" and events[-2]["error"]["message"] == "aborted by test"
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in events[:-2]) == "Hel"


# --- the real openai SDK against a live server ------------------------------------------------


@pytest.fixture(scope="module")
def live_url(app):
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.time() + 10
    while not server.started and time.time() < deadline:
        time.sleep(0.01)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    server.should_exit = True
    thread.join(timeout=10)


def test_openai_sdk_parses_everything(live_url, fake):
    import openai

    fake.reset()
    client = openai.OpenAI(base_url=live_url + "/v1", api_key="x", max_retries=0)
    assert [m.id for m in client.models.list()] == ["fake-model"]
    c = client.completions.create(model="fake-model", prompt="Hi", max_tokens=5, logprobs=2, echo=True)
    assert c.choices[0].text == "HiHello" and c.choices[0].finish_reason == "length"
    assert c.choices[0].logprobs.tokens == list("HiHello") and c.usage.total_tokens == 7
    chat = client.chat.completions.create(model="fake-model", messages=MSGS, logprobs=True,
                                          top_logprobs=2, n=2)
    assert [ch.message.content for ch in chat.choices] == ["Hello, world!"] * 2
    assert chat.choices[0].logprobs.content[0].top_logprobs[1].logprob == -9999.0
    assert chat.usage.prompt_tokens_details.cached_tokens == 3
    stream = client.chat.completions.create(model="fake-model", messages=MSGS, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == "Hello, world!"
    assert chunks[-1].usage.completion_tokens == 13
    text = "".join(ch.choices[0].text for ch in client.completions.create(
        model="fake-model", prompt="Hi", stream=True, max_tokens=8))
    assert text == "Hello, w"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=MSGS)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="fake-model", messages=MSGS, temperature=-1)
    assert e.value.body["param"] == "temperature"


def test_httpx_streams_incrementally(live_url, fake):
    """Over a real socket the chunks arrive as separate SSE events, not one body at the end."""
    fake.reset()
    with httpx.stream("POST", live_url + "/v1/completions", json={"prompt": "x", "stream": True},
                      timeout=10) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]" and len(lines) == 1 + 5


def test_client_disconnect_closes_every_generation(live_url, fake):
    """A client that leaves mid-stream must not leave generate calls running (the real manager
    aborts the request when its generator is closed or its client is gone)."""
    fake.reset()
    fake.delay, fake.chunk = 0.2, 1  # 13 updates: 2.6 s to finish on its own
    with httpx.stream("POST", live_url + "/v1/chat/completions", timeout=10,
                      json={"messages": MSGS, "stream": True, "n": 3}) as r:
        for line in r.iter_lines():
            if '"content":"H"' in line:
                break
    deadline = time.time() + 1.5
    while fake.closed < 3 and time.time() < deadline:
        time.sleep(0.02)
    assert fake.closed == 3 and fake.completed == 0 and len(fake.calls) == 3
