"""Token-granular KV pool: per layer, K and V buffers indexed by slot (page size 1).

Slot 0 is scratch (padding writes land there); real slots are 1..capacity, handed out by
`TokenSlotAllocator`. Shapes: k_buffers[layer], v_buffers[layer]: (capacity + 1, H_kv, D).
"""

from __future__ import annotations

import math
import mmap

import torch


def zeros_lazy(shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
    """A zero tensor. On the CPU it is backed by an anonymous mmap: the kernel maps zeroed pages
    on first write, so a pool of GiBs costs no start-up time and only the memory tokens actually
    use (torch.zeros writes every byte up front: seconds for the default 4 GiB CPU pool)."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    numel = math.prod(shape)
    if numel == 0:
        return torch.zeros(shape, dtype=dtype)
    buf = mmap.mmap(-1, numel * torch.empty((), dtype=dtype).element_size())
    return torch.frombuffer(buf, dtype=dtype).view(shape)  # the tensor keeps buf alive


class KVPool:
    def __init__(self, capacity: int, num_layers: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: str | torch.device):
        self.capacity = capacity
        self.num_layers = num_layers
        self.dtype = dtype
        shape = (capacity + 1, num_kv_heads, head_dim)
        self.k_buffers = [zeros_lazy(shape, dtype, device) for _ in range(num_layers)]
        self.v_buffers = [zeros_lazy(shape, dtype, device) for _ in range(num_layers)]

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * num_kv_heads * head_dim * elem

    def write(self, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """loc: (T,) slots; k, v: (T, H_kv, D)."""
        self.k_buffers[layer].index_copy_(0, loc, k.to(self.dtype))
        self.v_buffers[layer].index_copy_(0, loc, v.to(self.dtype))
