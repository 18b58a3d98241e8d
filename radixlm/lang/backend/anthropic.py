"""Anthropic: the frontend over the Messages API (api.anthropic.com, or radixlm's own
`/v1/messages`: pass the server's root as `base_url`; the SDK appends `/v1/messages`).

- Chat only. A program becomes messages by the rules in `radixlm.lang.backend.api_common`
  (`chat_messages`): finished turns are messages, text outside roles is a user message,
  gen must be inside an assistant turn unless the program uses no roles at all. System turns go
  to the request's `system` field (several are joined by a blank line), wherever they appear.
- Text before a `gen` inside the same assistant turn is sent as a trailing assistant message: a
  prefill, which the model continues. Anthropic refuses a prefill that ends in whitespace, so
  trailing whitespace is cut from it and whitespace the reply then begins with is dropped (the
  program's text already has it).
- Sampling: `max_tokens`, `stop` -> `stop_sequences`; `temperature`, `top_p` and `top_k` go in the
  request body through `extra_body` (the SDK's `messages.create` has no such keywords) and only when
  they differ from the defaults. Anything else (penalties, min_p, min_tokens, ignore_eos,
  stop_token_ids, regex/json_schema/dtype, logprobs) raises `UnsupportedPrimitive`, as does
  `select` (the API returns no logprobs and takes no constraint).
- The API key defaults to `ANTHROPIC_API_KEY`; with a `base_url` and no key anywhere, a placeholder
  is sent (a local server does not check it).
"""

from __future__ import annotations

from typing import Any, Iterator, Optional

from radixlm.lang.backend.base import BaseBackend, UnsupportedPrimitive
from radixlm.lang.backend.api_common import (chat_messages, extra_name, finish_meta,
                                             resolve_api_key, sampling_extras, stop_list)
from radixlm.lang.chat_template import get_chat_template
from radixlm.lang.choices import ChoicesDecision
from radixlm.lang.ir import SamplingParams

_BODY = (("temperature", "temperature"), ("top_p", "top_p"))
_UNSUPPORTED = ("frequency_penalty", "presence_penalty")


class Anthropic(BaseBackend):
    def __init__(self, model_name: str, base_url: Optional[str] = None,
                 api_key: Optional[str] = None, **client_kwargs):
        import anthropic

        self.model_name = model_name
        self.base_url = base_url
        self.client = anthropic.Anthropic(
            base_url=base_url, api_key=resolve_api_key(api_key, "ANTHROPIC_API_KEY", base_url),
            **client_kwargs)
        self.chat_template = get_chat_template("messages")

    def get_model_name(self) -> str:
        return self.model_name

    def flush_cache(self) -> None:
        raise UnsupportedPrimitive(self, "flush_cache", "the Messages API has no such route "
                                   "(use RuntimeEndpoint for a radixlm server)")

    def get_server_info(self) -> dict:
        raise UnsupportedPrimitive(self, "get_server_info", "the Messages API has no such route "
                                   "(use RuntimeEndpoint for a radixlm server)")

    def select(self, s, choices, temperature, choices_method) -> ChoicesDecision:
        raise UnsupportedPrimitive(self, "select", "the Messages API returns no logprobs and takes "
                                   "no decoding constraint; use the OpenAI backend or "
                                   "RuntimeEndpoint")

    # --- requests ---------------------------------------------------------------------------------
    def request_kwargs(self, params: SamplingParams) -> dict:
        """The SDK keyword arguments for `params` (no model/messages/system/stream)."""
        d = params.resolved()
        for field in _UNSUPPORTED:
            if d[field] != SamplingParams.DEFAULTS[field]:
                raise UnsupportedPrimitive(self, field)
        extras = sampling_extras(params)
        extras.pop("top_k", None)  # the Messages API has top_k
        if extras:
            raise UnsupportedPrimitive(self, extra_name(next(iter(extras)), params))
        if d["return_logprob"]:
            raise UnsupportedPrimitive(self, "return_logprob",
                                       "the Messages API returns no logprobs")
        kw: dict[str, Any] = {"max_tokens": d["max_new_tokens"]}
        stops = stop_list(params)
        if stops:
            kw["stop_sequences"] = stops
        body = {theirs: d[ours] for ours, theirs in _BODY
                if d[ours] != SamplingParams.DEFAULTS[ours]}
        if d["top_k"] is not None and d["top_k"] > 0:
            body["top_k"] = d["top_k"]
        if body:
            kw["extra_body"] = body
        return kw

    def request(self, s, params: SamplingParams) -> tuple[dict, bool]:
        """(SDK kwargs, whether the prefill lost trailing whitespace) for a gen now."""
        messages, partial = chat_messages(s, self)
        system = [m["content"] for m in messages if m["role"] == "system"]
        turns = [{"role": m["role"], "content": m["content"]}
                 for m in messages if m["role"] != "system"]
        cut = False
        if partial.strip():
            prefill = partial.rstrip()
            cut = prefill != partial
            turns.append({"role": "assistant", "content": prefill})
        kw = {"model": self.model_name, "messages": turns, **self.request_kwargs(params)}
        if system:
            kw["system"] = "\n\n".join(system)
        return kw, cut

    @staticmethod
    def _meta(msg_id, stop_reason, stop_sequence, usage) -> dict:
        meta = {"id": msg_id, "finish_reason": finish_meta(stop_reason, stop_sequence),
                "stop_reason": stop_reason}
        if usage is not None:
            cached = getattr(usage, "cache_read_input_tokens", None) or 0
            meta.update(prompt_tokens=(getattr(usage, "input_tokens", None) or 0) + cached,
                        completion_tokens=getattr(usage, "output_tokens", None) or 0,
                        cached_tokens=cached)
        return meta

    def generate(self, s, params: SamplingParams) -> tuple[str, dict]:
        kw, cut = self.request(s, params)
        msg = self.client.messages.create(**kw)
        text = "".join(b.text for b in msg.content if getattr(b, "type", None) == "text")
        if cut:
            text = text.lstrip()
        return text, self._meta(msg.id, msg.stop_reason, msg.stop_sequence, msg.usage)

    def generate_stream(self, s, params: SamplingParams) -> Iterator[tuple[str, Optional[dict]]]:
        """Text deltas as they arrive; the last one carries the meta info."""
        kw, cut = self.request(s, params)
        msg_id, usage, stop_reason, stop_seq = None, None, None, None
        held: Optional[str] = None  # one delta is held back so the last can carry the meta
        stream = self.client.messages.create(stream=True, **kw)
        try:
            for ev in stream:
                if ev.type == "message_start":
                    msg_id, usage = ev.message.id, ev.message.usage
                elif (ev.type == "content_block_delta"
                      and getattr(ev.delta, "type", None) == "text_delta"):
                    text = ev.delta.text
                    if cut:  # drop the whitespace the prefill already ends with
                        text = text.lstrip()
                        cut = not text
                    if text:
                        if held is not None:
                            yield held, None
                        held = text
                elif ev.type == "message_delta":
                    stop_reason, stop_seq = ev.delta.stop_reason, ev.delta.stop_sequence
                    if usage is not None and getattr(ev, "usage", None) is not None:
                        usage.output_tokens = ev.usage.output_tokens
        finally:
            stream.close()
        yield held or "", self._meta(msg_id, stop_reason, stop_seq, usage)

    def shutdown(self) -> None:
        self.client.close()
