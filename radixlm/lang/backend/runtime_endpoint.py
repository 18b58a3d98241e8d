"""RuntimeEndpoint: the frontend over radixlm's (or SGLang's) native HTTP API.

Every call sends the program's whole text; the server's radix cache makes the repeated prefix
free, so the frontend keeps no KV bookkeeping of its own.
"""

from __future__ import annotations

import base64
import json
import os
from typing import Iterator, Optional

import httpx

from radixlm.lang.backend.base import BaseBackend
from radixlm.lang.chat_template import chat_template_for_model, get_chat_template
from radixlm.lang.choices import ChoicesDecision, decide
from radixlm.lang.global_config import global_config
from radixlm.lang.ir import SamplingParams


class ServerError(RuntimeError):
    """The server answered with an error (its message included)."""


class RuntimeEndpoint(BaseBackend):
    """SGLang's arguments: `base_url`, `api_key`, `verify` (TLS: a CA bundle path, or False),
    `chat_template_name`; radixlm's `chat_template` is the same as `chat_template_name`."""

    def __init__(self, base_url: str, api_key: Optional[str] = None, verify=None,
                 chat_template_name: Optional[str] = None, *, timeout: float = 600.0,
                 chat_template: Optional[str] = None):
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.Client(base_url=self.base_url, headers=headers, timeout=timeout,
                                   verify=True if verify is None else verify)
        self.model_info = self._get("/get_model_info")
        name = chat_template_name or chat_template
        self.chat_template = (get_chat_template(name) if name
                              else chat_template_for_model(self.model_info.get("model_path", "")))

    @property
    def endpoint(self) -> "RuntimeEndpoint":
        """SGLang programs reach for `runtime.endpoint`; an endpoint is its own."""
        return self

    # --- HTTP -------------------------------------------------------------------------------------
    def _get(self, path: str) -> dict:
        r = self.client.get(path)
        self._check(r)
        return r.json()

    def _post(self, path: str, body: dict):
        r = self.client.post(path, json=body)
        self._check(r)
        return r.json()

    @staticmethod
    def _check(r: httpx.Response) -> None:
        if r.status_code >= 400:
            try:
                msg = r.json().get("error", {}).get("message", r.text)
            except (json.JSONDecodeError, AttributeError):
                msg = r.text
            raise ServerError(f"{r.request.method} {r.request.url.path} -> {r.status_code}: {msg}")

    def get_model_name(self) -> str:
        """The model path the server loaded (SGLang's answer; radixlm's /v1 accepts it as a model
        name, as it does the served name)."""
        return self.model_info.get("model_path") or self.model_info.get("served_model_name", "")

    def flush_cache(self) -> None:
        r = self.client.post("/flush_cache")
        self._check(r)

    def get_server_info(self) -> dict:
        return self._get("/get_server_info")

    # --- primitives -------------------------------------------------------------------------------
    def _generate_call(self, body: dict):
        """One native /generate call (a dict, or a list for a batch body)."""
        return self._post("/generate", body)

    def _generate_stream_call(self, body: dict) -> Iterator[dict]:
        with self.client.stream("POST", "/generate", json=body) as r:
            if r.status_code >= 400:
                r.read()
                self._check(r)
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise ServerError(f"/generate stream: {chunk['error'].get('message')}")
                yield chunk

    def cache_prefix(self, prefix: str) -> None:
        if prefix:
            self._generate_call({"text": prefix, "sampling_params": {"max_new_tokens": 0}})

    def commit_lazy_operations(self, s) -> None:
        if getattr(s, "images_", None):
            self._generate_call({"text": s.text_, "sampling_params": {"max_new_tokens": 0},
                                 "image_data": list(s.images_)})
        else:
            self.cache_prefix(s.text_)

    # --- images (sgl.image): the server expands each image token of the text -------------------
    supports_images = True

    def image_payload(self, image):
        """What `image_data` carries for sgl.image(image): a file's bytes as base64 (the server
        may be elsewhere); a data: URL or base64 string as it is."""
        if isinstance(image, (bytes, bytearray)):
            return base64.b64encode(bytes(image)).decode()
        if isinstance(image, str) and os.path.isfile(image):
            with open(image, "rb") as f:
                return base64.b64encode(f.read()).decode()
        return image

    def _generate_body(self, s, params: SamplingParams, stream: bool) -> dict:
        d = params.resolved()
        sp = {"skip_special_tokens": global_config.skip_special_tokens_in_output,
              "spaces_between_special_tokens": global_config.spaces_between_special_tokens_in_out,
              **params.to_runtime()}
        body = {"text": s.text_, "sampling_params": sp, "stream": stream}
        if getattr(s, "images_", None):
            body["image_data"] = list(s.images_)
        if d["return_logprob"]:
            body["return_logprob"] = True
            body["logprob_start_len"] = d["logprob_start_len"] if d["logprob_start_len"] is not None else -1
            body["top_logprobs_num"] = d["top_logprobs_num"] or 0
            body["return_text_in_logprobs"] = bool(d["return_text_in_logprobs"])
        return body

    def generate(self, s, params: SamplingParams):
        out = self._generate_call(self._generate_body(s, params, stream=False))
        return out["text"], out["meta_info"]

    def generate_stream(self, s, params: SamplingParams) -> Iterator[tuple[str, dict]]:
        sent = 0
        for chunk in self._generate_stream_call(self._generate_body(s, params, stream=True)):
            text = chunk["text"]
            yield text[sent:], chunk["meta_info"]
            sent = len(text)

    def select(self, s, choices: list[str], temperature: float, choices_method) -> ChoicesDecision:
        """Score every `prefix + choice` in one batched call over the cached prefix.

        Token healing: the choice may merge with the prefix's last token when tokenized together,
        so scoring starts two tokens before the boundary and each choice's span begins at its
        first token that differs from the prefix's own tokenization. The choice method gets
        SGLang's `(logprob, token_id, token_text)` triples of each span.
        """
        if not choices:
            raise ValueError("select: choices must not be empty")
        prefix = s.text_
        images = list(getattr(s, "images_", None) or [])
        with_images = {"image_data": images} if images else {}
        head = self._generate_call({"text": prefix, "sampling_params": {"max_new_tokens": 0},
                                    **with_images})
        n_prefix = head["meta_info"]["prompt_tokens"]
        start = max(n_prefix - 2, 0)
        texts = [prefix] + [prefix + c for c in choices]
        outs = self._generate_call({
            "text": texts, "sampling_params": {"max_new_tokens": 0, "temperature": 0},
            "return_logprob": True, "logprob_start_len": start, "return_text_in_logprobs": True,
            **({"image_data": [images] * len(texts)} if images else {})})
        prefix_ids = [t[1] for t in outs[0]["meta_info"]["input_token_logprobs"]]
        spans = []
        for out in outs[1:]:
            triples = out["meta_info"]["input_token_logprobs"]
            j = 0
            while j < len(prefix_ids) and j < len(triples) and triples[j][1] == prefix_ids[j]:
                j += 1
            spans.append([tuple(t) for t in triples[j:] if t[0] is not None])
        uncond = None
        if getattr(choices_method, "requires_unconditional_logprobs", False):
            # the same tokens after only a document separator: what the model thinks of the choice
            # with no context
            sep = (self.model_info.get("eos_token_ids") or [0])[0]
            outs = self._generate_call({
                "input_ids": [[sep] + [t[1] for t in span] for span in spans],
                "sampling_params": {"max_new_tokens": 0},
                "return_logprob": True, "logprob_start_len": 1, "return_text_in_logprobs": True})
            uncond = [[tuple(t) for t in o["meta_info"]["input_token_logprobs"]] for o in outs]
        return decide(choices_method, choices, spans, uncond)

    def shutdown(self) -> None:
        self.client.close()
