"""SGLang's native routes: /generate, /encode, /tokenize, /detokenize (and their /v1/ forms).

/generate answers SGLang's shapes. Non-streamed: one result dict, or a list for a batch
(`n` > 1 expands a prompt into n results, prompt-major). Streamed: SSE `data: {...}` chunks,
then `data: [DONE]`; each chunk is a result dict. As in SGLang, a chunk is cumulative by default:
`text`, `output_ids` and the output-side logprob lists (`output_token_logprobs`,
`output_top_logprobs`, `output_token_ids_logprobs`) hold everything so far, so the last chunk
equals the non-streamed result (SGLang's frontend keeps the latest chunk's meta_info). With
--incremental-streaming-output all of them are deltas: each chunk carries only what is new,
while `completion_tokens` and `output_token_logprobs_length` count everything. A batch streams
its requests' chunks interleaved, each with `index`.

A request the server tore down unfinished (a child process died, the server stopped: see
errors.server_abort) is an error, never a complete-looking answer: non-streamed, a 5xx with the
message naming the cause; streamed, a `data: {"error": {...}}` chunk in place of its final chunk
(SGLang's shape of errors after the 200; its frontend and ours raise on it). A plain abort
(/abort_request) stays a finish_reason of type abort, as in SGLang.
"""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ValidationError

from radixlm.server.errors import UnavailableError, server_fault
from radixlm.server.generate_fields import expand_n, parse_generate_body
from radixlm.server.io_struct import GenerateReqInput
from radixlm.server.openai_embeddings import embedding_objs, run_embeddings

OUTPUT_LIST_KEYS = ("output_token_logprobs", "output_top_logprobs", "output_token_ids_logprobs")


def error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "code": status}}, status_code=status)


