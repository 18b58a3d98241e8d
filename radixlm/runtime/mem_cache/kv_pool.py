"""Token-granular KV pool: per layer, K and V buffers indexed by slot (page size 1).

Slot 0 is scratch (padding writes land there); real slots are 1..capacity, handed out by
`TokenSlotAllocator`. Shapes: k_buffers[layer], v_buffers[layer]: (capacity + 1, H_kv, D).
"""

from __future__ import annotations

import torch


class KVPool:
    def __init__(self, capacity: int, num_layers: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: str | torch.device):
        self.capacity = capacity
        self.num_layers = num_layers
        self.dtype = dtype
        shape = (capacity + 1, num_kv_heads, head_dim)
        self.k_buffers = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_buffers = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * num_kv_heads * head_dim * elem

    def write(self, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """loc: (T,) slots; k, v: (T, H_kv, D)."""
        self.k_buffers[layer].index_copy_(0, loc, k.to(self.dtype))
        self.v_buffers[layer].index_copy_(0, loc, v.to(self.dtype))
