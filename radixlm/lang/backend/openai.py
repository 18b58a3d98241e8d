"""OpenAI: the frontend over any OpenAI-compatible server (api.openai.com, radixlm's or SGLang's
`/v1`, ...) through the `openai` SDK.

Chat or completion model
    `is_chat_model=None` guesses from the name: OpenAI's legacy completion models
    (`gpt-3.5-turbo-instruct`, `davinci-002`, `babbage-002`, older `*davinci*`/`*babbage*`/
    `*curie*`/`ada`) are completion models, everything else is a chat model. Pass
    `is_chat_model=False` for a base model served by another server. A completion model gets the
    program's text (`s.text_`, roles rendered with the model's chat template); a chat model gets
    chat messages (roles use the markup-free `messages` template).

How a program becomes chat messages (chat models; shared with the Anthropic backend)
    - Each finished role turn is one message (`system`, `user`, `assistant`).
    - Text appended outside any role (before the first role or between turns) is sent as a `user`
      message of its own at its position; whitespace-only text outside roles is dropped.
    - `gen`/`select` must run inside an assistant turn (`s += sgl.assistant(sgl.gen("a"))` or
      `with s.assistant(): s += sgl.gen("a")`). The one exception is a program that uses no roles
      at all: its whole text is sent as one user message (so plain `s += "Q: ..." + sgl.gen()`
      programs run on chat models too).
    - Text before a `gen` inside the same assistant turn would be a partial assistant message
      (a "prefill"). The OpenAI chat API cannot continue one, so that raises
      `UnsupportedPrimitive`; the Anthropic backend supports it.

Sampling parameters
    Standard ones (max_tokens, stop, temperature, top_p, frequency/presence penalty) are sent when
    they differ from the library defaults (which equal OpenAI's). SGLang's extras (top_k, min_p,
    min_tokens, ignore_eos, stop_token_ids, regex, json_schema; `dtype=`/`gen_int` become a regex)
    go through `extra_body`, and only when set. They need a server that understands them:
    `server_extras=None` probes the server's native `/get_model_info` route (served by radixlm
    and SGLang) once at construction. Elsewhere a set extra raises `UnsupportedPrimitive`, except
    `json_schema` on a chat model, which becomes OpenAI's `response_format`. A server that rejects
    a request raises the SDK's error (e.g. `openai.BadRequestError`) with the server's message.

select
    Completion models: every `prefix + choice` is scored in one `/v1/completions` call with
    `echo=True, logprobs=0, max_tokens=0`, together with the prefix alone; a choice's tokens are
    those after the longest token prefix it shares with the prefix alone (so a token that merges
    the prefix's end with the choice's start is scored: token healing). The choice method then
    decides. Chat models cannot score a prefix, so on radixlm/SGLang servers `select` is
    constrained decoding: a greedy `gen` whose regex admits exactly the choices (the choice
    method must be the default or `greedy_token_selection`); elsewhere it raises
    `UnsupportedPrimitive`.

The API key defaults to `OPENAI_API_KEY`; with a `base_url` and no key anywhere, a placeholder
is sent (local servers do not check it).
"""

from __future__ import annotations

import os
from typing import Any, Iterator, Optional, Union

from radixlm.lang.backend.api_common import (EXTRA_PARAMS, STANDARD_PARAMS,
                                             UNCONDITIONAL_PREFIX, chat_messages, extra_name, finish_meta,
                                             is_completion_model_name, probe_native_server,
                                             regex_literal, resolve_api_key, sampling_extras,
                                             stop_list)
from radixlm.lang.backend.base import BaseBackend, UnsupportedPrimitive
from radixlm.lang.chat_template import (ChatTemplate, chat_template_for_model,
                                        get_chat_template)
from radixlm.lang.choices import ChoicesDecision, decide, greedy_token_selection
from radixlm.lang.ir import SamplingParams

__all__ = ["OpenAI", "chat_messages", "extra_name", "finish_meta", "is_completion_model_name",
           "probe_native_server", "resolve_api_key", "sampling_extras", "stop_list"]


