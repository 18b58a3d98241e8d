"""Attention backend contract.

A backend computes attention for one layer of one `ForwardBatch`:
- `init_forward_metadata(fb)` runs once per forward, before layer 0, and may precompute anything
  shared by all layers (gather indices, masks) into `fb.attn_metadata`.
- `forward(q, k, v, layer, fb)` first writes the new tokens' K/V into the KV pool at
  `fb.out_cache_loc`, then returns attention of each new token over its request's tokens
  `req_to_token[req_pool_idx, :seq_len]` (cached prefix + new tokens), causal within the request.
  Shapes: q (T, Hq, D), k/v (T, Hkv, D) -> (T, Hq, D). Hq is a multiple of Hkv (GQA).
Backends must give the same numbers as `TorchNativeAttention` (the reference) up to dtype rounding.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from radixlm.runtime.executor.forward_batch import ForwardBatch
from radixlm.runtime.mem_cache.kv_pool import KVPool


class AttentionBackend(ABC):
    def __init__(self, kv_pool: KVPool, req_to_token: torch.Tensor, scale: float, *,
                 max_batch_size: int = 256, max_context_len: int = 8192):
        self.kv_pool = kv_pool
        self.req_to_token = req_to_token  # (max_reqs, max_context) int64
        self.scale = scale
        # upper bounds a backend may size persistent scratch buffers by (CUDA graphs need them)
        self.max_batch_size = max_batch_size
        self.max_context_len = max_context_len

    @abstractmethod
    def init_forward_metadata(self, fb: ForwardBatch) -> None: ...

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
                fb: ForwardBatch) -> torch.Tensor: ...
