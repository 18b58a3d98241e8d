"""Request -> token-slot table: row r lists, in order, the KV slots of request r's tokens."""

from __future__ import annotations

import torch


class ReqToTokenPool:
    def __init__(self, max_reqs: int, max_context_len: int, device: str | torch.device = "cpu",
                 spare_rows: int = 0):
        self.max_reqs = max_reqs  # rows handed out to requests
        self.max_context_len = max_context_len
        # (max_reqs + 1 + spare_rows, max_context_len) int64 slot indices; unused entries point
        # at scratch slot 0. Row max_reqs is never handed out and stays all zeros: padded rows
        # of a batch (CUDA-graph buckets) read it, so they attend to the scratch slot only.
        # The `spare_rows` after it are a speculative draft tree's scratch rows (each tree
        # node's own history + path, rewritten every step: speculative/tree_verify.py).
        self.req_to_token = torch.zeros(max_reqs + 1 + spare_rows, max_context_len,
                                        dtype=torch.int64, device=device)
        self.pad_row = max_reqs
        self.spare_rows = list(range(max_reqs + 1, max_reqs + 1 + spare_rows))
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
