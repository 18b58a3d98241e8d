"""The Anthropic Messages route, run in-process over a scripted fake TokenizerManager, then
checked with the real `anthropic` SDK against a uvicorn server in a thread."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from types import SimpleNamespace

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from radixlm.runtime.sampling_params import SamplingParams
from radixlm.server.anthropic_api import register_anthropic_routes
from radixlm.server.errors import QueueFullError

VOCAB = 256
EVENT_ORDER = ["message_start", "content_block_start", "ping", "content_block_delta",
               "content_block_stop", "message_delta", "message_stop"]


class CharTokenizer:
    """One token per character: token counts equal text lengths."""

    chat_template = "fake"

    def encode(self, text, add_special_tokens=True):
        return [ord(c) % VOCAB for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


class FakeTM:
    """Test double of TokenizerManager: answers every request with a scripted reply."""

    def __init__(self):
        self.model_name, self.context_len = "fake-model", 200
        self.server_args = SimpleNamespace(model_path="/models/fake-path")
        self.tokenizer = CharTokenizer()
        self.reset()

    def reset(self):
        self.calls, self.templates = [], []
        self.reply, self.cached, self.error, self.abort_after = "Hello, world!", 4, None, None

    def apply_chat_template(self, messages, tools=None):
        self.templates.append(messages)
        return "".join(f"<{m['role']}>{m['content']}\n" for m in messages) + "<assistant>"

    async def generate(self, obj, request=None):
        self.calls.append(obj)
        if self.error is not None:
            raise self.error
        sp = SamplingParams.from_dict(obj.sampling_params)
        sp.verify(VOCAB)
        if len(obj.input_ids) + sp.max_new_tokens > self.context_len:
            raise ValueError("max_new_tokens: prompt plus max_new_tokens exceeds the context length")
        text, finish = self.reply, {"type": "stop", "matched": 0}  # 0 plays EOS
        hits = [(text.find(s), s) for s in sp.stop_strs if s in text]
        if hits:
            cut, s = min(hits)
            text, finish = text[:cut], {"type": "stop", "matched": s}
        if len(text) > sp.max_new_tokens:
            text, finish = text[:sp.max_new_tokens], {"type": "length", "length": sp.max_new_tokens}
        ends = (list(range(4, len(text), 4)) + [len(text)]) if obj.stream else [len(text)]
        for end in ends:
            if self.abort_after is not None and end > self.abort_after:
                end, finish = self.abort_after, {"type": "abort", "message": "aborted by test"}
            meta = {"id": "rid", "prompt_tokens": len(obj.input_ids), "completion_tokens": end,
                    "cached_tokens": self.cached, "e2e_latency": 0.01,
                    "finish_reason": finish if end == len(text) or finish["type"] == "abort" else None}
            yield {"text": text[:end], "output_ids": [], "meta_info": meta}
            if meta["finish_reason"]:
                return
            await asyncio.sleep(0)


@pytest.fixture(scope="module")
def fake():
    return FakeTM()


@pytest.fixture(scope="module")
def app(fake):
    app = FastAPI()
    register_anthropic_routes(app, fake)
    return app


@pytest.fixture
def client(app, fake):
    fake.reset()
    with TestClient(app) as c:
        yield c


def sse_events(resp) -> list[tuple[str, dict]]:
    assert resp.headers["content-type"].startswith("text/event-stream")
    out = []
    for block in resp.text.split("\n\n"):
        if block.strip():
            event_line, data_line = block.split("\n")
            assert event_line.startswith("event: ") and data_line.startswith("data: ")
            event, data = event_line[len("event: "):], json.loads(data_line[len("data: "):])
            assert data["type"] == event  # the event name and the payload's type agree
            out.append((event, data))
    return out


def assert_anthropic_error(resp, status, err_type):
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
    assert body["error"]["type"] == err_type and body["error"]["message"]


MSGS = [{"role": "user", "content": "Hi"}]


def test_message_maps_request_and_shapes_response(client, fake):
    r = client.post("/v1/messages", json={
        "model": "fake-model", "max_tokens": 100, "temperature": 0.3, "top_p": 0.8, "top_k": 7,
        "system": [{"type": "text", "text": "Be"}, {"type": "text", "text": "nice"}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]},
                     {"role": "assistant", "content": "Yo"}, {"role": "user", "content": "Again"}],
        "metadata": {"user_id": "ignored"}})
    assert r.status_code == 200, r.text
    assert fake.templates == [[{"role": "system", "content": "Be\nnice"}, {"role": "user", "content": "Hi"},
                               {"role": "assistant", "content": "Yo"}, {"role": "user", "content": "Again"}]]
    prompt = "<system>Be\nnice\n<user>Hi\n<assistant>Yo\n<user>Again\n<assistant>"
    (obj,) = fake.calls
    assert obj.input_ids == fake.tokenizer.encode(prompt)
    assert obj.sampling_params == {"max_new_tokens": 100, "temperature": 0.3, "top_p": 0.8, "top_k": 7}
    body = r.json()
    assert body["id"].startswith("msg_")
    assert {k: v for k, v in body.items() if k != "id"} == {
        "type": "message", "role": "assistant", "content": [{"type": "text", "text": "Hello, world!"}],
        "model": "fake-model", "stop_reason": "end_turn", "stop_sequence": None,
        # input_tokens excludes what came from the cache, as Anthropic counts it
        "usage": {"input_tokens": len(prompt) - 4, "output_tokens": 13, "cache_read_input_tokens": 4}}


def test_stop_reasons(client, fake):
    r = client.post("/v1/messages", json={"max_tokens": 5, "messages": MSGS}).json()
    assert r["stop_reason"] == "max_tokens" and r["content"][0]["text"] == "Hello"
    r = client.post("/v1/messages", json={"max_tokens": 50, "messages": MSGS, "stop_sequences": ["o, w"]}).json()
    assert fake.calls[-1].sampling_params["stop"] == ["o, w"]
    assert (r["stop_reason"], r["stop_sequence"], r["content"][0]["text"]) == ("stop_sequence", "o, w", "Hell")


def test_final_assistant_message_is_a_prefill(client, fake):
    client.post("/v1/messages", json={"max_tokens": 5, "system": "S", "messages": [
        {"role": "user", "content": "Q"}, {"role": "assistant", "content": "The answer is"}]})
    assert fake.templates == [[{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}]]
    assert fake.tokenizer.decode(fake.calls[0].input_ids) == "<system>S\n<user>Q\n<assistant>The answer is"


def test_stream_event_sequence_and_reassembly(client, fake):
    events = sse_events(client.post("/v1/messages", json={"max_tokens": 50, "messages": MSGS, "stream": True}))
    kinds = [k for k, _ in events]
    assert kinds[:3] == EVENT_ORDER[:3] and kinds[-3:] == EVENT_ORDER[-3:]
    assert set(kinds[3:-3]) == {"content_block_delta"} and len(kinds[3:-3]) == 4
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["role"] == "assistant"
    n_prompt = len("<user>Hi\n<assistant>")
    assert start["usage"] == {"input_tokens": n_prompt - 4, "output_tokens": 0, "cache_read_input_tokens": 4}
    assert events[1][1] == {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
    deltas = [d for k, d in events if k == "content_block_delta"]
    assert all(d["index"] == 0 and d["delta"]["type"] == "text_delta" for d in deltas)
    assert "".join(d["delta"]["text"] for d in deltas) == "Hello, world!"
    message_delta = events[-2][1]
    assert message_delta["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert message_delta["usage"]["output_tokens"] == 13
    assert fake.calls[0].stream


@pytest.mark.parametrize("body,status,err_type", [
    ({"messages": MSGS}, 400, "invalid_request_error"),  # max_tokens is required
    ({"max_tokens": 0, "messages": MSGS}, 400, "invalid_request_error"),
    ({"max_tokens": 5, "messages": []}, 400, "invalid_request_error"),
    ({"max_tokens": 5}, 400, "invalid_request_error"),
    ({"max_tokens": 5, "messages": [{"role": "system", "content": "x"}]}, 400, "invalid_request_error"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "data": ""}}]}]}, 400, "invalid_request_error"),
    ({"max_tokens": 5, "messages": [{"role": "assistant", "content": "x"}]}, 400, "invalid_request_error"),
    ({"max_tokens": 5, "messages": MSGS, "temperature": -0.5}, 400, "invalid_request_error"),
    ({"max_tokens": 5, "messages": MSGS, "temperature": 1.5}, 400, "invalid_request_error"),
    ({"max_tokens": 5, "messages": MSGS, "top_p": 0}, 400, "invalid_request_error"),
    ({"max_tokens": 5, "messages": MSGS, "stop_sequences": [""]}, 400, "invalid_request_error"),
    ({"max_tokens": 5, "messages": MSGS, "model": "claude-nope"}, 404, "not_found_error"),
    ({"max_tokens": 500, "messages": MSGS}, 400, "invalid_request_error"),  # runtime: context overflow
])
@pytest.mark.parametrize("stream", [False, True])
def test_errors_in_anthropic_shape(client, body, status, err_type, stream):
    assert_anthropic_error(client.post("/v1/messages", json={**body, "stream": stream}), status, err_type)


@pytest.mark.parametrize("raw", [b"[]", b'"x"', b"{bad", b""])
def test_non_object_bodies(client, raw):
    resp = client.post("/v1/messages", content=raw, headers={"content-type": "application/json"})
    assert_anthropic_error(resp, 400, "invalid_request_error")


def test_queue_full_and_abort(client, fake):
    fake.error = QueueFullError("queue full")
    assert_anthropic_error(client.post("/v1/messages", json={"max_tokens": 5, "messages": MSGS}), 503,
                           "overloaded_error")
    fake.error, fake.abort_after = None, 6
    assert_anthropic_error(client.post("/v1/messages", json={"max_tokens": 50, "messages": MSGS}), 503,
                           "overloaded_error")
    events = sse_events(client.post("/v1/messages", json={"max_tokens": 50, "messages": MSGS, "stream": True}))
    assert events[-1] == ("error", {"type": "error", "error": {"type": "overloaded_error",
                                                               "message": "aborted by test"}})
    assert "message_stop" not in [k for k, _ in events]


def test_count_tokens(client):
    r = client.post("/v1/messages/count_tokens", json={"model": "fake-model", "messages": MSGS})
    assert r.json() == {"input_tokens": len("<user>Hi\n<assistant>")}


# --- the real anthropic SDK against a live server ---------------------------------------------


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


def test_anthropic_sdk_parses_everything(live_url, fake):
    import anthropic

    fake.reset()
    client = anthropic.Anthropic(base_url=live_url, api_key="x", max_retries=0)
    msg = client.messages.create(model="fake-model", max_tokens=50, system="S", messages=MSGS)
    assert msg.content[0].text == "Hello, world!" and msg.stop_reason == "end_turn"
    assert msg.usage.cache_read_input_tokens == 4 and msg.usage.output_tokens == 13
    with client.messages.stream(model="fake-model", max_tokens=50, messages=MSGS,
                                stop_sequences=["world"]) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == "Hello, " and final.content[0].text == "Hello, "
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", "world")
    assert final.usage.output_tokens == 7
    with client.messages.create(model="fake-model", max_tokens=3, messages=MSGS, stream=True) as s:
        raw = list(s)
    # the SDK swallows pings
    assert [e.type for e in raw] == [k for k in EVENT_ORDER if k != "ping"]
    assert raw[-2].delta.stop_reason == "max_tokens"
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="claude-nope", max_tokens=5, messages=MSGS)
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model="fake-model", max_tokens=5, messages=MSGS,
                                extra_body={"temperature": 3})  # the SDK has no argument for it
    assert e.value.body["error"]["type"] == "invalid_request_error"
    fake.abort_after = 5
    with pytest.raises(anthropic.APIStatusError, match="aborted by test"):
        with client.messages.create(model="fake-model", max_tokens=50, messages=MSGS, stream=True) as s:
            list(s)
    client.close()
