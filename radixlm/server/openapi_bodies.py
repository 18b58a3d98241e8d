"""Request bodies in the served OpenAPI schema (/openapi.json, /docs).

The routes read their JSON bodies themselves (so that every malformed body is answered in the
called API's own error shape, never FastAPI's 422), which leaves FastAPI's generated schema
without any request body. This adds them: the pydantic models the routes validate with
(OpenAI, Anthropic, Responses, tokenize), and for the native routes, whose bodies are checked
field by field (generate_fields.FIELDS, sampling_params.FIELDS), a schema of the fields' types.

Clients and API fuzzers (benchmarks/probes/fuzz_api.py, tests/e2e/test_fuzz_api.py) read it. A
schema here describes what is accepted; the route remains the judge (a field listed here may
still be refused at a value it does not support, with a 400 that says why).
"""

from __future__ import annotations

from typing import Any, Callable

from fastapi import FastAPI
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

_INT = {"type": "integer"}
_NUM = {"type": "number"}
_BOOL = {"type": "boolean"}
_STR = {"type": "string"}


def _array(item: dict) -> dict:
    return {"type": "array", "items": item}


def _one_or_many(item: dict) -> dict:
    return {"anyOf": [item, _array(item)]}


def _object(props: dict[str, Any], **extra) -> dict:
    return {"type": "object", "properties": props, **extra}


# SGLang's sampling parameters (radixlm/runtime/sampling_params.py FIELDS), typed
SAMPLING_PARAMS = _object({
    "max_new_tokens": {"anyOf": [_INT, {"type": "null"}]}, "min_new_tokens": _INT,
    "stop": _one_or_many(_STR), "stop_token_ids": _array(_INT), "stop_regex": _one_or_many(_STR),
    "temperature": _NUM, "top_p": _NUM, "top_k": _INT, "min_p": _NUM,
    "frequency_penalty": _NUM, "presence_penalty": _NUM, "repetition_penalty": _NUM, "n": _INT,
    "json_schema": _STR, "regex": _STR, "ebnf": _STR, "structural_tag": _STR,
    "ignore_eos": _BOOL, "skip_special_tokens": _BOOL, "spaces_between_special_tokens": _BOOL,
    "no_stop_trim": _BOOL, "stream_interval": _INT,
    "logit_bias": {"type": "object", "additionalProperties": _NUM},
    "sampling_seed": _INT, "seed": _INT, "custom_params": {"type": "object"},
}, additionalProperties=False)

GENERATE = _object({
    "text": _one_or_many(_STR), "input_ids": _one_or_many(_array(_INT)),
    "rid": _one_or_many(_STR), "sampling_params": _one_or_many(SAMPLING_PARAMS),
    "return_logprob": _one_or_many(_BOOL), "logprob_start_len": _one_or_many(_INT),
    "top_logprobs_num": _one_or_many(_INT), "token_ids_logprob": _array(_INT),
    "return_text_in_logprobs": _BOOL, "stream": _BOOL, "log_metrics": _BOOL, "no_logs": _BOOL,
    "return_prompt_token_ids": _BOOL, "image_data": _one_or_many(_STR),
}, additionalProperties=False)

ENCODE = _object({"text": _one_or_many(_STR), "input_ids": _one_or_many(_array(_INT)),
                  "rid": _one_or_many(_STR)})

ABORT = _object({"rid": _STR}, required=["rid"])

PROFILE = _object({"output_dir": _STR, "num_steps": _INT, "activities": _array(_STR),
                   "with_stack": _BOOL, "record_shapes": _BOOL, "profile_id": _STR,
                   "profile_prefix": _STR})

UPDATE_WEIGHTS = _object({"model_path": _STR, "load_format": _STR,
                          "abort_all_requests": _BOOL, "weight_version": _STR,
                          "flush_cache": _BOOL}, required=["model_path"])


def _models() -> dict[tuple[str, str], type[BaseModel]]:
    """(method, path) -> the pydantic model its route validates with (imported late: this module
    is imported while the app is built, after them anyway)."""
    from radixlm.server.anthropic_api import CountTokensRequest, MessagesRequest
    from radixlm.server.native_api import DetokenizeRequest, TokenizeRequest
    from radixlm.server.openai_embeddings import EmbeddingRequest
    from radixlm.server.openai_protocol import ChatCompletionRequest, CompletionRequest
    from radixlm.server.responses_protocol import ResponsesRequest

    return {("post", "/v1/completions"): CompletionRequest,
            ("post", "/v1/chat/completions"): ChatCompletionRequest,
            ("post", "/v1/embeddings"): EmbeddingRequest,
            ("post", "/v1/responses"): ResponsesRequest,
            ("post", "/v1/messages"): MessagesRequest,
            ("post", "/v1/messages/count_tokens"): CountTokensRequest,
            **{("post", p): TokenizeRequest for p in ("/tokenize", "/v1/tokenize")},
            **{("post", p): DetokenizeRequest for p in ("/detokenize", "/v1/detokenize")}}


# (method, path) -> a plain JSON schema; `required`: whether the route refuses an empty body
_PLAIN: dict[tuple[str, str], tuple[dict, bool]] = {
    **{(m, "/generate"): (GENERATE, True) for m in ("post", "put")},
    **{(m, "/encode"): (ENCODE, True) for m in ("post", "put")},
    ("post", "/abort_request"): (ABORT, True),
    ("post", "/start_profile"): (PROFILE, False),
    ("post", "/update_weights_from_disk"): (UPDATE_WEIGHTS, True),
}


def _body(schema: dict, required: bool = True) -> dict:
    return {"required": required, "content": {"application/json": {"schema": schema}}}


def install(app: FastAPI) -> None:
    """Make app.openapi() add the request bodies to FastAPI's generated schema (built once)."""
    generate: Callable[[], dict] = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = generate()
        models = _models()
        keys = list(models.items())
        refs, defs = models_json_schema([(m, "validation") for _, m in keys],
                                        ref_template="#/components/schemas/{model}")
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        components.update(defs.get("$defs", {}))
        for (method, path), model in keys:
            op = schema["paths"].get(path, {}).get(method)
            if op is not None:
                op["requestBody"] = _body(refs[(model, "validation")])
        for (method, path), (body, required) in _PLAIN.items():
            op = schema["paths"].get(path, {}).get(method)
            if op is not None:
                op["requestBody"] = _body(body, required)
        app.openapi_schema = schema
        return schema

    app.openapi = openapi
