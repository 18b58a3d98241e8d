"""Request -> token-slot table: row r lists, in order, the KV slots of request r's tokens."""

from __future__ import annotations

import torch


class ReqToTokenPool:
    def __init__(self, max_reqs: int, max_context_len: int, device: str | torch.device = "cpu"):
        self.max_reqs = max_reqs
        self.max_context_len = max_context_len
        # (max_reqs, max_context_len) int64 slot indices; unused entries point at scratch slot 0
        self.req_to_token = torch.zeros(max_reqs, max_context_len, dtype=torch.int64, device=device)
        self._free_rows = list(range(max_reqs))

    def available_size(self) -> int:
        return len(self._free_rows)

    def alloc(self) -> int | None:
        return self._free_rows.pop() if self._free_rows else None

    def free(self, row: int) -> None:
        self._free_rows.append(row)

    def write(self, row: int, start: int, slots: torch.Tensor) -> None:
        self.req_to_token[row, start : start + slots.numel()] = slots

    def clear(self) -> None:
        self._free_rows = list(range(self.max_reqs))
