"""ForwardBatch: everything one model forward needs, as tensors over the whole batch.

The scheduler builds it (one per step); the model and the attention backend only read it.
T = total new tokens in the step, B = requests in the step, N = rows whose logits are needed.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Optional

import torch


class ForwardMode(enum.Enum):
    EXTEND = "extend"  # prefill: new tokens attend to the cached prefix and to each other
    DECODE = "decode"  # one new token per request


@dataclass
class ForwardBatch:
    mode: ForwardMode
    input_ids: torch.Tensor  # (T,) int64
    positions: torch.Tensor  # (T,) int64 absolute positions
    out_cache_loc: torch.Tensor  # (T,) int64 KV slots the new tokens' K/V are written to
    req_pool_indices: torch.Tensor  # (B,) int64 rows of req_to_token
    seq_lens: torch.Tensor  # (B,) int64 tokens per request after this step (prefix + new)
    logits_indices: torch.Tensor  # (N,) int64 rows of the (T, hidden) output to project to logits
    # host-side copies the torch-native backend loops over (no device sync needed to read them)
    seq_lens_cpu: list[int] = field(default_factory=list)
    extend_prefix_lens_cpu: list[int] = field(default_factory=list)  # (B,) EXTEND only
    extend_lens_cpu: list[int] = field(default_factory=list)  # (B,) EXTEND only
    # EXTEND only: the last `num_decode_tail` requests are plain decodes (one token each) mixed
    # into the step, so a backend may run them as one batched decode
    num_decode_tail: int = 0
    attn_backend: Any = None  # the AttentionBackend running this forward
    # attention backends stash per-batch metadata (gather indices, masks) here, once per forward
    attn_metadata: Optional[Any] = None
    # DECODE only: groups of rows that share a cached prefix (attention/shared_prefix.py), read
    # once per group; None runs plain decode attention
    prefix_groups: Optional[Any] = None
    # EXTEND only, None unless a request of the batch has images: (first row of its tokens in
    # the batch, its first position computed, its number of tokens, its MultimodalInputs) each
    mm_inputs: Optional[list] = None
    # EAGLE-3 (speculative/eagle3.py): the target keeps the hidden states after these layers
    # (x + residual at each layer's output, 0-based) for every row; () captures nothing
    capture_layers: tuple = ()
    # (T, len(capture_layers) * hidden) those hidden states, concatenated in capture order
    aux_hidden: Optional[torch.Tensor] = None
    # DECODE, optional: (4, B) int64 rows input_ids, positions, req_pool_indices, seq_lens (the
    # same values as those fields): a decode graph's replay copies them in one op, not four
    graph_inputs: Optional[torch.Tensor] = None

    @property
    def batch_size(self) -> int:
        return int(self.req_pool_indices.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])
