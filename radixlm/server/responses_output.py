"""The Response object, its output items and the streamed events, shaped as the openai SDK parses
them (`openai/types/responses/response.py`, `response_output_item.py`, `response_*_event.py`).

`OutputBuilder` turns what the model wrote, already split by the chat path's parsers into
reasoning, answer text and tool-call deltas, into output items, and writes the event of every
step as it goes. The non-streamed answer is built by the same calls (its events are dropped), so
a streamed response and a whole one cannot disagree. A stream is:

    response.created, response.in_progress
    per item:  response.output_item.added
               message:        content_part.added, output_text.delta*, output_text.done,
                               content_part.done
               reasoning:      content_part.added, reasoning_text.delta*, reasoning_text.done,
                               content_part.done
               function_call:  function_call_arguments.delta*, function_call_arguments.done
               response.output_item.done
    response.completed (or response.incomplete when max_output_tokens cut it off)
Every event carries a sequence_number counting from 0.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Optional

from radixlm.server import tool_calls as T


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def usage_object(prompt_tokens: int, cached_tokens: int, output_tokens: int,
                 reasoning_tokens: int, cache_writes: bool) -> dict:
    """`cache_write_tokens`: the prompt tokens computed here, whose KV the radix cache keeps."""
    return {"input_tokens": prompt_tokens,
            "input_tokens_details": {"cached_tokens": cached_tokens, "cache_write_tokens":
                                     prompt_tokens - cached_tokens if cache_writes else 0},
            "output_tokens": output_tokens,
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": prompt_tokens + output_tokens}


class OutputBuilder:
    def __init__(self):
        self.items: list[dict] = []
        self.events: list[str] = []  # SSE lines not yet sent
        self._seq = 0
        self._open: Optional[dict] = None  # the item being written
        self._call_items: dict[int, dict] = {}  # tool-call index -> its item

    # --- events -----------------------------------------------------------------------------------
    def event(self, kind: str, **fields: Any) -> None:
        payload = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        self.events.append(f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n")

    def take_events(self) -> list[str]:
        out, self.events = self.events, []
        return out

    # --- items ------------------------------------------------------------------------------------
    def _where(self, item: dict) -> dict:
        return {"item_id": item["id"], "output_index": self.items.index(item)}

    def _start(self, item: dict) -> dict:
        self.close()
        self.items.append(item)
        self._open = item
        self.event("response.output_item.added", output_index=len(self.items) - 1,
                   item=dict(item, content=[]) if "content" in item else dict(item))
        if item["type"] in ("message", "reasoning"):
            self.event("response.content_part.added", content_index=0,
                       part=item["content"][0], **self._where(item))
        return item

    def reasoning(self, delta: str) -> None:
        if not delta:
            return
        item = self._open
        if item is None or item["type"] != "reasoning":
            item = self._start({"id": new_id("rs"), "type": "reasoning", "summary": [],
                                "content": [{"type": "reasoning_text", "text": ""}],
                                "status": "in_progress"})
        item["content"][0]["text"] += delta
        self.event("response.reasoning_text.delta", content_index=0, delta=delta,
                   **self._where(item))

    def text(self, delta: str) -> None:
        if not delta:
            return
        item = self._open
        if item is None or item["type"] != "message":
            item = self._start({"id": new_id("msg"), "type": "message", "role": "assistant",
                                "status": "in_progress",
                                "content": [{"type": "output_text", "text": "",
                                             "annotations": [], "logprobs": []}]})
        item["content"][0]["text"] += delta
        self.event("response.output_text.delta", content_index=0, delta=delta, logprobs=[],
                   **self._where(item))

    def call(self, d: T.ToolCallDelta) -> None:
        item = self._call_items.get(d.index)
        if item is None:
            if d.name is None:  # arguments of a call whose name never came: nothing to attach
                return
            item = self._call_items[d.index] = self._start({
                "id": new_id("fc"), "type": "function_call", "call_id": T.new_call_id(),
                "name": d.name, "arguments": "", "status": "in_progress"})
        if d.arguments:
            item["arguments"] += d.arguments
            self.event("response.function_call_arguments.delta", delta=d.arguments,
                       **self._where(item))

    def close(self, status: str = "completed") -> None:
        item, self._open = self._open, None
        if item is None:
            return
        item["status"] = status
        where = self._where(item)
        if item["type"] == "message":
            part = item["content"][0]
            self.event("response.output_text.done", content_index=0, text=part["text"],
                       logprobs=[], **where)
            self.event("response.content_part.done", content_index=0, part=part, **where)
        elif item["type"] == "reasoning":
            part = item["content"][0]
            self.event("response.reasoning_text.done", content_index=0, text=part["text"],
                       **where)
            self.event("response.content_part.done", content_index=0, part=part, **where)
        else:
            self.event("response.function_call_arguments.done", arguments=item["arguments"],
                       name=item["name"], **where)
        self.event("response.output_item.done", output_index=where["output_index"], item=item)

    def finish(self, incomplete: bool) -> None:
        """Close the last item; an answer with neither text nor calls still gets its (empty)
        message, as OpenAI's does."""
        if not any(i["type"] in ("message", "function_call") for i in self.items):
            self.close()
            self._start({"id": new_id("msg"), "type": "message", "role": "assistant",
                         "status": "in_progress",
                         "content": [{"type": "output_text", "text": "", "annotations": [],
                                      "logprobs": []}]})
        self.close("incomplete" if incomplete else "completed")

    # --- what the conversation keeps ----------------------------------------------------------------
    def answer_text(self) -> str:
        return "".join(i["content"][0]["text"] for i in self.items if i["type"] == "message")

    def has_calls(self) -> bool:
        return bool(self._call_items)

    def reasoning_text(self) -> str:
        return "".join(i["content"][0]["text"] for i in self.items if i["type"] == "reasoning")

    def assistant_message(self) -> dict:
        """This answer as a chat message of the history (reasoning left out)."""
        msg: dict[str, Any] = {"role": "assistant", "content": self.answer_text()}
        calls = [{"id": i["call_id"], "type": "function",
                  "function": {"name": i["name"], "arguments": i["arguments"]}}
                 for i in self.items if i["type"] == "function_call"]
        if calls:
            msg["tool_calls"] = calls
        return msg
