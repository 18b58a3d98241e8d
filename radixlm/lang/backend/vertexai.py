"""VertexAI / Gemini: the frontend over Google's Gemini models through the `google-genai` package
(an optional extra: `pip install 'radixlm[vertexai]'`), with SGLang's constructor
`sgl.VertexAI(model_name, safety_settings=None)`.

Where the requests go
    - Vertex AI when a project is known: `project=` or SGLang's `GCP_PROJECT_ID` environment
      variable (`location=` or `GCP_LOCATION`); credentials are Google's application defaults.
    - Otherwise the Gemini Developer API with `api_key=` (default: `GEMINI_API_KEY`, then
      `GOOGLE_API_KEY`). `Gemini` is the same class.
    - `base_url=` sends the requests elsewhere (a proxy, or a fake server in tests); with a
      base_url and no key anywhere, a placeholder key is sent.

How a program becomes a request
    - Chat only; messages by the rules of `radixlm.lang.backend.api_common` (`chat_messages`).
      System turns become the request's `system_instruction` (SGLang sends them as a user turn
      answered by "Understood."); assistant turns are the `model` role.
    - Text before a `gen` inside the same assistant turn (a prefill) raises
      `UnsupportedPrimitive`, as do `select`, logprobs and SGLang's extras other than `top_k`.
    - Sampling: `max_output_tokens`, `stop_sequences`, and `temperature`, `top_p`, `top_k`,
      `frequency_penalty`, `presence_penalty` when set.
    - Meta info: `finish_reason` in the native shape (`STOP` -> stop, `MAX_TOKENS` -> length,
      a safety or other block -> abort naming it), `prompt_tokens`, `completion_tokens`, `id`.
"""

from __future__ import annotations

import os
from typing import Any, Iterator, Optional

from radixlm.lang.backend.api_common import (STANDARD_PARAMS, chat_messages, extra_name,
                                             sampling_extras, stop_list)
from radixlm.lang.backend.base import BaseBackend, UnsupportedPrimitive
from radixlm.lang.chat_template import get_chat_template
from radixlm.lang.choices import ChoicesDecision
from radixlm.lang.ir import SamplingParams


def import_genai():
    try:
        from google import genai
        from google.genai import types
    except ImportError as exc:
        raise ImportError("the VertexAI/Gemini backend needs the `google-genai` package: "
                          f"pip install google-genai (or radixlm[vertexai]) ({exc})") from exc
    return genai, types


def finish_of(reason: Any) -> Optional[dict]:
    if reason is None:
        return None
    name = str(getattr(reason, "name", reason)).upper()
    if name == "STOP":
        return {"type": "stop", "matched": None}
    if name == "MAX_TOKENS":
        return {"type": "length"}
    return {"type": "abort", "message": f"the model stopped: {name}"}


