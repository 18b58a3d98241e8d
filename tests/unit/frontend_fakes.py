"""Shared by the offline frontend backend tests (test_frontend_api_backends_offline.py: OpenAI;
test_frontend_anthropic_offline.py: Anthropic): fake SDK clients that record each call's keyword
arguments and answer with scripted objects, backends wired to them, and two chat programs."""

from __future__ import annotations

from types import SimpleNamespace as NS

import radixlm as sgl
from radixlm.lang.backend.anthropic import Anthropic
from radixlm.lang.backend.openai import OpenAI


class FakeStream(list):
    closed = False

    def close(self):
        self.closed = True


def usage(prompt=10, completion=3, cached=4):
    return NS(prompt_tokens=prompt, completion_tokens=completion,
              prompt_tokens_details=NS(cached_tokens=cached))


class FakeOpenAIClient:
    """`chat.completions.create` / `completions.create`: each call recorded, answered by
    `self.reply(kind, kwargs)` (default: the text "ok" finishing on a stop string)."""

    def __init__(self, reply=None):
        self.calls = []
        self.reply = reply or (lambda kind, kw: "ok")
        self.chat = NS(completions=NS(create=lambda **kw: self._create("chat", kw)))
        self.completions = NS(create=lambda **kw: self._create("completion", kw))

    def close(self):
        pass

    def _create(self, kind, kw):
        self.calls.append((kind, kw))
        out = self.reply(kind, kw)
        if not isinstance(out, str):
            return out
        if kw.get("stream"):
            pieces = [out[:1], out[1:]]
            chunks = [NS(id="c1", usage=None, choices=[NS(
                index=0, finish_reason=None, logprobs=None, model_extra={},
                delta=NS(content=p), text=p)]) for p in pieces]
            chunks.append(NS(id="c1", usage=None, choices=[NS(
                index=0, finish_reason="stop", logprobs=None, model_extra={"matched_stop": "\n"},
                delta=NS(content=None), text="")]))
            chunks.append(NS(id="c1", usage=usage(), choices=[]))
            return FakeStream(chunks)
        choice = NS(index=0, finish_reason="stop", logprobs=None,
                    model_extra={"matched_stop": "\n"}, message=NS(content=out), text=out)
        return NS(id="r1", model="m", choices=[choice], usage=usage())


def openai_backend(chat=True, extras=True, reply=None, **kw):
    b = OpenAI("m", api_key="x", is_chat_model=chat, server_extras=extras, **kw)
    b.client = FakeOpenAIClient(reply)
    return b


class FakeAnthropicClient:
    def __init__(self, reply="ok", stop_reason="end_turn", stop_sequence=None):
        self.calls = []
        self.reply, self.stop_reason, self.stop_sequence = reply, stop_reason, stop_sequence
        self.messages = NS(create=self._create)

    def close(self):
        pass

    def _create(self, **kw):
        self.calls.append(kw)
        u = NS(input_tokens=6, output_tokens=2, cache_read_input_tokens=5)
        if kw.get("stream"):
            evs = [NS(type="message_start", message=NS(id="msg1", usage=u)),
                   NS(type="content_block_start"), NS(type="ping")]
            evs += [NS(type="content_block_delta", delta=NS(type="text_delta", text=t))
                    for t in self.reply]
            evs += [NS(type="content_block_stop"),
                    NS(type="message_delta", usage=NS(output_tokens=len(self.reply)),
                       delta=NS(stop_reason=self.stop_reason, stop_sequence=self.stop_sequence)),
                    NS(type="message_stop")]
            return FakeStream(evs)
        return NS(id="msg1", content=[NS(type="text", text="".join(self.reply))],
                  stop_reason=self.stop_reason, stop_sequence=self.stop_sequence, usage=u)


def anthropic_backend(**kw):
    b = Anthropic("claude-x", api_key="x")
    b.client = FakeAnthropicClient(**kw)
    return b


# --- programs shared by both backends ---------------------------------------------------------

@sgl.function
def two_turns(s):
    s += "Context outside roles. "
    s += sgl.system("Be brief.")
    s += sgl.user("Hi")
    s += sgl.assistant(sgl.gen("a1", max_tokens=5))
    s += "  \n"  # whitespace between turns is dropped
    with s.user():
        s += "Again: " + s["a1"]
    with s.assistant():
        s += sgl.gen("a2", max_tokens=6)


@sgl.function
def prefilled(s):
    s += sgl.user("Capital of France?")
    with s.assistant():
        s += "The capital is "
        s += sgl.gen("a", max_tokens=4)

