"""Attention backend contract.

A backend computes attention for one layer of one `ForwardBatch`:
- `init_forward_metadata(fb)` runs once per forward, before layer 0, and may precompute anything
  shared by all layers (gather indices, masks) into `fb.attn_metadata`.
- `forward(q, k, v, layer, fb)` first writes the new tokens' K/V into the KV pool at
  `fb.out_cache_loc`, then returns attention of each new token over its request's tokens
  `req_to_token[req_pool_idx, :seq_len]` (cached prefix + new tokens), causal within the request.
  Shapes: q (T, Hq, D), k/v (T, Hkv, D) -> (T, Hq, D). Hq is a multiple of Hkv (GQA).
  A backend with `accepts_stored_kv = True` also takes k = v = None: the caller has already
  written them at `fb.out_cache_loc` (CUDA: the rotary kernel stores them in the same launch).
- What the scores are (`AttentionSpec`, given at construction, fixed for the backend's life):
  score(q, k) = scale * q.k, then, with a logit soft-cap c, c * tanh(score / c) (before the mask);
  a layer with a sliding window W sees, from the query at absolute position p, only the keys at
  positions in (p - W, p] (HF's `kv_idx > q_idx - sliding_window`: W keys, itself included).
  The pool keeps every token's K/V (no eviction), so the radix cache shares prefixes as always;
  the window only bounds which keys a query reads.
Backends must give the same numbers as `TorchNativeAttention` (the reference) up to dtype rounding.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from radixlm.runtime.executor.forward_batch import ForwardBatch
from radixlm.runtime.mem_cache.kv_pool import KVPool


@dataclass(frozen=True)
class AttentionSpec:
    """What a model's attention computes beyond scaled causal softmax; the model provides it
    (`attention_spec(cfg)` on the model class), the runner hands it to the backend."""

    scale: float  # softmax scale: head_dim**-0.5 for most, query_pre_attn_scalar**-0.5 for Gemma
    windows: tuple[Optional[int], ...] = ()  # per layer, None = full; () = no windowed layer
    logit_softcap: Optional[float] = None  # Gemma 2: c * tanh(score / c) before the softmax


class AttentionBackend(ABC):
    # a backend whose kernels read a prefix shared by a decode batch once per group sets this
    # (attention/shared_prefix.py); __init__ turns it off when any layer has a window
    supports_shared_prefix = False

    def __init__(self, kv_pool: KVPool, req_to_token: torch.Tensor, scale: float, *,
                 max_batch_size: int = 256, max_context_len: int = 8192,
                 windows: Optional[Sequence[Optional[int]]] = None,
                 logit_softcap: Optional[float] = None):
        self.kv_pool = kv_pool
        self.req_to_token = req_to_token  # (max_reqs, max_context) int64
        self.scale = scale
        # upper bounds a backend may size persistent scratch buffers by (CUDA graphs need them)
        self.max_batch_size = max_batch_size
        self.max_context_len = max_context_len
        # windows[layer]: an int per layer for the kernels, 0 = full attention. A window that
        # covers every position a request can reach is full attention (and runs as such).
        n_layers = kv_pool.num_layers
        wins = list(windows) if windows else [None] * n_layers
        if len(wins) != n_layers:
            raise ValueError(f"{len(wins)} sliding windows for {n_layers} layers")
        for w in wins:
            if w is not None and (not isinstance(w, int) or w < 1):
                raise ValueError(f"sliding window must be a positive int or None (got {w!r})")
        self.windows: tuple[int, ...] = tuple(
            0 if w is None or w >= max_context_len else int(w) for w in wins)
        self.has_window = any(self.windows)
        if logit_softcap is not None and not logit_softcap > 0:
            raise ValueError(f"logit_softcap must be > 0 or None (got {logit_softcap!r})")
        self.logit_softcap: float = float(logit_softcap or 0.0)  # 0.0 = none
        if self.has_window:
            # Shared-prefix decode is planned only for models without windowed layers: a windowed
            # layer reads at most W keys per request anyway (little left to share), and its
            # per-member window cut of the shared prefix would need per-query key ranges in
            # the group kernels. Forward still runs a windowed layer plainly if handed groups.
            self.supports_shared_prefix = False

    @abstractmethod
    def init_forward_metadata(self, fb: ForwardBatch) -> None: ...

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
                fb: ForwardBatch) -> torch.Tensor: ...