class OpenAI(BaseBackend):
    def __init__(self, model_name: str, base_url: Optional[str] = None,
                 api_key: Optional[str] = None, is_chat_model: Optional[bool] = None,
                 chat_template: Union[None, str, ChatTemplate] = None,
                 server_extras: Optional[bool] = None, **client_kwargs):
        import openai

        self.model_name = model_name
        self.base_url = base_url
        self.client = openai.OpenAI(base_url=base_url,
                                    api_key=resolve_api_key(api_key, "OPENAI_API_KEY", base_url),
                                    **client_kwargs)
        self.is_chat_model = (not is_completion_model_name(model_name) if is_chat_model is None
                              else bool(is_chat_model))
        self.native_info = probe_native_server(base_url) if server_extras is not False else None
        self.server_extras = (self.native_info is not None if server_extras is None
                              else bool(server_extras))
        if self.is_chat_model:
            if chat_template not in (None, "messages") and not (
                    isinstance(chat_template, ChatTemplate) and chat_template.style == "messages"):
                raise ValueError("OpenAI: a chat model takes messages; chat_template applies to "
                                 "completion models (is_chat_model=False)")
            self.chat_template = get_chat_template("messages")
        elif isinstance(chat_template, ChatTemplate):
            self.chat_template = chat_template
        elif chat_template:
            self.chat_template = get_chat_template(chat_template)
        else:
            path = (self.native_info or {}).get("model_path") or model_name
            self.chat_template = chat_template_for_model(path)

    def get_model_name(self) -> str:
        return self.model_name

    def flush_cache(self) -> None:
        raise UnsupportedPrimitive(self, "flush_cache", "the OpenAI API has no such route "
                                   "(use RuntimeEndpoint for a radixlm server)")

    def get_server_info(self) -> dict:
        raise UnsupportedPrimitive(self, "get_server_info", "the OpenAI API has no such route "
                                   "(use RuntimeEndpoint for a radixlm server)")

    # --- parameters -------------------------------------------------------------------------------
    def request_kwargs(self, params: SamplingParams, chat: Optional[bool] = None) -> dict:
        """The SDK keyword arguments for `params` (no model/prompt/messages/stream)."""
        chat = self.is_chat_model if chat is None else chat
        d = params.resolved()
        kw: dict[str, Any] = {"max_tokens": d["max_new_tokens"]}
        stops = stop_list(params)
        if stops:
            kw["stop"] = stops
        for ours, theirs in STANDARD_PARAMS:
            if d[ours] != SamplingParams.DEFAULTS[ours]:
                kw[theirs] = d[ours]
        extras = sampling_extras(params)
        if extras and not self.server_extras:
            if chat and list(extras) == ["json_schema"]:
                import json
                schema = extras.pop("json_schema")
                if isinstance(schema, str):
                    schema = json.loads(schema)
                kw["response_format"] = {"type": "json_schema",
                                         "json_schema": {"name": "output", "schema": schema}}
            else:
                field = next(iter(extras))
                raise UnsupportedPrimitive(
                    self, extra_name(field, params),
                    "it is an SGLang extension; this server did not answer radixlm's/SGLang's "
                    "/get_model_info (pass server_extras=True to send it anyway)")
        if extras:
            kw["extra_body"] = {dict(EXTRA_PARAMS)[k]: v for k, v in extras.items()}
        if d["return_logprob"]:
            if chat:
                kw["logprobs"] = True
                if d["top_logprobs_num"]:
                    kw["top_logprobs"] = d["top_logprobs_num"]
            else:
                kw["logprobs"] = d["top_logprobs_num"] or 0
        return kw

    # --- calls ------------------------------------------------------------------------------------
    def _prompt_kwargs(self, s) -> dict:
        if not self.is_chat_model:
            return {"prompt": s.text_}
        messages, partial = chat_messages(s, self)
        if partial.strip():
            raise UnsupportedPrimitive(
                self, "text before gen/select inside an assistant turn",
                "the OpenAI chat API cannot continue a partial assistant message; move the text "
                "into the user turn, or use the Anthropic backend or a completion model")
        return {"messages": messages}

    def _create(self, s, params: SamplingParams, stream: bool):
        kw = {**self._prompt_kwargs(s), **self.request_kwargs(params)}
        api = self.client.chat.completions if self.is_chat_model else self.client.completions
        if stream:
            kw["stream"] = True
            kw["stream_options"] = {"include_usage": True}
        return api.create(model=self.model_name, **kw)

    @staticmethod
    def _usage_meta(usage) -> dict:
        if usage is None:
            return {}
        details = getattr(usage, "prompt_tokens_details", None)
        return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
                "cached_tokens": (getattr(details, "cached_tokens", None) or 0) if details else 0}

    def _logprobs_meta(self, lps) -> Optional[list]:
        """Output logprobs as native-style (logprob, token id, token text) triples (ids unknown)."""
        if lps is None:
            return None
        if self.is_chat_model:
            return [(t.logprob, None, t.token) for t in (lps.content or [])]
        return [(lp, None, t) for lp, t in zip(lps.token_logprobs or [], lps.tokens or [])]

    def generate(self, s, params: SamplingParams) -> tuple[str, dict]:
        resp = self._create(s, params, stream=False)
        choice = resp.choices[0]
        text = (choice.message.content if self.is_chat_model else choice.text) or ""
        extra = getattr(choice, "model_extra", None) or {}
        meta = {"id": resp.id, "model": resp.model,
                "finish_reason": finish_meta(choice.finish_reason, extra.get("matched_stop")),
                **self._usage_meta(resp.usage)}
        lps = self._logprobs_meta(getattr(choice, "logprobs", None))
        if lps is not None:
            meta["output_token_logprobs"] = lps
        return text, meta

    def generate_stream(self, s, params: SamplingParams) -> Iterator[tuple[str, Optional[dict]]]:
        """Deltas as they arrive; the last one carries the meta info (finish reason, usage)."""
        meta: dict[str, Any] = {"id": None, "model": self.model_name, "finish_reason": None}
        held: Optional[str] = None  # one delta is held back so the last can carry the meta
        out_lps: list = []
        stream = self._create(s, params, stream=True)
        try:
            for chunk in stream:
                meta["id"] = chunk.id
                if chunk.usage is not None:
                    meta.update(self._usage_meta(chunk.usage))
                for choice in chunk.choices:
                    if choice.index != 0:
                        continue
                    delta = (choice.delta.content if self.is_chat_model else choice.text) or ""
                    lps = self._logprobs_meta(getattr(choice, "logprobs", None))
                    if lps:
                        out_lps.extend(lps)
                    if choice.finish_reason is not None:
                        extra = getattr(choice, "model_extra", None) or {}
                        meta["finish_reason"] = finish_meta(choice.finish_reason,
                                                            extra.get("matched_stop"))
                    if delta:
                        if held is not None:
                            yield held, None
                        held = delta
        finally:
            stream.close()
        if params.resolved()["return_logprob"]:
            meta["output_token_logprobs"] = out_lps
        yield held or "", meta

    # --- cache warming (radixlm/SGLang servers cache prefixes; elsewhere nothing to do) ----------
    def cache_prefix(self, prefix: str) -> None:
        if prefix and self.server_extras and not self.is_chat_model:
            self.client.completions.create(model=self.model_name, prompt=prefix, max_tokens=0)

    def commit_lazy_operations(self, s) -> None:
        self.cache_prefix(s.text_)

    # --- select -----------------------------------------------------------------------------------
    def _score(self, prompts: list[str]) -> list[tuple[list[str], list[Optional[float]]]]:
        """(tokens, logprobs) of each prompt, scored in one echo call."""
        resp = self.client.completions.create(model=self.model_name, prompt=prompts, echo=True,
                                              logprobs=0, max_tokens=0)
        by_index = sorted(resp.choices, key=lambda c: c.index)
        if len(by_index) != len(prompts) or any(c.logprobs is None for c in by_index):
            raise RuntimeError("select: the server did not return prompt logprobs for every "
                               "choice (it needs /v1/completions with echo and logprobs)")
        return [(list(c.logprobs.tokens), list(c.logprobs.token_logprobs)) for c in by_index]

    @staticmethod
    def _after(base: list[str], full: tuple[list[str], list]) -> tuple[list[str], list[tuple]]:
        """Tokens of `full` after the longest token prefix it shares with `base`, and their
        `(logprob, None, token)` triples (the unscored first token, logprob None, left out)."""
        toks, lps = full
        j = 0
        while j < len(base) and j < len(toks) and toks[j] == base[j]:
            j += 1
        return toks[j:], [(lp, None, t) for lp, t in zip(lps[j:], toks[j:]) if lp is not None]

    def select(self, s, choices: list[str], temperature: float, choices_method) -> ChoicesDecision:
        if not choices:
            raise ValueError("select: choices must not be empty")
        if self.is_chat_model:
            return self._select_constrained(s, choices, temperature, choices_method)
        prefix = s.text_
        prompts = ([prefix] if prefix else []) + [prefix + c for c in choices]
        scored = self._score(prompts)
        base = scored.pop(0)[0] if prefix else []
        spans = [self._after(base, sc) for sc in scored]
        token_lps = [lps for _, lps in spans]
        uncond = None
        if getattr(choices_method, "requires_unconditional_logprobs", False):
            sep = UNCONDITIONAL_PREFIX
            scored = self._score([sep] + [sep + "".join(toks) for toks, _ in spans])
            sep_toks = scored.pop(0)[0]
            uncond = [self._after(sep_toks, sc)[1] for sc in scored]
        return decide(choices_method, choices, token_lps, uncond)

    def _select_constrained(self, s, choices, temperature, choices_method) -> ChoicesDecision:
        if not self.server_extras:
            raise UnsupportedPrimitive(
                self, "select", "a chat model's API cannot score a prefix's continuations; use a "
                "completion model (is_chat_model=False) or a radixlm/SGLang server, where select "
                "is constrained decoding")
        if choices_method not in (None, greedy_token_selection):
            raise UnsupportedPrimitive(
                self, f"select with choices_method={type(choices_method).__name__}",
                "on a chat model select is greedy constrained decoding (choices_method=None or "
                "greedy_token_selection); scoring needs a completion model")
        regex = "(" + "|".join(regex_literal(c) for c in choices) + ")"
        params = SamplingParams(max_new_tokens=max(len(c.encode("utf-8")) for c in choices) + 2,
                                temperature=temperature or 0.0, regex=regex)
        text, meta = self.generate(s, params)
        if text in choices:
            decision = text
        else:  # e.g. cut short: the longest choice it agrees with
            fits = [c for c in choices if c.startswith(text) or text.startswith(c)]
            if not fits:
                raise RuntimeError(f"select: the server answered {text!r}, none of {choices!r}")
            decision = max(fits, key=lambda c: len(os.path.commonprefix([c, text])))
        return ChoicesDecision(decision, {"method": "constrained_decoding", "generated": text,
                                          **meta})

    def shutdown(self) -> None:
        self.client.close()
