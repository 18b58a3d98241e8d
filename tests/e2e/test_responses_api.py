"""The Responses API (/v1/responses) through the real `openai` SDK against the real server, on a
tiny random Llama with SmolLM2's tokenizer and chat template (tests/tiny_models.py): every check
here is about shapes, routing of state and the cache, not about meaningful text. One server for
the module; outputs are a few tokens each. Where an answer must finish on its own (for
`response.completed`), the output is decoded under a grammar that ends (a boolean field, an enum).
Each test ends with the KV integrity check.
"""

from __future__ import annotations

import json

import openai
import pytest

from server_harness import http, start_server, stop_and_check

ARGS = ["--dtype", "float32", "--max-total-tokens", "8192", "--context-length", "1024",
        "--timeout-graceful-shutdown", "10", "--reasoning-parser", "qwen3"]
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {
               "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
               "required": ["unit"], "additionalProperties": False}}
FLAG_SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
               "additionalProperties": False}
FLAG_FORMAT = {"format": {"type": "json_schema", "name": "flag", "schema": FLAG_SCHEMA,
                          "strict": True}}


@pytest.fixture(scope="module")
def server(tiny_chat_path):
    srv = start_server([*ARGS, "--model-path", tiny_chat_path], name="responses")
    yield srv
    stop_and_check(srv)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                         timeout=120)


def test_create_text_as_a_new_user_would(server, client):
    r = client.responses.create(model="default", input="Say hi", max_output_tokens=16)
    assert r.id.startswith("resp_") and r.object == "response" and r.model
    assert r.status in ("completed", "incomplete")
    [msg] = r.output
    assert msg.type == "message" and msg.role == "assistant"
    assert msg.content[0].type == "output_text" and r.output_text == msg.content[0].text
    u = r.usage
    assert u.output_tokens <= 16 and u.total_tokens == u.input_tokens + u.output_tokens
    if r.status == "incomplete":
        assert r.incomplete_details.reason == "max_output_tokens" and u.output_tokens == 16
    # plain HTTP, instructions, a list of items, SGLang's sampling extras
    body = {"model": "default", "instructions": "Be brief.", "max_output_tokens": 4,
            "input": [{"role": "user", "content": [{"type": "input_text", "text": "Hi"}]}],
            "temperature": 0, "top_k": 5, "reasoning": {"effort": "low"}}
    raw = http.post(server.url + "/v1/responses", json=body, timeout=120)
    assert raw.status_code == 200, raw.text
    assert raw.json()["instructions"] == "Be brief." and raw.headers["x-radixlm-response-id"]
    server.check_integrity()


def test_json_schema_text_format(server, client):
    r = client.responses.create(model="default", input="Is it ok?", text=FLAG_FORMAT,
                                max_output_tokens=32)
    assert r.status == "completed", r
    assert isinstance(json.loads(r.output_text)["ok"], bool)
    assert r.text.format.type == "json_schema" and r.text.format.name == "flag"
    server.check_integrity()


def test_forced_function_call_and_its_output_round_trip(server, client):
    tools = [WEATHER]
    first = client.responses.create(model="default", input="Weather in Paris?", tools=tools,
                                    tool_choice={"type": "function", "name": "get_weather"},
                                    max_output_tokens=32)
    assert first.status == "completed"
    [call] = [o for o in first.output if o.type == "function_call"]
    assert call.name == "get_weather" and call.call_id.startswith("call_")
    assert json.loads(call.arguments)["unit"] in ("celsius", "fahrenheit")
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "18 degrees"}
    # the whole history sent back (the SDK's own output item among the input) ...
    again = client.responses.create(model="default", tools=tools, max_output_tokens=4,
                                    input=[{"role": "user", "content": "Weather in Paris?"},
                                           call, result])
    assert again.status in ("completed", "incomplete") and again.output
    # ... or only the result, continuing the stored response
    cont = client.responses.create(model="default", tools=tools, max_output_tokens=4,
                                   input=[result], previous_response_id=first.id)
    assert cont.previous_response_id == first.id
    assert cont.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens - 1
    server.check_integrity()


def test_stream_events_and_final_response(server, client):
    with client.responses.stream(model="default", input="Stream it",
                                 max_output_tokens=6) as stream:
        events = list(stream)
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done",
                            "response.output_item.done"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final.output_text and final.usage.output_tokens <= 6
    stored = client.responses.retrieve(final.id)
    assert stored.output_text == final.output_text and stored.status == final.status

    # a forced call streams its arguments; the SDK's helper assembles the final response
    # the random tiny model can spend many tokens on the whitespace JSON allows (32 ran out
    # when the module's tests ran in another order; greedy never closes the object)
    with client.responses.stream(model="default", input="Weather?", tools=[WEATHER],
                                 tool_choice="required", max_output_tokens=256) as stream:
        kinds = [e.type for e in stream]
        done = stream.get_final_response()
    assert "response.function_call_arguments.delta" in kinds
    assert kinds[-3:] == ["response.function_call_arguments.done",
                          "response.output_item.done", "response.completed"]
    assert done.output  # (one call or more: parallel calls are allowed)
    for call in done.output:
        assert call.type == "function_call" and json.loads(call.arguments)["unit"]
    server.check_integrity()


def test_previous_response_id_three_turns_reuse_the_cache(server, client):
    """Each turn continues the last: its prompt starts with the last turn's prompt and answer
    token for token, so the radix cache serves all of it (all but the answer's last token,
    whose KV was never computed)."""
    prev, turns = None, []
    for i, text in enumerate(["My name is Ada.", "What is my name?", "Spell it."]):
        r = client.responses.create(model="default", input=text, max_output_tokens=8,
                                    previous_response_id=prev, instructions="Answer briefly.")
        turns.append(r)
        prev = r.id
    cached = [t.usage.input_tokens_details.cached_tokens for t in turns]
    assert cached[0] < cached[1] < cached[2], cached
    for before, after in zip(turns, turns[1:]):
        history = before.usage.input_tokens + before.usage.output_tokens
        assert after.usage.input_tokens > history
        assert after.usage.input_tokens_details.cached_tokens >= history - 1
    assert client.responses.retrieve(prev).previous_response_id == turns[1].id
    server.check_integrity()


def test_retrieve_delete_and_bad_requests(server, client):
    r = client.responses.create(model="default", input="Keep me", max_output_tokens=2)
    assert client.responses.retrieve(r.id).output_text == r.output_text
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    unstored = client.responses.create(model="default", input="Forget me", max_output_tokens=2,
                                       store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    with pytest.raises(openai.NotFoundError, match="previous_response_not_found|not found"):
        client.responses.create(model="default", input="x", previous_response_id="resp_nope")
    bad = [({"input": "x", "max_tokens": 3}, "max_tokens"),
           ({"input": "x", "tools": [{"type": "web_search"}]}, "tools"),
           ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
           ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]},
            "input[0].content[0]"),
           ({"input": "x", "tool_choice": "required"}, "tools"),
           ({"input": "x", "background": True}, "background"),
           ({"input": "x", "conversation": "conv_1"}, "conversation"),
           ({"input": "x", "max_output_tokens": 0}, "max_output_tokens")]
    for body, field in bad:
        resp = server.post("/v1/responses", body)
        assert resp.status_code == 400, (body, resp.text)
        assert field in resp.json()["error"]["message"], (field, resp.text)
    server.check_integrity()