def sse(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


async def json_body(request: Request) -> Any:
    raw = await request.body()
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise ValueError(f"invalid JSON: {e}") from None


class ChunkShaper:
    """Turns one request's cumulative updates into SGLang stream chunks (see module doc):
    unchanged by default, deltas of text, ids and output logprob lists when incremental."""

    def __init__(self, incremental: bool = False):
        self.incremental = incremental
        self.text_len = 0
        self.ids_len = 0
        self.lp_sent = 0  # output logprob entries already sent

    def __call__(self, out: dict) -> dict:
        if not self.incremental:
            return out
        meta = dict(out["meta_info"])
        n_lp = len(meta.get("output_token_logprobs") or [])
        start = min(self.lp_sent, n_lp)  # a jump-forward may have re-tokenized sent entries
        for key in OUTPUT_LIST_KEYS:
            if key in meta:
                meta[key] = meta[key][start:]
        self.lp_sent = n_lp
        chunk = {**out, "meta_info": meta}
        chunk["text"] = out["text"][self.text_len:]
        chunk["output_ids"] = out["output_ids"][min(self.ids_len, len(out["output_ids"])):]
        self.text_len, self.ids_len = len(out["text"]), len(out["output_ids"])
        return chunk


async def _final(tm, obj: GenerateReqInput, request) -> dict:
    out = None
    async for out in tm.generate(obj, request):
        pass
    return out


async def _stream(tm, objs: list[GenerateReqInput], request, batch: bool, incremental: bool):
    """SSE for one request or an interleaved batch. Errors after the 200 go out as a chunk."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int) -> None:
        shape = ChunkShaper(incremental)
        tag = {"index": i} if batch else {}
        try:
            async for out in tm.generate(objs[i], request):
                fault = server_fault(out["meta_info"]["finish_reason"])
                if fault is not None:
                    await queue.put({"error": {"message": fault[1], "code": fault[0]}, **tag})
                    continue
                chunk = shape(out)
                if batch:
                    chunk["index"] = i
                await queue.put(chunk)
        except (ValueError, UnavailableError) as e:
            await queue.put({"error": {"message": str(e)}, **tag})
        finally:
            await queue.put(None)

    tasks = [asyncio.create_task(pump(i)) for i in range(len(objs))]
    try:
        left = len(tasks)
        while left:
            item = await queue.get()
            if item is None:
                left -= 1
            else:
                yield sse(item)
        yield b"data: [DONE]\n\n"
    finally:
        for t in tasks:  # client gone: cancelling a pump closes its generator (which aborts)
            t.cancel()


class TokenizeRequest(BaseModel):
    model: str | None = None
    prompt: str | list[str]
    add_special_tokens: bool = True


class DetokenizeRequest(BaseModel):
    model: str | None = None
    tokens: list[int] | list[list[int]]
    skip_special_tokens: bool = True


def register_native_routes(app: FastAPI, tm, args) -> None:
    incremental = bool(getattr(args, "incremental_streaming_output", False))

    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(request: Request):
        try:
            parsed = expand_n(parse_generate_body(await json_body(request)), tm.builder.limits)
            batch = isinstance(parsed, list)
            objs = parsed if batch else [parsed]
            requested = 0
            for p in objs:  # validate the whole batch before queueing any of it
                for t in tm.tokenize_request(p):
                    requested += len(t.input_ids) + t.sampling_params.max_new_tokens
                tm.builder.limits.check_request_tokens(requested)
            if any(p.stream for p in objs):
                return StreamingResponse(_stream(tm, objs, request, batch, incremental),
                                         media_type="text/event-stream")
            results = await asyncio.gather(*(_final(tm, p, request) for p in objs))
            for out in results:
                fault = out and server_fault(out["meta_info"]["finish_reason"])
                if fault:
                    return error(*fault)
            return results if batch else results[0]
        except ValueError as e:
            return error(400, str(e))
        except UnavailableError as e:
            return error(503, str(e))

    @app.api_route("/encode", methods=["POST", "PUT"])
    async def encode(request: Request):
        """SGLang's native embedding call: {"text" | "input_ids", "rid"?} -> {"embedding",
        "meta_info"} (a list of them for a batch)."""
        try:
            body = await json_body(request)
            if not isinstance(body, dict):
                raise ValueError("the request body must be a JSON object")
            # sampling_params and log_metrics are accepted and have no effect here (SGLang's too)
            unknown = sorted(set(body) - {"text", "input_ids", "rid", "sampling_params",
                                          "log_metrics"})
            if unknown:
                raise ValueError(f"unknown or unsupported field(s) for /encode: {unknown}")
            text, ids = body.get("text"), body.get("input_ids")
            if (text is None) == (ids is None):
                raise ValueError("exactly one of text and input_ids is required")
            # the shapes first (fuzzing: input_ids true or {} was a 500)
            if text is not None and not isinstance(text, (str, list)):
                raise ValueError("text: a string or a list of strings")
            if ids is not None and not isinstance(ids, list):
                raise ValueError("input_ids: a list of token ids or a list of such lists")
            single = isinstance(text, str) or (ids is not None and ids and isinstance(ids[0], int))
            items = [text if text is not None else ids] if single else (text or ids)
            if not isinstance(items, list) or not items:
                raise ValueError("text/input_ids: the batch is empty")
            if text is not None and not all(isinstance(x, str) for x in items):
                raise ValueError("text: a string or a list of strings")  # fuzzing: [1, 2]
            if ids is not None and not all(_is_id_list(x) for x in items):
                raise ValueError("input_ids: a list of token ids or a list of such lists")
            rid = body.get("rid")  # fuzzing: a dict rid reached a dict key (unhashable, a 500)
            if not (rid is None or isinstance(rid, str) or (
                    isinstance(rid, list) and all(isinstance(r, str) for r in rid))):
                raise ValueError("rid: a string, or a list of strings for a batch")
            outs = await run_embeddings(tm, embedding_objs(tm, items, rid), request)
            res = [{"embedding": o["embedding"], "meta_info": o["meta_info"]} for o in outs]
            return res[0] if single else res
        except ValueError as e:
            return error(400, str(e))
        except UnavailableError as e:
            return error(503, str(e))
        except Exception as e:  # e.g. APIError from run_embeddings
            status = getattr(e, "status", 500)
            return error(status, getattr(e, "message", str(e)))

    @app.post("/tokenize")
    @app.post("/v1/tokenize")
    async def tokenize(request: Request):
        try:
            req = TokenizeRequest.model_validate(await json_body(request))
            if tm.tokenizer is None:
                raise ValueError("this server runs without a tokenizer")
            prompts = [req.prompt] if isinstance(req.prompt, str) else req.prompt
            toks = [tm.tokenizer.encode(p, add_special_tokens=req.add_special_tokens)
                    for p in prompts]
            if isinstance(req.prompt, str):
                return {"tokens": toks[0], "count": len(toks[0]), "max_model_len": tm.context_len}
            return {"tokens": toks, "count": [len(t) for t in toks],
                    "max_model_len": tm.context_len}
        except (ValueError, ValidationError) as e:
            return error(400, _message(e))

    @app.post("/detokenize")
    @app.post("/v1/detokenize")
    async def detokenize(request: Request):
        try:
            req = DetokenizeRequest.model_validate(await json_body(request))
            if tm.tokenizer is None:
                raise ValueError("this server runs without a tokenizer")
            single = not req.tokens or isinstance(req.tokens[0], int)
            seqs = [req.tokens] if single else req.tokens
            vocab = tm.info["vocab_size"]
            for seq in seqs:
                bad = [t for t in seq if not 0 <= t < vocab]
                if bad:
                    raise ValueError(f"tokens: ids outside the vocabulary [0, {vocab}): {bad[:5]}")
            texts = [tm.tokenizer.decode(s, skip_special_tokens=req.skip_special_tokens)
                     for s in seqs]
            return {"text": texts[0] if single else texts}
        except (ValueError, ValidationError) as e:
            return error(400, _message(e))


def _is_id_list(x: Any) -> bool:
    return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


def _message(e: Exception) -> str:
    if isinstance(e, ValidationError):
        first = e.errors(include_url=False)[0]
        loc = ".".join(str(p) for p in first.get("loc", ()))
        return f"{loc}: {first.get('msg', 'invalid value')}"
    return str(e)
