"""What the OpenAI- and Anthropic-compatible routes share: running generate calls (first
updates awaited before any byte is sent, so input errors become a proper 400/503 rather than an
error inside a 200 stream), merging their updates, finish reasons, usage, logprob helpers.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, AsyncIterator, Optional

from fastapi import Request

from radixlm.server import openai_protocol as P
from radixlm.server.errors import APIError, openai_error_body, openai_error_type, to_api_error
from radixlm.server.io_struct import GenerateReqInput

# Logprobs of impossible tokens are -inf, which JSON cannot carry; OpenAI documents -9999.0.
MIN_LOGPROB = -9999.0


# --- running generate calls (shared with anthropic_api) ---------------------------------------


async def close_all(gens: list) -> None:
    # A generator closed early (non-stream final taken, or an error elsewhere) runs its cleanup,
    # which is where the manager aborts a request that is still queued or running.
    for g in gens:
        if g is not None:
            try:
                await g.aclose()
            except Exception:
                pass


async def start_generations(tm, objs: list[GenerateReqInput],
                            request: Optional[Request]) -> tuple[list, list[dict]]:
    """Start every call and return (generators, first updates). The first failure cancels and
    closes the others at once (no waiting for their first token) and is raised."""
    gens: list = [None] * len(objs)

    async def first(i: int) -> dict:
        gens[i] = tm.generate(objs[i], request)
        try:
            return await gens[i].__anext__()
        except StopAsyncIteration:
            raise RuntimeError("the generation ended without producing any output") from None

    tasks = [asyncio.ensure_future(first(i)) for i in range(len(objs))]
    try:
        done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    except BaseException:  # cancelled (client gone) while waiting: stop everything
        for t in tasks:
            t.cancel()
        raise
    # every finished call's exception is retrieved (a list, not any(): the ones after the
    # first would be logged as "Task exception was never retrieved")
    if pending or [t.exception() for t in done if t.exception() is not None]:
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        await close_all(gens)
        raise next(t.exception() for t in tasks if not t.cancelled() and t.exception() is not None)
    return gens, [t.result() for t in tasks]


def is_finished(out: dict) -> bool:
    return out["meta_info"].get("finish_reason") is not None


async def all_updates(gens: list, firsts: list[dict]) -> AsyncIterator[tuple[int, dict]]:
    """Yield (call index, update): the first updates, then the rest in arrival order. Leaving
    early (client disconnect, error) cancels the pumps, which closes their generators."""
    for i, f in enumerate(firsts):
        yield i, f
    await close_all([g for g, f in zip(gens, firsts) if is_finished(f)])
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int) -> None:
        try:
            async for item in gens[i]:
                await queue.put((i, item, None))
            await queue.put((i, None, None))
        except Exception as e:  # handed to the consumer, which reports it in the stream
            await queue.put((i, None, e))

    tasks = [asyncio.create_task(pump(i)) for i, f in enumerate(firsts) if not is_finished(f)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item, err = await queue.get()
            if err is not None:
                raise err
            if item is None:
                remaining -= 1
            else:
                yield i, item
    finally:
        for t in tasks:  # no await here: this also runs inside an already-cancelled task
            t.cancel()


def finish_of(out: dict) -> tuple[Optional[str], Any]:
    """(OpenAI finish_reason, matched stop) of an update; an abort is an error, not a reason."""
    fr = out["meta_info"].get("finish_reason")
    if fr is None:
        return None, None
    if fr.get("type") == "length":
        return "length", None
    if fr.get("type") == "abort":
        # Not the caller's doing unless the runtime says so (e.g. a 400 found after queueing).
        raise APIError(int(fr.get("status_code") or 503), fr.get("message") or "request aborted")
    return "stop", fr.get("matched")


def sse(payload: Any) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"


def openai_stream_error(exc: BaseException) -> str:
    err = to_api_error(exc)
    return sse(openai_error_body(err.message, openai_error_type(err.status), err.param, err.code))


def usage_of(outs: list[dict], n: int, cache_report: bool = True) -> P.UsageInfo:
    """Each prompt's tokens count once although its n samples each prefilled it; its cached
    tokens are the best any sample got (never more than its prompt). As in SGLang, the cached
    tokens are reported (prompt_tokens_details) only with --enable-cache-report."""
    prompt = cached = completion = 0
    for p in range(0, len(outs), n):
        metas = [o["meta_info"] for o in outs[p:p + n]]
        prompt += metas[0]["prompt_tokens"]
        cached += max(m.get("cached_tokens", 0) for m in metas)
    completion = sum(o["meta_info"]["completion_tokens"] for o in outs)
    return P.UsageInfo(prompt_tokens=prompt, completion_tokens=completion,
                       total_tokens=prompt + completion,
                       prompt_tokens_details=P.PromptTokensDetails(cached_tokens=cached)
                       if cache_report else None)


def lp_clamp(x: Optional[float]) -> Optional[float]:
    return None if x is None else max(float(x), MIN_LOGPROB)


def lp_of(entry) -> Optional[float]:
    return None if entry is None else lp_clamp(entry[0])


class TokenText:
    """Token text of a logprob entry (logprob, id, text|None); decoded when the manager left it
    out. An entry may itself be None (the unscored first prompt token): its text is unknown."""

    def __init__(self, tm):
        self.tm = tm

    def __call__(self, entry) -> str:
        if entry is None:
            return ""
        text = entry[2] if len(entry) > 2 else None
        return text if text is not None else self.tm.tokenizer.decode([entry[1]])


def cache_report(tm) -> bool:
    return bool(getattr(tm.server_args, "enable_cache_report", False))


class ChoiceState:
    """What one choice has sent so far, so each streamed chunk carries only what is new."""

    def __init__(self, echo_text: str = ""):
        self.first = True
        self.echo_text = echo_text  # goes out with the choice's first piece
        self.text_len = 0  # chars of the cumulative output text already sent
        self.n_lp = 0  # output logprob entries already sent
        self.tok_offset = len(echo_text)  # text_offset of the next output token
        self.tools = None  # the choice's ToolStream (chat with tools)
        self.reasoning = None  # the choice's ReasoningParser (chat with --reasoning-parser)
