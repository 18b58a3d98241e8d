"""The scripted fake TokenizerManager behind the OpenAI route tests (test_openai_api*.py).

The fake validates sampling params with the real `SamplingParams` (so its ValueErrors are the
runtime's), uses a one-char-per-token tokenizer (so token counts and offsets are easy to check),
and records every GenerateReqInput it receives.
"""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

from fastapi import FastAPI

from radixlm.runtime.sampling_params import SamplingParams
from radixlm.server.openai_api import register_openai_routes

VOCAB = 256


class CharTokenizer:
    """One token per character (code point mod 256): token counts equal text lengths."""

    chat_template = "fake"

    def encode(self, text, add_special_tokens=True):
        return [ord(c) % VOCAB for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


class FakeTM:
    """Test double of TokenizerManager: answers every request with a scripted reply."""

    def __init__(self):
        self.model_name, self.context_len = "fake-model", 200
        self.server_args = SimpleNamespace(model_path="/models/fake-path", served_model_name="fake-model",
                                           enable_cache_report=True)
        self.tokenizer = CharTokenizer()
        self.reset()

    def reset(self):
        self.calls, self.templates = [], []
        self.reply = "Hello, world!"
        self.cached = 3
        self.error = None  # raised before anything is queued, as the real manager does
        self.abort_after = None  # chars after which the request is aborted
        self.chunk = 3  # chars per streamed update
        self.delay = 0.0  # seconds between streamed updates
        self.first_delay = 0.0  # seconds before the first update (a busy queue)
        self.fail_call = None  # index of the call that raises instead of the others
        self.completed = 0  # generators that ran to their end
        self.closed = 0  # generators that ran their cleanup (finished, closed or cancelled)

    def apply_chat_template(self, messages, tools=None, template_kwargs=None):
        self.templates.append((messages, tools))
        self.template_kwargs = template_kwargs
        return "".join(f"<{m['role']}>{m['content']}\n" for m in messages) + "<assistant>"

    async def generate(self, obj, request=None):
        self.calls.append(obj)
        if self.error is not None and self.fail_call in (None, len(self.calls) - 1):
            raise self.error
        sp = SamplingParams.from_dict(obj.sampling_params)
        sp.verify(VOCAB)
        ids = list(obj.input_ids) if obj.input_ids is not None else self.tokenizer.encode(obj.text)
        if len(ids) + sp.max_new_tokens > self.context_len:
            raise ValueError("max_new_tokens: prompt plus max_new_tokens exceeds the context length")
        text, finish = self.reply, {"type": "stop", "matched": 0}  # 0 plays EOS
        hits = [(text.find(s), s) for s in sp.stop_strs if s in text]
        if hits:
            cut, s = min(hits)
            text, finish = text[:cut], {"type": "stop", "matched": s}
        if len(text) > sp.max_new_tokens:
            text, finish = text[:sp.max_new_tokens], {"type": "length", "length": sp.max_new_tokens}
        ends = (list(range(self.chunk, len(text), self.chunk)) + [len(text)]) if obj.stream else [len(text)]
        try:
            await asyncio.sleep(self.first_delay)
            for end in ends:
                if self.abort_after is not None and end > self.abort_after:
                    yield self._out(obj, ids, text[:self.abort_after], {"type": "abort", "message": "aborted by test"})
                    return
                yield self._out(obj, ids, text[:end], finish if end == len(text) else None)
                await asyncio.sleep(self.delay)
            self.completed += 1
        finally:
            self.closed += 1

    def _out(self, obj, ids, text, finish):
        meta = {"id": obj.rid or "rid", "prompt_tokens": len(ids), "completion_tokens": len(text),
                "cached_tokens": min(self.cached, len(ids)), "finish_reason": finish, "e2e_latency": 0.01}
        if obj.return_logprob:
            k = obj.top_logprobs_num

            def tops(c, lp):
                alts = [(lp, ord(c) % VOCAB, c)] + [(-5.0 - j, 97 + j, chr(97 + j)) for j in range(k - 1)]
                if k >= 2:
                    alts[-1] = (float("-inf"), alts[-1][1], alts[-1][2])  # must come out as -9999
                return alts[:k]

            meta["output_token_logprobs"] = [(-0.1 * (i + 1), ord(c) % VOCAB, c) for i, c in enumerate(text)]
            meta["output_top_logprobs"] = [tops(c, -0.1 * (i + 1)) for i, c in enumerate(text)]
            if obj.logprob_start_len == 0:
                chars = [chr(t) for t in ids]
                meta["input_token_logprobs"] = [(None if i == 0 else -1.0, t, chars[i]) for i, t in enumerate(ids)]
                meta["input_top_logprobs"] = [None] + [tops(c, -1.0) for c in chars[1:]]
        return {"text": text, "output_ids": self.tokenizer.encode(text), "meta_info": meta}


def make_app(fake: FakeTM) -> FastAPI:
    app = FastAPI()
    register_openai_routes(app, fake)
    return app


def sse_data(resp) -> list:
    """The `data:` payloads of an SSE body, JSON-decoded except the final [DONE]."""
    assert resp.headers["content-type"].startswith("text/event-stream")
    out = []
    for block in resp.text.split("\n\n"):
        if block.strip():
            assert block.startswith("data: "), block
            payload = block[len("data: "):]
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def assert_openai_error(resp, status, param=None, code=None):
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["type"] == ("invalid_request_error" if status < 500 else "server_error")
    if param is not None:
        assert err["param"] == param
    if code is not None:
        assert err["code"] == code


MSGS = [{"role": "user", "content": "q"}]
