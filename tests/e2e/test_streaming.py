"""Streaming under stress: disconnects, many concurrent streams, UTF-8 and stop strings.

On the shared fp32 server. Every streamed chunk is checked against the final text: the
cumulative text only grows (each chunk's text is a prefix of the final text), it never holds
U+FFFD (half a UTF-8 character) and never any part of a stop string that matched.
"""

from __future__ import annotations

import asyncio
import json
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

import anthropic
import httpx
import openai
import pytest

from server_harness import http, sse_events

REPLACEMENT = "\ufffd"


def _stream_native(main_server, body: dict) -> list[dict]:
    with http.stream("POST", main_server.url + "/generate", json={**body, "stream": True},
                     timeout=300) as r:
        assert r.status_code == 200, r.read()
        return list(sse_events(r))


def _check_cumulative(texts: list[str], final: str, truncated: bool = False) -> None:
    """Streamed cumulative texts: each a prefix of the final text, without U+FFFD (half a UTF-8
    character). Only the final text of a request cut off by max_tokens may end in U+FFFD: its
    last token really was half a character (as in the non-streamed text)."""
    core = final.rstrip(REPLACEMENT) if truncated else final
    assert REPLACEMENT not in core, f"half a UTF-8 character inside the text: {final!r}"
    for t in texts:
        assert final.startswith(t), f"streamed text {t!r} is not a prefix of the final {final!r}"
        assert t == final or REPLACEMENT not in t, f"half a UTF-8 character streamed: {t!r}"
    assert texts and texts[-1] == final


# --- client disconnects ---------------------------------------------------------------------------

LONG = 900  # tokens a request would generate if nobody stopped it (~1 minute)
STORY = [{"role": "user", "content": "Tell me a very long story about a lighthouse."}]
DISCONNECT_CASES = {
    "generate-stream": ("/generate", {"text": "Tell me a very long story.", "stream": True,
                                      "sampling_params": {"max_new_tokens": LONG,
                                                          "ignore_eos": True}}),
    "completions-stream": ("/v1/completions", {"prompt": "Once upon a time", "stream": True,
                                               "max_tokens": LONG, "ignore_eos": True}),
    "chat-stream": ("/v1/chat/completions", {"messages": STORY, "stream": True,
                                             "max_tokens": LONG, "ignore_eos": True}),
    "chat-stream-n2": ("/v1/chat/completions", {"messages": STORY, "stream": True, "n": 2,
                                                "max_tokens": LONG, "ignore_eos": True,
                                                "temperature": 0.8}),
    # Anthropic's API has no ignore_eos: greedy, whose story runs past LONG tokens (checked), so
    # the request cannot end by itself before the client leaves (sampled, it sometimes did)
    "messages-stream": ("/v1/messages", {"messages": STORY, "stream": True, "max_tokens": LONG,
                                         "temperature": 0}),
}


