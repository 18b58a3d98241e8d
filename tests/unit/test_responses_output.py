"""The Responses API's objects and events without a model: a response with reasoning (what a
--reasoning-parser server returns for a `<think>` model; the e2e tests' random model never
writes the tag) validated by the openai SDK's own pydantic types, strictly, event by event;
the store's bound; `reasoning` refused without a parser."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from radixlm.runtime.config import ServerArgs
from radixlm.server.errors import APIError
from radixlm.server.reasoning import ReasoningParser, get_format
from radixlm.server.responses_api import ResponseRun, _reasoning_setup
from radixlm.server.responses_prompt import Prompt
from radixlm.server.responses_protocol import parse_request
from radixlm.server.responses_store import ResponseStore, StoredResponse


def _tm(**args):
    tok = SimpleNamespace(encode=lambda text, add_special_tokens=False: list(range(len(text))))
    return SimpleNamespace(server_args=ServerArgs(**args), tokenizer=tok, model_name="m")


def _update(text: str, finish=None) -> dict:
    meta = {"finish_reason": finish, "prompt_tokens": 7, "completion_tokens": 5,
            "cached_tokens": 3}
    return {"text": text, "output_ids": [11, 12, 13, 14, 2], "meta_info": meta}


def test_reasoning_and_answer_items_parse_as_the_sdk_types():
    req = parse_request({"model": "m", "input": "Why?", "reasoning": {"effort": "low"},
                         "stream": True})
    prompt = Prompt([1, 2, 3], 10, b"d", "ctx", [{"role": "user", "content": "Why?"}], False)
    run = ResponseRun(_tm(reasoning_parser="qwen3"), req, None,
                      ReasoningParser(get_format("qwen3")), prompt)
    run.out.event("response.created", response=run.response("in_progress"))
    for text in ("<thi", "<think>because", "<think>because</think>Ans"):
        run.feed(_update(text))
    run.feed(_update("<think>because</think>Answer.", {"type": "stop", "matched": 2}))
    store = ResponseStore(1)
    obj = run.finish(store)
    run.out.event("response.completed", response=obj)

    parsed = Response.model_validate(obj, strict=False)
    assert [o.type for o in parsed.output] == ["reasoning", "message"]
    assert parsed.output[0].content[0].text == "because" and parsed.output_text == "Answer."
    assert parsed.usage.input_tokens_details.cached_tokens == 3
    assert parsed.usage.output_tokens_details.reasoning_tokens == len("because")
    adapter = TypeAdapter(ResponseStreamEvent)
    events = [json.loads(e.split("data: ", 1)[1]) for e in run.out.take_events()]
    kinds = [adapter.validate_python(e).type for e in events]
    assert kinds == ["response.created", "response.output_item.added",
                     "response.content_part.added", "response.reasoning_text.delta",
                     "response.reasoning_text.done", "response.content_part.done",
                     "response.output_item.done", "response.output_item.added",
                     "response.content_part.added", "response.output_text.delta",
                     "response.output_text.delta", "response.output_text.done",
                     "response.content_part.done", "response.output_item.done",
                     "response.completed"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    # stored: the answer without its reasoning, and no token reuse (the ids hold the reasoning)
    item = store.get(obj["id"])
    assert item.messages[-1] == {"role": "assistant", "content": "Answer."}
    assert item.splice is None


def test_plain_answer_keeps_its_ids_without_the_stop_token():
    req = parse_request({"input": "Hi"})
    prompt = Prompt([1, 2, 3], 10, b"d", "ctx", [{"role": "user", "content": "Hi"}], False)
    run = ResponseRun(_tm(), req, None, None, prompt)
    run.feed(_update("Hello", {"type": "stop", "matched": 2}))
    store = ResponseStore(2)
    obj = run.finish(store)
    assert obj["status"] == "completed" and obj["output"][0]["content"][0]["text"] == "Hello"
    assert list(store.get(obj["id"]).splice.token_ids) == [1, 2, 3, 11, 12, 13, 14]


def test_store_bound_and_reasoning_needs_a_parser():
    store = ResponseStore(2)
    for rid in ("a", "b", "c"):
        store.put(rid, StoredResponse({"id": rid}, [], None))
    assert store.get("a") is None and len(store) == 2
    assert not ResponseStore(0).put("x", StoredResponse({}, [], None))
    with pytest.raises(APIError, match="reasoning.*--reasoning-parser"):
        _reasoning_setup(_tm(), parse_request({"input": "x", "reasoning": {"effort": "low"}}))
    parser, kwargs = _reasoning_setup(_tm(reasoning_parser="qwen3"), parse_request(
        {"input": "x", "reasoning": {"effort": "none"}}))
    assert parser is None and kwargs == {"enable_thinking": False}
