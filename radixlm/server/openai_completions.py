"""/v1/completions (OpenAI's legacy completions API, with SGLang's sampling extras)."""

from __future__ import annotations

import time
import uuid
from typing import Optional

from fastapi import FastAPI, Request

from radixlm.server import openai_protocol as P
from radixlm.server.errors import openai_error_response, read_json_object
from radixlm.server.io_struct import GenerateReqInput
from radixlm.server.openai_common import (ChoiceState, TokenText, all_updates, cache_report,
                                          finish_of, lp_of, openai_stream_error, sse, usage_of)


def _add_completion_logprobs(tok, entries: list, tops: Optional[list], offset: int,
                             want_top: bool, into: P.CompletionLogprobs) -> int:
    """Append legacy-format entries; returns the offset after them. `text_offset` counts
    characters of the choice's `text` (echoed prompt included) by the tokens' own texts."""
    for k, e in enumerate(entries):
        t = tok(e)
        into.tokens.append(t)
        into.token_logprobs.append(lp_of(e))
        into.text_offset.append(offset)
        offset += len(t)
        if want_top:
            top = tops[k] if tops is not None and k < len(tops) else None
            into.top_logprobs.append(None if top is None else {tok(x): lp_of(x) for x in top})
    return offset


def _completion_piece(tm, req: P.CompletionRequest, st: ChoiceState, index: int, out: dict,
                      always: bool = False) -> Optional[P.CompletionChoice]:
    meta = out["meta_info"]
    reason, matched = finish_of(out)
    text = st.echo_text + out["text"][st.text_len:]
    st.echo_text, st.text_len = "", len(out["text"])
    lps = None
    if req.logprobs is not None:
        tok, want_top = TokenText(tm), req.logprobs > 0
        lps = P.CompletionLogprobs(top_logprobs=[] if want_top else None)
        if st.first and req.echo:
            _add_completion_logprobs(tok, meta.get("input_token_logprobs") or [],
                                     meta.get("input_top_logprobs"), 0, want_top, lps)
        entries = (meta.get("output_token_logprobs") or [])[st.n_lp:]
        tops = meta.get("output_top_logprobs")
        st.tok_offset = _add_completion_logprobs(tok, entries, tops[st.n_lp:] if tops else None,
                                                 st.tok_offset, want_top, lps)
        st.n_lp += len(entries)
    st.first = False
    if not always and not text and reason is None and not (lps and lps.tokens):
        return None
    return P.CompletionChoice(index=index, text=text, logprobs=lps, finish_reason=reason,
                              matched_stop=matched)


def register_completion_route(app: FastAPI, tm, run) -> None:
    @app.post("/v1/completions")
    async def create_completion(request: Request):
        try:
            req = P.CompletionRequest.model_validate(await read_json_object(request))
            P.check_model(tm, req.model)
            objs, states = [], []
            pd = req.bootstrap_fields(len(req.prompts()) * req.n)
            for prompt in req.prompts():
                is_text = isinstance(prompt, str)
                echo = (prompt if is_text else tm.tokenizer.decode(prompt)) if req.echo else ""
                for j in range(req.n):
                    objs.append(GenerateReqInput(
                        text=prompt if is_text else None,
                        input_ids=None if is_text else list(prompt),
                        sampling_params=req.sampling_params(req.max_tokens, j),
                        return_logprob=req.logprobs is not None,
                        # Echo with logprobs scores the prompt too: start at its first token.
                        logprob_start_len=0 if req.echo and req.logprobs is not None else -1,
                        top_logprobs_num=req.logprobs or 0, return_text_in_logprobs=True,
                        stream=req.stream, **pd))
                    states.append(ChoiceState(echo))
            rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())

            def on_final(outs):
                choices = [_completion_piece(tm, req, states[i], i, o, always=True)
                           for i, o in enumerate(outs)]
                return P.CompletionResponse(id=rid, created=created, model=tm.model_name,
                                            choices=choices, usage=usage_of(outs, req.n, cache_report(tm)))

            async def on_stream(gens, firsts):
                last = list(firsts)
                rest = all_updates(gens, firsts)
                try:
                    async for i, out in rest:
                        last[i] = out
                        piece = _completion_piece(tm, req, states[i], i, out)
                        if piece is not None:
                            yield sse(P.CompletionResponse(id=rid, created=created, model=tm.model_name,
                                                           choices=[piece]).model_dump_json())
                    if req.include_usage:
                        yield sse(P.CompletionResponse(id=rid, created=created, model=tm.model_name, choices=[],
                                                       usage=usage_of(last, req.n, cache_report(tm))).model_dump_json())
                except Exception as e:  # an abort or a runtime failure after the 200 went out
                    yield openai_stream_error(e)
                finally:
                    await rest.aclose()
                yield sse("[DONE]")

            return await run(objs, request, req.stream, on_final, on_stream)
        except Exception as e:
            return openai_error_response(e)