def _wait_stopped(main_server, gen0: int, timeout: float = 15.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        s = main_server.stats()
        if s["num_running"] == 0 and s["num_waiting"] == 0:
            return s
        assert time.monotonic() < deadline, (
            f"requests still running {timeout}s after the client left "
            f"({s['generated_tokens'] - gen0} tokens generated): {s}")
        time.sleep(0.1)


@pytest.mark.parametrize("case", list(DISCONNECT_CASES))
def test_disconnect_mid_stream_aborts(main_server, case):
    path, body = DISCONNECT_CASES[case]
    main_server.wait_idle()
    gen0 = main_server.stats()["generated_tokens"]
    with httpx.Client(timeout=120) as client:
        with client.stream("POST", main_server.url + path, json=body) as r:
            assert r.status_code == 200
            n = 0
            for line in r.iter_lines():
                n += line.startswith("data:")
                if n >= 4:
                    break  # leave mid-stream: the connection closes here
    s = _wait_stopped(main_server, gen0)
    assert s["generated_tokens"] - gen0 < LONG // 2, "the request ran on after the client left"
    main_server.check_integrity()


NON_STREAM_CASES = {
    "generate": ("/generate", {"text": "Tell me a very long story.",
                               "sampling_params": {"max_new_tokens": LONG, "ignore_eos": True}}),
    "generate-batch": ("/generate", {"text": ["A long story:", "Another long story:"],
                                     "sampling_params": {"max_new_tokens": LONG,
                                                         "ignore_eos": True}}),
    "chat-n2": ("/v1/chat/completions", {"messages": STORY, "max_tokens": LONG, "n": 2,
                                         "ignore_eos": True, "temperature": 0.8}),
    "messages": ("/v1/messages", {"messages": STORY, "max_tokens": LONG, "temperature": 0}),
}


@pytest.mark.parametrize("case", list(NON_STREAM_CASES))
def test_disconnect_non_streaming_aborts(main_server, case):
    """A client that gives up on a non-streaming request (timeout) also frees its KV."""
    path, body = NON_STREAM_CASES[case]
    main_server.wait_idle()
    gen0 = main_server.stats()["generated_tokens"]
    with pytest.raises(httpx.TimeoutException):
        http.post(main_server.url + path, json=body, timeout=1.5)
    s = _wait_stopped(main_server, gen0)
    assert s["generated_tokens"] - gen0 < LONG // 2, "the request ran on after the client left"
    main_server.check_integrity()


# --- load -----------------------------------------------------------------------------------------

N_CONCURRENT = 256
N_PROMPTS = 16
LOAD_TOKENS = 8
LOAD_PROMPTS = [f"Fact number {i}: the {w} is" for i, w in enumerate(
    ["sun", "moon", "ocean", "forest", "desert", "river", "mountain", "city", "violin", "engine",
     "library", "garden", "planet", "volcano", "bridge", "glacier"])]


async def _one_stream(client: httpx.AsyncClient, url: str, i: int) -> tuple[list[str], dict]:
    """Stream request i; every 4th goes through /v1/completions. Returns (cumulative texts, final
    info with text / finish / completion token count)."""
    prompt = LOAD_PROMPTS[i % N_PROMPTS]
    if i % 4 == 3:
        body = {"prompt": prompt, "max_tokens": LOAD_TOKENS, "temperature": 0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        texts, text, finish, usage = [], "", None, None
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if not line.startswith("data:") or line.endswith("[DONE]"):
                    continue
                chunk = json.loads(line[5:])
                assert "error" not in chunk, chunk
                if chunk.get("usage"):
                    usage = chunk["usage"]
                for c in chunk["choices"]:
                    text += c["text"]
                    finish = c["finish_reason"] or finish
                    texts.append(text)
        return texts, {"text": text, "finish": finish,
                       "tokens": usage and usage["completion_tokens"]}
    body = {"text": prompt, "stream": True, "sampling_params": {
        "max_new_tokens": LOAD_TOKENS, "temperature": 0, "ignore_eos": True}}
    texts, last, done = [], None, False
    async with client.stream("POST", url + "/generate", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data:"):
                last = json.loads(line[5:])
                assert "error" not in last, last
                texts.append(last["text"])
    assert done, "the stream did not end with [DONE]"
    fr = last["meta_info"]["finish_reason"]
    return texts, {"text": last["text"], "finish": fr and fr["type"],
                   "tokens": last["meta_info"]["completion_tokens"]}


async def _run_load(url: str) -> list:
    limits = httpx.Limits(max_connections=N_CONCURRENT + 8, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        return await asyncio.gather(*(_one_stream(client, url, i) for i in range(N_CONCURRENT)))


def test_256_concurrent_streams(main_server):
    # the reference: each prompt's greedy text, non-streamed, one batch
    ref = main_server.post("/generate", {"text": LOAD_PROMPTS, "sampling_params": {
        "max_new_tokens": LOAD_TOKENS, "temperature": 0, "ignore_eos": True}}).json()
    ref_text = [r["text"] for r in ref]
    assert all(r["meta_info"]["completion_tokens"] == LOAD_TOKENS for r in ref)
    main_server.wait_idle()
    before = main_server.stats()

    results = asyncio.run(_run_load(main_server.url))

    assert len(results) == N_CONCURRENT
    wrong = []
    for i, (texts, final) in enumerate(results):
        _check_cumulative(texts, final["text"])
        assert final["finish"] == "length" and final["tokens"] == LOAD_TOKENS, (i, final)
        if final["text"] != ref_text[i % N_PROMPTS]:
            wrong.append((i, final["text"], ref_text[i % N_PROMPTS]))
    assert not wrong, f"{len(wrong)} streams differ from the greedy text, e.g. {wrong[:3]}"
    after = main_server.check_integrity()
    assert after["generated_tokens"] - before["generated_tokens"] >= N_CONCURRENT * LOAD_TOKENS
    assert after["kv_free"] + after["kv_cached"] == after["kv_capacity"]


# --- UTF-8 ----------------------------------------------------------------------------------------

# Prompts after which SmolLM2 writes CJK, kana or emoji: characters of 3-4 UTF-8 bytes that its
# byte-level BPE splits over several tokens (so single tokens are half characters).
RAW_MULTIBYTE = ["Chinese: 你好，我的朋友。今天", "Emoji of the day: 🌟🎉", "日本語の文章：猫と犬"]
CHAT_MULTIBYTE = [
    "Translate to Chinese: Good morning, my friend. How are you today?",
    "Write the Japanese word for cat, dog and bird in hiragana.",
    "List five emoji that show happiness:",
]
UTF8_TOKENS = 24


def _parallel(*calls):
    """Run the calls in threads (the server batches them: much faster than one by one)."""
    with ThreadPoolExecutor(len(calls)) as pool:
        return [f.result() for f in [pool.submit(c) for c in calls]]


def _oai_chat_stream(oai, **kw) -> list[str]:
    texts, text = [], ""
    for chunk in oai.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            text += c.delta.content or ""
            texts.append(text)
    return texts


def _oai_completion_stream(oai, **kw) -> list[str]:
    texts, text = [], ""
    for chunk in oai.completions.create(stream=True, **kw):
        for c in chunk.choices:
            text += c.text
            texts.append(text)
    return texts


def _claude_stream(claude, **kw) -> list[str]:
    texts, text = [], ""
    with claude.messages.stream(**kw) as s:
        for piece in s.text_stream:
            text += piece
            texts.append(text)
    return texts


def _utf8_raw(main_server, oai, prompt: str, sp: dict) -> int:
    """Native stream and OpenAI completion stream vs the non-streamed text; returns how many
    output tokens were half a character."""
    body = {"text": prompt, "sampling_params": {"max_new_tokens": UTF8_TOKENS, **sp}}
    full, events, oai_texts = _parallel(
        lambda: main_server.post("/generate", {**body, "return_logprob": True,
                                               "return_text_in_logprobs": True}).json(),
        lambda: _stream_native(main_server, body),
        lambda: _oai_completion_stream(oai, model="default", prompt=prompt,
                                       max_tokens=UTF8_TOKENS, **sp))
    cut = full["meta_info"]["finish_reason"]["type"] == "length"
    _check_cumulative([e["text"] for e in events], full["text"], truncated=cut)
    assert events[-1]["output_ids"] == full["output_ids"]
    _check_cumulative(oai_texts, full["text"], truncated=cut)
    return sum(REPLACEMENT in t[2] for t in full["meta_info"]["output_token_logprobs"])


def _utf8_chat(oai, claude, prompt: str) -> int:
    """OpenAI chat and Anthropic streams vs the non-streamed chat answer (greedy); returns the
    number of multi-byte characters in it."""
    messages = [{"role": "user", "content": prompt}]
    ref, oai_texts, claude_texts = _parallel(
        lambda: oai.chat.completions.create(model="default", messages=messages,
                                            max_tokens=UTF8_TOKENS, temperature=0),
        lambda: _oai_chat_stream(oai, model="default", messages=messages,
                                 max_tokens=UTF8_TOKENS, temperature=0),
        lambda: _claude_stream(claude, model="default", max_tokens=UTF8_TOKENS,
                               messages=messages, extra_body={"temperature": 0}))
    final = ref.choices[0].message.content
    cut = ref.choices[0].finish_reason == "length"
    _check_cumulative(oai_texts, final, truncated=cut)
    _check_cumulative(claude_texts, final, truncated=cut)
    return sum(len(ch.encode()) > 1 and ch != REPLACEMENT for ch in final)


def test_stream_never_splits_utf8(main_server):
    oai = openai.OpenAI(base_url=main_server.url + "/v1", api_key="unused", max_retries=0,
                        timeout=300)
    claude = anthropic.Anthropic(base_url=main_server.url, api_key="unused", max_retries=0,
                                 timeout=300)
    counts = _parallel(
        *[lambda p=p, sp=sp: _utf8_raw(main_server, oai, p, sp) for p in RAW_MULTIBYTE
          for sp in ({"temperature": 0}, {"temperature": 0.9, "seed": 3})],
        *[lambda p=p: _utf8_chat(oai, claude, p) for p in CHAT_MULTIBYTE])
    half_char_tokens = sum(counts[:2 * len(RAW_MULTIBYTE)])
    chat_multibyte_chars = sum(counts[2 * len(RAW_MULTIBYTE):])
    # the prompts did exercise the case: tokens that are half a character, and such characters
    assert half_char_tokens >= 10 and chat_multibyte_chars >= 4, counts
    main_server.check_integrity()


# --- stop strings ---------------------------------------------------------------------------------

STOP_PROMPTS = ["The history of the printing press", "Ingredients for a simple pancake recipe:"]


def _stop_cases(full: str) -> list[tuple[list[str], Optional[str]]]:
    """Stop lists built from a greedy text, with the stop each should hit (None: none hits)."""
    mid = len(full) // 2
    letter = next(c for c in "etaoinsrh" if c in full[1:])
    first_space = full.index(" ", 1)
    early, late = full[first_space + 1:first_space + 5], full[-6:]
    return [
        # a multi-token stop in the middle of the text, starting mid-word
        ([full[mid:mid + 7]], full[mid:mid + 7]),
        # a one-character stop, inside a token
        ([letter], letter),
        # a near miss: its first characters occur in the text but it never matches entirely;
        # the held-back characters must come out in the end
        ([full[mid:mid + 3] + "\u2603\u2603"], None),
        # several stops: the first to occur wins
        ([late, early], early if full.find(early) < full.find(late) else late),
    ]


def _stop_one_prompt(main_server, oai, prompt: str) -> None:
    sp = {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True}
    full = main_server.post("/generate", {"text": prompt, "sampling_params": sp}).json()["text"]
    assert len(full) > 40
    cases = _stop_cases(full)
    streams = _parallel(
        *[lambda stops=stops: _stream_native(main_server, {
            "text": prompt, "sampling_params": {**sp, "stop": stops}}) for stops, _ in cases],
        *[lambda stops=stops: _oai_completion_stream(
            oai, model="default", prompt=prompt, max_tokens=40, temperature=0, stop=stops,
            extra_body={"ignore_eos": True}) for stops, _ in cases])
    for (stops, hit), events, oai_texts in zip(cases, streams[:len(cases)], streams[len(cases):]):
        expected = full if hit is None else full[:full.index(hit)]
        texts = [e["text"] for e in events]
        _check_cumulative(texts, expected)
        for t in texts:
            assert not any(s in t for s in stops)
        fr = events[-1]["meta_info"]["finish_reason"]
        if hit is None:
            assert fr["type"] == "length", fr
        else:
            assert fr["type"] == "stop" and fr["matched"] == hit, fr
        _check_cumulative(oai_texts, expected)  # the same through the OpenAI SDK's deltas


def test_stream_never_leaks_stop_strings(main_server):
    oai = openai.OpenAI(base_url=main_server.url + "/v1", api_key="unused", max_retries=0,
                        timeout=300)
    _parallel(*[lambda p=p: _stop_one_prompt(main_server, oai, p) for p in STOP_PROMPTS])
    main_server.check_integrity()
