"""OpenAI-compatible routes: /v1/models here; /v1/completions (openai_completions.py),
/v1/chat/completions (openai_chat.py), /v1/embeddings and /v1/rerank (openai_embeddings.py),
/v1/responses (responses_api.py).

Each choice is one generate call (n choices per prompt, run concurrently). Before any byte of a
response is sent, every call's first update is awaited (openai_common.start_generations): input
errors surface there, so they become a proper 400/503 rather than an error inside a 200 stream.
Streams are SSE `data: {json}` events ending in `data: [DONE]`.
"""

from __future__ import annotations

import time

from fastapi import FastAPI
from fastapi.responses import JSONResponse, StreamingResponse

from radixlm.server import openai_protocol as P
from radixlm.server import tool_calls as T
from radixlm.server.errors import APIError, openai_error_response
from radixlm.server.openai_chat import register_chat_route
from radixlm.server.openai_common import close_all, start_generations
from radixlm.server.openai_completions import register_completion_route
from radixlm.server.openai_embeddings import register_embedding_routes
from radixlm.server.reasoning import get_format
from radixlm.server.responses_api import register_responses_routes


def register_openai_routes(app: FastAPI, tm) -> None:
    started = int(time.time())
    T.resolve_format(tm)  # an unknown --tool-call-parser stops the server at start-up
    parser = getattr(tm.server_args, "reasoning_parser", None)
    if parser:
        get_format(parser)  # likewise an unknown --reasoning-parser

    def card() -> P.ModelCard:
        return P.ModelCard(id=tm.model_name, created=started, max_model_len=tm.context_len,
                           root=getattr(tm, "model_path", None)
                           or getattr(tm.server_args, "model_path", None))

    @app.get("/v1/models")
    async def list_models():
        return JSONResponse(P.ModelList(data=[card()]).model_dump())

    @app.get("/v1/models/{model_id:path}")
    async def retrieve_model(model_id: str):
        try:
            P.check_model(tm, model_id)
        except APIError as e:
            return openai_error_response(e)
        return JSONResponse(card().model_dump())

    async def run(objs, request, stream, on_final, on_stream):
        """Start the calls, then answer with one JSON body or an SSE stream."""
        gens, firsts = await start_generations(tm, objs, request)
        if not stream:
            await close_all(gens)
            return JSONResponse(on_final(firsts).model_dump())
        return StreamingResponse(on_stream(gens, firsts), media_type="text/event-stream")

    register_completion_route(app, tm, run)
    register_chat_route(app, tm, run)
    register_embedding_routes(app, tm)
    register_responses_routes(app, tm)
