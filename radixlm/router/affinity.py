"""Which worker holds a stored /v1/responses response: the worker that created it (each worker
keeps its own store, and its radix cache holds that conversation's KV), so a continuation
(`previous_response_id`) and GET / DELETE /v1/responses/{id} must go there.

Workers name the response in a header (`x-radixlm-response-id`, streamed responses too, before
their first byte), so the router learns the owner without reading bodies. The map is bounded
(least recently used out): an id it no longer knows is looked up on every worker (retrieval,
deletion) or routed by the policy (a continuation, which then finds no stored response unless
the policy picks its owner; the cache-aware policy usually does, by the shared prefix).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Optional

from radixlm.server.responses_api import RESPONSE_ID_HEADER

RESPONSES_PATH = "/v1/responses"


class ResponseOwners:
    def __init__(self, capacity: int = 1 << 16):
        self.capacity = capacity
        self._owner: OrderedDict[str, str] = OrderedDict()

    def learn(self, headers, worker_url: str) -> None:
        rid = headers.get(RESPONSE_ID_HEADER)
        if rid:
            self._owner[rid] = worker_url
            self._owner.move_to_end(rid)
            while len(self._owner) > self.capacity:
                self._owner.popitem(last=False)

    def owner(self, rid: Optional[str]) -> Optional[str]:
        url = self._owner.get(rid) if rid else None
        if url is not None:
            self._owner.move_to_end(rid)
        return url

    def forget(self, rid: str) -> None:
        self._owner.pop(rid, None)


def stored_response_id(method: str, path: str, body: Any) -> Optional[str]:
    """The stored response a request needs: the previous one of a POST /v1/responses, or the
    one a GET / DELETE /v1/responses/{id} names."""
    path = path.rstrip("/")
    if path == RESPONSES_PATH and method == "POST" and isinstance(body, dict):
        rid = body.get("previous_response_id")
        return rid if isinstance(rid, str) else None
    if path.startswith(RESPONSES_PATH + "/") and method in ("GET", "DELETE"):
        rid = path[len(RESPONSES_PATH) + 1:]
        return rid if rid and "/" not in rid else None
    return None
