"""The soak benchmark's clients (benchmarks/soak.py): a weighted mix of request kinds, each
answer counted as ok, 4xx (the bad requests' expected answer), 5xx (a status >= 500 or an error
event in a stream: the server failed a request), unexpected, or error:<exception>."""

from __future__ import annotations

import asyncio
import json
import random
from collections import defaultdict

import httpx

KINDS = {"stream_chat": 20, "tool_call": 8, "json_schema": 8, "n_gt_1": 8, "long": 8,
         "short": 20, "abort": 5, "disconnect": 5, "bad": 18}
WORDS = ("apple river stone cloud lamp train forest number garden window music paper "
         "orange mountain silver ocean pencil bridge candle winter").split()
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
BAD_BODIES = [  # (path, body): each must be refused with a 4xx
    ("/generate", {"text": "hi", "sampling_params": {"temperature": -1}}),
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 10 ** 7}}),
    ("/generate", {"input_ids": [1, -5]}),
    ("/v1/chat/completions", {"model": "default", "messages": "not a list"}),
    ("/v1/chat/completions", {"model": "default", "messages": [{"role": "user", "content": "x"}],
                              "response_format": {"type": "json_schema", "json_schema": {
                                  "name": "s", "schema": {"type": "nonsense"}}}}),
    ("/v1/completions", {"model": "default", "prompt": "x", "n": 0}),
    ("/generate", {"text": "x", "sampling_params": {"regex": "(unclosed"}}),
]


def words(rnd: random.Random, n: int) -> str:
    return " ".join(rnd.choice(WORDS) for _ in range(n))


def _chat(text: str, **kw) -> dict:
    return {"model": "default", "messages": [
        {"role": "system", "content": "You are a terse assistant."},  # shared: cache hits
        {"role": "user", "content": text}], **kw}


class Traffic:
    """Clients sending the mix; counts answers per kind (ok, 4xx, 5xx, error, unexpected)."""

    def __init__(self, base: str, seed: int):
        self.base = base
        self.rnd = random.Random(seed)
        self.counts: dict = defaultdict(lambda: defaultdict(int))
        self.n = 0

    async def worker(self, client: httpx.AsyncClient, stop: asyncio.Event) -> None:
        kinds, weights = list(KINDS), list(KINDS.values())
        while not stop.is_set():
            kind = self.rnd.choices(kinds, weights)[0]
            self.n += 1
            try:
                outcome = await getattr(self, kind)(client, self.rnd, f"soak-{self.n}")
            except (httpx.HTTPError, asyncio.TimeoutError) as e:
                outcome = "error:" + type(e).__name__
            self.counts[kind][outcome] += 1

    @staticmethod
    def _status(r: httpx.Response, want_4xx: bool = False) -> str:
        if r.status_code >= 500:
            return "5xx"
        if want_4xx:
            return "4xx" if 400 <= r.status_code < 500 else "unexpected"
        return "ok" if r.status_code == 200 else "unexpected"

    async def _stream(self, client, path: str, body: dict, stop_after: int = 0) -> str:
        """Read an SSE stream to its end (or drop it after `stop_after` events); an error
        event is a 5xx (the server failed the request)."""
        async with client.stream("POST", self.base + path, json=body) as r:
            if r.status_code != 200:
                await r.aread()
                return self._status(r)
            events = 0
            async for line in r.aiter_lines():
                if not line.startswith("data:") or line.strip() == "data: [DONE]":
                    continue
                data = json.loads(line[5:])
                if isinstance(data, dict) and "error" in data:
                    return "5xx"
                events += 1
                if stop_after and events >= stop_after:
                    return "ok"  # leaving the block closes the connection: a disconnect
        return "ok"

    async def stream_chat(self, client, rnd, rid):
        return await self._stream(client, "/v1/chat/completions", _chat(
            "Tell me about " + words(rnd, rnd.randint(3, 30)), stream=True,
            max_tokens=rnd.randint(8, 48), temperature=0.7))

    async def tool_call(self, client, rnd, rid):
        r = await client.post(self.base + "/v1/chat/completions", json=_chat(
            "What is the weather in " + rnd.choice(WORDS) + "?", tools=TOOLS,
            tool_choice="required", max_tokens=48))
        return self._status(r)

    async def json_schema(self, client, rnd, rid):
        r = await client.post(self.base + "/v1/chat/completions", json=_chat(
            "Invent a person called " + rnd.choice(WORDS), max_tokens=48, response_format={
                "type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}))
        return self._status(r)

    async def n_gt_1(self, client, rnd, rid):
        r = await client.post(self.base + "/v1/completions", json={
            "model": "default", "prompt": words(rnd, 12), "n": rnd.randint(2, 4),
            "max_tokens": 16, "temperature": 0.9})
        return self._status(r)

    async def long(self, client, rnd, rid):
        r = await client.post(self.base + "/generate", json={
            "text": words(rnd, rnd.randint(600, 1200)),
            "sampling_params": {"max_new_tokens": 16, "temperature": 0}})
        return self._status(r)

    async def short(self, client, rnd, rid):
        r = await client.post(self.base + "/generate", json={
            "text": "Q: " + words(rnd, 5) + "?\nA:",
            "sampling_params": {"max_new_tokens": rnd.randint(4, 32), "temperature": 0}})
        return self._status(r)

    async def abort(self, client, rnd, rid):
        async def cancel():
            await asyncio.sleep(rnd.uniform(0.05, 1.0))
            await client.post(self.base + "/abort_request", json={"rid": rid})
        task = asyncio.create_task(cancel())
        body = {"text": words(rnd, 20), "rid": rid, "stream": True,
                "sampling_params": {"max_new_tokens": 64, "ignore_eos": True}}
        try:  # a plain abort is a finish reason, not an error event: ok either way
            return await self._stream(client, "/generate", body)
        finally:
            await task

    async def disconnect(self, client, rnd, rid):
        return await self._stream(client, "/v1/chat/completions", _chat(
            words(rnd, 10), stream=True, max_tokens=64), stop_after=rnd.randint(1, 3))

    async def bad(self, client, rnd, rid):
        path, body = rnd.choice(BAD_BODIES)
        return self._status(await client.post(self.base + path, json=body), want_4xx=True)
