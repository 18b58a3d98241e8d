"""LiteLLM: the frontend over any provider the `litellm` package reaches (`litellm.completion`),
with SGLang's constructor: `sgl.LiteLLM(model_name, chat_template=None, api_key=None,
organization=None, base_url=None, timeout=600, max_retries=None, default_headers=None)`.

`litellm` is an optional extra (`pip install 'radixlm[litellm]'`); the constructor says so when
it is missing. The model name is LiteLLM's (`"gpt-4o-mini"`, `"anthropic/claude-..."`, or
`"openai/<name>"` with `base_url` for any OpenAI-compatible server, radixlm's `/v1` included).

- Chat only. A program becomes messages by the rules of `radixlm.lang.backend.api_common`
  (`chat_messages`): finished turns are messages, text outside roles is a user message, and a
  program that uses no roles is sent whole as one user message (SGLang's behaviour). Text before
  a `gen` inside the same assistant turn (a prefill) raises `UnsupportedPrimitive`.
- Sampling: `max_tokens`, `stop`, and `temperature`, `top_p`, `frequency_penalty`,
  `presence_penalty` when they differ from the defaults (SGLang's `to_litellm_kwargs`). Other
  fields (top_k, min_p, min_tokens, regex/json_schema/dtype, ...) raise `UnsupportedPrimitive`
  (SGLang only warns and drops a regex); so do `select` and logprobs.
- Meta info: `finish_reason` (native shape), `prompt_tokens`, `completion_tokens`, `id`, `model`.
"""

from __future__ import annotations

from typing import Any, Iterator, Mapping, Optional, Union

from radixlm.lang.backend.api_common import (STANDARD_PARAMS, chat_messages, extra_name,
                                             finish_meta, sampling_extras, stop_list)
from radixlm.lang.backend.base import BaseBackend, UnsupportedPrimitive
from radixlm.lang.chat_template import ChatTemplate, get_chat_template
from radixlm.lang.choices import ChoicesDecision
from radixlm.lang.ir import SamplingParams


def import_litellm():
    try:
        import litellm
    except ImportError as exc:
        raise ImportError("the LiteLLM backend needs the `litellm` package: pip install litellm "
                          f"(or radixlm[litellm]) ({exc})") from exc
    return litellm


class LiteLLM(BaseBackend):
    is_chat_model = True

    def __init__(self, model_name: str, chat_template: Union[None, str, ChatTemplate] = None,
                 api_key: Optional[str] = None, organization: Optional[str] = None,
                 base_url: Optional[str] = None, timeout: Optional[float] = 600,
                 max_retries: Optional[int] = None,
                 default_headers: Optional[Mapping[str, str]] = None):
        self.litellm = import_litellm()
        self.model_name = model_name
        if isinstance(chat_template, str):
            chat_template = get_chat_template(chat_template)
        self.chat_template = chat_template or get_chat_template("messages")
        params = {"api_key": api_key, "organization": organization, "base_url": base_url,
                  "timeout": timeout, "max_retries": max_retries,
                  "extra_headers": dict(default_headers) if default_headers else None}
        self.client_params = {k: v for k, v in params.items() if v is not None}

    def get_model_name(self) -> str:
        return self.model_name

    def select(self, s, choices, temperature, choices_method) -> ChoicesDecision:
        raise UnsupportedPrimitive(self, "select", "LiteLLM's chat completions return no prompt "
                                   "logprobs and take no decoding constraint; use the OpenAI "
                                   "backend or RuntimeEndpoint")

    def request_kwargs(self, params: SamplingParams) -> dict:
        """litellm.completion's sampling keywords for `params`."""
        d = params.resolved()
        extras = sampling_extras(params)
        if extras:
            raise UnsupportedPrimitive(self, extra_name(next(iter(extras)), params),
                                       "LiteLLM's completion() takes OpenAI's sampling fields "
                                       "only")
        if d["return_logprob"]:
            raise UnsupportedPrimitive(self, "return_logprob")
        kw: dict[str, Any] = {"max_tokens": d["max_new_tokens"]}
        stops = stop_list(params)
        if stops:
            kw["stop"] = stops
        for ours, theirs in STANDARD_PARAMS:
            if d[ours] != SamplingParams.DEFAULTS[ours]:
                kw[theirs] = d[ours]
        return kw

    def _messages(self, s) -> list[dict]:
        messages, partial = chat_messages(s, self)
        if partial.strip():
            raise UnsupportedPrimitive(
                self, "text before gen inside an assistant turn",
                "LiteLLM's chat completions cannot continue a partial assistant message")
        return messages

    def _call(self, s, params: SamplingParams, stream: bool):
        kw = {"model": self.model_name, "messages": self._messages(s),
              **self.client_params, **self.request_kwargs(params)}
        if stream:
            kw.update(stream=True, stream_options={"include_usage": True})
        return self.litellm.completion(**kw)

    @staticmethod
    def _usage(usage) -> dict:
        if usage is None:
            return {}
        return {"prompt_tokens": getattr(usage, "prompt_tokens", None) or 0,
                "completion_tokens": getattr(usage, "completion_tokens", None) or 0}

    def generate(self, s, params: SamplingParams) -> tuple[str, dict]:
        resp = self._call(s, params, stream=False)
        choice = resp.choices[0]
        meta = {"id": getattr(resp, "id", None), "model": getattr(resp, "model", None),
                "finish_reason": finish_meta(choice.finish_reason),
                **self._usage(getattr(resp, "usage", None))}
        return choice.message.content or "", meta

    def generate_stream(self, s, params: SamplingParams) -> Iterator[tuple[str, Optional[dict]]]:
        """Deltas as they arrive; the last one carries the meta info."""
        meta: dict[str, Any] = {"id": None, "model": self.model_name, "finish_reason": None}
        held: Optional[str] = None  # one delta is held back so the last can carry the meta
        for chunk in self._call(s, params, stream=True):
            meta["id"] = getattr(chunk, "id", None) or meta["id"]
            usage = getattr(chunk, "usage", None)
            if usage is not None:
                meta.update(self._usage(usage))
            for choice in chunk.choices or []:
                if choice.finish_reason is not None:
                    meta["finish_reason"] = finish_meta(choice.finish_reason)
                delta = getattr(choice.delta, "content", None) or ""
                if delta:
                    if held is not None:
                        yield held, None
                    held = delta
        yield held or "", meta