class VertexAI(BaseBackend):
    is_chat_model = True

    def __init__(self, model_name: str, safety_settings=None, *, api_key: Optional[str] = None,
                 base_url: Optional[str] = None, project: Optional[str] = None,
                 location: Optional[str] = None, **client_kwargs):
        genai, self.types = import_genai()
        self.model_name = model_name
        self.safety_settings = safety_settings
        self.chat_template = get_chat_template("messages")
        project = project or (None if api_key else os.environ.get("GCP_PROJECT_ID"))
        if base_url:
            client_kwargs["http_options"] = self.types.HttpOptions(base_url=base_url)
        if project:
            self.client = genai.Client(vertexai=True, project=project,
                                       location=location or os.environ.get("GCP_LOCATION"),
                                       **client_kwargs)
        else:
            key = (api_key or os.environ.get("GEMINI_API_KEY") or os.environ.get("GOOGLE_API_KEY")
                   or ("EMPTY" if base_url else None))
            if key is None:
                raise ValueError("VertexAI: pass project= (or set GCP_PROJECT_ID) for Vertex AI, "
                                 "or api_key= (or set GEMINI_API_KEY) for the Gemini API")
            self.client = genai.Client(api_key=key, **client_kwargs)

    def get_model_name(self) -> str:
        return self.model_name

    def select(self, s, choices, temperature, choices_method) -> ChoicesDecision:
        raise UnsupportedPrimitive(self, "select", "Gemini returns no prompt logprobs and takes "
                                   "no decoding constraint; use the OpenAI backend or "
                                   "RuntimeEndpoint")

    # --- requests ---------------------------------------------------------------------------------
    def config(self, params: SamplingParams, system: Optional[str] = None) -> dict:
        """GenerateContentConfig's fields for `params` (and the system instruction)."""
        d = params.resolved()
        extras = sampling_extras(params)
        extras.pop("top_k", None)
        if extras:
            raise UnsupportedPrimitive(self, extra_name(next(iter(extras)), params),
                                       "Gemini's generation config has no such field")
        if d["return_logprob"]:
            raise UnsupportedPrimitive(self, "return_logprob")
        cfg: dict[str, Any] = {"max_output_tokens": d["max_new_tokens"]}
        stops = stop_list(params)
        if stops:
            cfg["stop_sequences"] = stops
        for ours, theirs in STANDARD_PARAMS:
            if d[ours] != SamplingParams.DEFAULTS[ours]:
                cfg[theirs] = d[ours]
        if d["top_k"] is not None and d["top_k"] > 0:
            cfg["top_k"] = d["top_k"]
        if system:
            cfg["system_instruction"] = system
        if self.safety_settings is not None:
            cfg["safety_settings"] = self.safety_settings
        return cfg

    def request(self, s, params: SamplingParams) -> dict:
        """generate_content's keyword arguments for a gen now."""
        messages, partial = chat_messages(s, self)
        if partial.strip():
            raise UnsupportedPrimitive(self, "text before gen inside an assistant turn",
                                       "Gemini cannot continue a partial model turn")
        system = "\n\n".join(m["content"] for m in messages if m["role"] == "system")
        contents = [{"role": "model" if m["role"] == "assistant" else "user",
                     "parts": [{"text": m["content"]}]}
                    for m in messages if m["role"] != "system"]
        return {"model": self.model_name, "contents": contents,
                "config": self.types.GenerateContentConfig(**self.config(params, system or None))}

    @staticmethod
    def _meta(resp, finish) -> dict:
        meta: dict[str, Any] = {"id": getattr(resp, "response_id", None), "finish_reason": finish}
        usage = getattr(resp, "usage_metadata", None)
        if usage is not None:
            meta["prompt_tokens"] = usage.prompt_token_count or 0
            meta["completion_tokens"] = usage.candidates_token_count or 0
        return meta

    @staticmethod
    def _text(resp) -> str:
        parts = []
        for cand in (getattr(resp, "candidates", None) or [])[:1]:
            content = getattr(cand, "content", None)
            for part in (getattr(content, "parts", None) or []):
                if getattr(part, "text", None) and not getattr(part, "thought", False):
                    parts.append(part.text)
        return "".join(parts)

    @staticmethod
    def _finish(resp) -> Any:
        cands = getattr(resp, "candidates", None) or []
        return getattr(cands[0], "finish_reason", None) if cands else None

    def generate(self, s, params: SamplingParams) -> tuple[str, dict]:
        resp = self.client.models.generate_content(**self.request(s, params))
        return self._text(resp), self._meta(resp, finish_of(self._finish(resp)))

    def generate_stream(self, s, params: SamplingParams) -> Iterator[tuple[str, Optional[dict]]]:
        """Text as it arrives; the last piece carries the meta info."""
        held: Optional[str] = None
        last, finish = None, None
        for chunk in self.client.models.generate_content_stream(**self.request(s, params)):
            last = chunk
            finish = self._finish(chunk) or finish
            text = self._text(chunk)
            if text:
                if held is not None:
                    yield held, None
                held = text
        yield held or "", self._meta(last, finish_of(finish))

    def shutdown(self) -> None:
        close = getattr(self.client, "close", None)
        if close is not None:
            close()


Gemini = VertexAI
