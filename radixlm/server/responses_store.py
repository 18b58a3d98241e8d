"""Stored responses (`store: true`, OpenAI's default): what GET /v1/responses/{id} returns and
what `previous_response_id` continues from, bounded by --max-stored-responses (least recently
used first out; 0 stores nothing).

A continuation needs the conversation as chat messages (to render the next prompt) and, so that
the radix cache serves the whole history, the exact token ids the previous turn ran on: its
prompt and its output, as generated. Re-tokenizing the rendered history would give other ids
wherever the model's own tokenization of its answer differs from the tokenizer's (always, for a
sampled answer), and the cache would then miss from the first such token on. The ids are kept as
a 4-byte array (a Python list of ints costs ~9x that).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional

# Where the previous answer sits in a rendered continuation: private-use characters no user
# types and no chat template writes, so finding it locates the answer exactly.
ANSWER_MARK = "\ue000radixlm-previous-answer\ue001"


def text_digest(text: str) -> bytes:
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()


@dataclass
class Splice:
    """What lets the next turn reuse this turn's token ids: the ids of prompt + answer (without
    the stop token, which the template writes again), and the rendered prompt they came from
    (its length and digest: the next render must start with exactly this text)."""

    token_ids: array
    prompt_len: int  # characters of the rendered prompt
    prompt_digest: bytes
    context: str  # instructions, tools and template switches: the next turn must match them


@dataclass
class StoredResponse:
    response: dict  # the Response object as it was returned
    messages: list[dict]  # the conversation (chat messages, without instructions), this answer included
    splice: Optional[Splice]  # None: the next turn renders and tokenizes the whole history


class ResponseStore:
    def __init__(self, capacity: int):
        self.capacity = max(0, capacity)
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def put(self, rid: str, item: StoredResponse) -> bool:
        """False when nothing is stored (capacity 0)."""
        if self.capacity == 0:
            return False
        self._items[rid] = item
        self._items.move_to_end(rid)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)
        return True

    def get(self, rid: str) -> Optional[StoredResponse]:
        item = self._items.get(rid)
        if item is not None:
            self._items.move_to_end(rid)
        return item

    def delete(self, rid: str) -> bool:
        return self._items.pop(rid, None) is not None
