"""The prompt of a /v1/responses call: the conversation so far (a stored response's, with
`previous_response_id`) plus the new input, rendered by the chat template with the chat path's
tool handling, and its token ids.

A continuation reuses the previous turn's token ids as they ran (responses_store.py says why):
the history is rendered once more with the previous answer replaced by a mark; when the text
before the mark is exactly the previous prompt, the ids are

    previous prompt ids + previous answer ids + ids of the text after the mark

(the end of the answer's turn, the new input, the generation prompt), so the radix cache holds
all but the new part. When the check fails (another template, instructions or tools changed,
the answer was cut by a stop string or held tool calls), the whole history is tokenized afresh:
still correct, cached only as far as the ids agree.
"""

from __future__ import annotations

import json
from array import array
from dataclasses import dataclass
from typing import Optional

from radixlm.server import tool_calls as T
from radixlm.server.errors import APIError
from radixlm.server.openai_chat import apply_chat_template_with_tools
from radixlm.server.responses_protocol import ResponsesRequest
from radixlm.server.responses_store import ANSWER_MARK, Splice, StoredResponse, text_digest


@dataclass
class Prompt:
    ids: list[int]
    text_len: int  # characters of the rendered prompt (as the template renders the history)
    digest: bytes
    context: str  # what must not change for the next turn to reuse these ids
    history: list[dict]  # the conversation up to the new input, without instructions
    spliced: bool  # the previous turn's ids were reused


def _context(req: ResponsesRequest, plan: Optional[T.ToolPlan], template_kwargs: dict) -> str:
    tools = [t.model_dump() for t in req.tools or []]
    mode = (plan.mode, plan.name) if plan is not None else None
    return json.dumps([req.instructions, tools, mode, template_kwargs], sort_keys=True)


def _render(tm, plan, messages: list[dict], template_kwargs: dict) -> str:
    from jinja2 import TemplateError

    try:
        return apply_chat_template_with_tools(tm, plan, messages, template_kwargs or None)
    except TemplateError as e:  # e.g. the template's own raise_exception on a role order
        raise APIError(400, f"input: the chat template rejected the conversation: {e}",
                       "input")


def build_prompt(tm, req: ResponsesRequest, plan: Optional[T.ToolPlan],
                 prev: Optional[StoredResponse], new: list[dict],
                 template_kwargs: dict) -> Prompt:
    system = [{"role": "system", "content": req.instructions}] if req.instructions else []
    history = [dict(m) for m in prev.messages] if prev is not None else []
    context = _context(req, plan, template_kwargs)
    encode = tm.tokenizer.encode
    splice = prev.splice if prev is not None else None
    if splice is not None and splice.context == context:
        marked = [*history[:-1], {**history[-1], "content": ANSWER_MARK}]
        full = _render(tm, plan, system + marked + new, template_kwargs)
        at = full.find(ANSWER_MARK)
        if at == splice.prompt_len and text_digest(full[:at]) == splice.prompt_digest:
            after = full[at + len(ANSWER_MARK):]
            text = full[:at] + history[-1]["content"] + after
            ids = list(splice.token_ids) + encode(after, add_special_tokens=False)
            return Prompt(ids, len(text), text_digest(text), context, history + new, True)
    text = _render(tm, plan, system + history + new, template_kwargs)
    # The rendered text holds the template's special tokens already (BOS where it wants one).
    ids = encode(text, add_special_tokens=False)
    return Prompt(ids, len(text), text_digest(text), context, history + new, False)


def answer_splice(prompt: Prompt, output_ids: list[int], matched, reason: Optional[str],
                  plain_answer: bool) -> Optional[Splice]:
    """What the next turn may reuse of this one: None unless the answer is plain text that
    the template will write back as the model wrote it (no reasoning split off, no tool calls,
    not cut by a stop string). A stop token is dropped: the template closes the turn itself."""
    if not plain_answer or isinstance(matched, str):
        return None
    ids = list(output_ids)
    if reason == "stop" and isinstance(matched, int) and ids and ids[-1] == matched:
        ids.pop()
    return Splice(array("I", prompt.ids + ids), prompt.text_len, prompt.digest, prompt.context)
