"""/v1/embeddings (OpenAI's shape) over the served causal LM, and /v1/rerank (a documented 404).

An embedding is the model's final hidden state (after the last norm) pooled over the prompt,
`--embedding-pooling last` (the last token's state, the usual choice for decoder models) or
`mean` (the average over every position), then L2-normalized as SGLang's pooler does. Each input
is a prompt-only request through the same scheduler, so it shares the radix cache (last-token
pooling; mean pooling needs every position computed, so it never reuses cached prefix KV).

`encoding_format`: "float" (lists of floats) or "base64" (little-endian float32 bytes, what the
OpenAI Python SDK asks for by default and decodes itself).
"""

from __future__ import annotations

import base64
import struct
from typing import Literal, Optional, Union

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field, field_validator

from radixlm.server import openai_protocol as P
from radixlm.server.errors import APIError, openai_error_response, read_json_object
from radixlm.server.io_struct import GenerateReqInput
from radixlm.server.openai_common import close_all, start_generations

MAX_INPUTS = 2048  # OpenAI's bound on inputs per request
RERANK_404 = ("/v1/rerank needs a cross-encoder (reranker) model; this server serves a "
              "generative model. Score documents with /v1/embeddings (cosine similarity) or "
              "with prompt logprobs on /generate instead.")


class EmbeddingRequest(BaseModel):
    input: Union[str, list[str], list[int], list[list[int]]]
    model: Optional[str] = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Optional[int] = Field(None, ge=1)
    user: Optional[str] = None
    rid: Optional[Union[str, list[str]]] = None

    @field_validator("input")
    @classmethod
    def _non_empty(cls, v):
        if isinstance(v, str) or (v and isinstance(v[0], int)):
            items = [v]
        else:
            items = v
        if not items:
            raise ValueError("input must not be empty")
        if len(items) > MAX_INPUTS:
            raise ValueError(f"at most {MAX_INPUTS} inputs per request")
        if any(len(x) == 0 for x in items):
            raise ValueError("input must not contain an empty string or token list")
        return v

    def inputs(self) -> list[Union[str, list[int]]]:
        v = self.input
        if isinstance(v, str) or isinstance(v[0], int):
            return [v]
        return list(v)


def embedding_objs(tm, items: list, rids=None) -> list[GenerateReqInput]:
    pooling = getattr(tm.server_args, "embedding_pooling", "last")
    if pooling not in ("last", "mean"):
        raise ValueError(f"--embedding-pooling must be last or mean (got {pooling!r})")
    rids = rids if isinstance(rids, list) else [rids] * len(items)
    if len(rids) != len(items):
        raise ValueError(f"rid: {len(rids)} entries for {len(items)} inputs")
    return [GenerateReqInput(text=x if isinstance(x, str) else None,
                             input_ids=None if isinstance(x, str) else list(x),
                             sampling_params={"max_new_tokens": 0}, rid=r,
                             embed_pooling=pooling)
            for x, r in zip(items, rids)]


async def run_embeddings(tm, objs: list[GenerateReqInput], request) -> list[dict]:
    """Every input's final result (with its "embedding"); the first failure is raised."""
    gens, outs = await start_generations(tm, objs, request)
    await close_all(gens)
    for o in outs:
        fr = o["meta_info"].get("finish_reason") or {}
        if fr.get("type") == "abort" or o.get("embedding") is None:
            raise APIError(503, fr.get("message") or "the embedding was not computed")
    return outs


def _encode(vec: list[float], fmt: str):
    if fmt == "float":
        return vec
    return base64.b64encode(struct.pack(f"<{len(vec)}f", *vec)).decode("ascii")


def register_embedding_routes(app: FastAPI, tm) -> None:
    @app.post("/v1/embeddings")
    async def create_embeddings(request: Request):
        try:
            req = EmbeddingRequest.model_validate(await read_json_object(request))
            P.check_model(tm, req.model)
            outs = await run_embeddings(tm, embedding_objs(tm, req.inputs(), req.rid), request)
            dim = len(outs[0]["embedding"])
            if req.dimensions is not None and req.dimensions != dim:
                raise APIError(400, f"dimensions: this model's embeddings have {dim} dimensions "
                                    f"and cannot be shortened (got {req.dimensions})",
                               "dimensions")
            prompt = sum(o["meta_info"]["prompt_tokens"] for o in outs)
            data = [{"object": "embedding", "index": i,
                     "embedding": _encode(o["embedding"], req.encoding_format)}
                    for i, o in enumerate(outs)]
            return JSONResponse({"object": "list", "data": data, "model": tm.model_name,
                                 "usage": {"prompt_tokens": prompt, "total_tokens": prompt}})
        except Exception as e:
            return openai_error_response(e)

    @app.post("/v1/rerank")
    async def rerank(request: Request):
        return openai_error_response(APIError(404, RERANK_404, code="not_found"))
