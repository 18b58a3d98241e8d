"""Server-side SGLang shapes without a model: /generate stream chunks (ChunkShaper), the reasoning
parser (stream == whole text, no tag leaks), and reasoning_content in the chat API over the
OpenAI tests' scripted TokenizerManager."""

from __future__ import annotations

import json
import random

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from test_openai_api import FakeTM

from radixlm.server.native_api import ChunkShaper
from radixlm.server.openai_api import register_openai_routes
from radixlm.server.reasoning import FORMATS, ReasoningParser, get_format


def cumulative_updates(n: int) -> list[dict]:
    outs = []
    for k in range(1, n + 1):
        lps = [(-0.1 * i, i, None) for i in range(k)]
        outs.append({"text": "ab" * k, "output_ids": list(range(k)), "meta_info": {
            "id": "r", "completion_tokens": k, "output_token_logprobs": lps,
            "output_token_logprobs_length": k, "output_top_logprobs": [[x] for x in lps],
            "input_token_logprobs": [(None, 1, None)]}})
    return outs


def test_stream_chunks_are_cumulative_by_default():
    """SGLang's default: every chunk holds everything so far (text, ids, logprob lists), so the
    last chunk is the whole result; SGLang's frontend keeps the latest chunk's meta_info."""
    shape = ChunkShaper()
    updates = cumulative_updates(5)
    chunks = [shape(o) for o in updates]
    assert chunks == updates
    last = chunks[-1]["meta_info"]
    assert len(last["output_token_logprobs"]) == last["output_token_logprobs_length"] == 5


def test_incremental_streaming_output_sends_deltas():
    shape = ChunkShaper(incremental=True)
    chunks = [shape(o) for o in cumulative_updates(4)]
    assert [c["text"] for c in chunks] == ["ab"] * 4
    assert [c["output_ids"] for c in chunks] == [[0], [1], [2], [3]]
    prev = 0
    for k, c in enumerate(chunks, 1):
        m = c["meta_info"]
        assert m["completion_tokens"] == m["output_token_logprobs_length"] == k
        assert len(m["output_token_logprobs"]) == k - prev == len(m["output_top_logprobs"])
        assert m["input_token_logprobs"] == [(None, 1, None)]  # the prompt side stays whole
        prev = k
    joined = [e for c in chunks for e in c["meta_info"]["output_token_logprobs"]]
    assert joined == cumulative_updates(4)[-1]["meta_info"]["output_token_logprobs"]


def test_shaper_survives_a_rollback():
    shape = ChunkShaper(incremental=True)
    outs = cumulative_updates(4)
    shape(outs[3])
    shorter = shape(outs[1])  # a jump-forward re-tokenized: fewer entries than already sent
    assert shorter["meta_info"]["output_token_logprobs"] == []


TEXTS = ["I reason.</think>The answer.", "<think>Step 1\nStep 2</think>\n\nDone", "Plain text",
         "<think>never closed", "</think>only end", "<thi", "", "a</think>b</think>c"]


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_reasoning_stream_equals_whole_text(name):
    fmt = get_format(name)
    rng = random.Random(0)
    for raw in TEXTS:
        text = raw.replace("<think>", fmt.start).replace("</think>", fmt.end)
        whole = ReasoningParser(fmt).parse(text)
        assert fmt.start not in whole[0] + whole[1] or fmt.start not in text
        for stream_reasoning in (True, False):
            for _ in range(20):
                p, r, c, i = ReasoningParser(fmt, stream_reasoning), "", "", 0
                while i < len(text):
                    k = rng.randint(1, 5)
                    a, b = p.feed(text[i:i + k])
                    assert not stream_reasoning or fmt.end not in a  # a tag never leaks
                    r, c, i = r + a, c + b, i + k
                a, b = p.finish()
                assert (r + a, c + b) == whole, (name, text)


def test_reasoning_formats():
    r1, qwen = get_format("deepseek-r1"), get_format("qwen3")
    assert ReasoningParser(r1).parse("thinking</think>answer") == ("thinking", "answer")
    assert ReasoningParser(qwen).parse("thinking</think>answer") == ("", "thinking</think>answer")
    assert ReasoningParser(qwen).parse("<think>t</think>a") == ("t", "a")
    with pytest.raises(ValueError, match="not supported"):
        get_format("nope")


@pytest.fixture()
def reasoning_client():
    fake = FakeTM()
    fake.server_args.reasoning_parser = "qwen3"
    fake.reply = "<think>Let me see.</think>Paris."
    app = FastAPI()
    register_openai_routes(app, fake)
    return TestClient(app), fake


def test_chat_reasoning_content(reasoning_client):
    client, fake = reasoning_client
    msgs = [{"role": "user", "content": "Capital of France?"}]
    body = client.post("/v1/chat/completions", json={"messages": msgs}).json()
    msg = body["choices"][0]["message"]
    assert msg == {"role": "assistant", "content": "Paris.", "reasoning_content": "Let me see."}
    off = client.post("/v1/chat/completions", json={"messages": msgs,
                                                    "separate_reasoning": False}).json()
    assert off["choices"][0]["message"]["content"] == fake.reply
    assert "reasoning_content" not in off["choices"][0]["message"]
    thinking_off = client.post("/v1/chat/completions", json={
        "messages": msgs, "chat_template_kwargs": {"enable_thinking": False}}).json()
    assert thinking_off["choices"][0]["message"]["content"] == fake.reply
    assert fake.template_kwargs == {"enable_thinking": False}  # the template sees them too
    bad = client.post("/v1/chat/completions", json={"messages": msgs,
                                                    "chat_template_kwargs": {"tokenize": True}})
    assert bad.status_code == 400 and "chat_template_kwargs" in bad.text
    # streamed: reasoning_content deltas first, then content, nothing of the tags
    fake.chunk = 2
    with client.stream("POST", "/v1/chat/completions",
                       json={"messages": msgs, "stream": True}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: {")]
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    thought = "".join(d.get("reasoning_content", "") for d in deltas)
    content = "".join(d.get("content") or "" for d in deltas)
    assert thought == "Let me see." and content == "Paris."
    assert "think>" not in thought + content
