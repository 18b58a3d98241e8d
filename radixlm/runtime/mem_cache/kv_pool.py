"""Token-granular KV pools, indexed by slot (page size 1).

Slot 0 is scratch (padding writes land there); real slots are 1..capacity, handed out by
`TokenSlotAllocator`. Two kinds (`kind`), one per attention family:
- `KVPool` ("mha"): per layer, K and V buffers: k_buffers[layer], v_buffers[layer]:
  (capacity + 1, H_kv, D), each contiguous. They are views of one tensor `kv` (layers, 2, capacity
  + 1, H_kv, D), so that `slot_view()` can index every layer's K and V of a slot at once: the host
  pool's copies gather or scatter a run of slots with one kernel instead of one per layer.
- `MLAKVPool` ("mla", DeepSeek's multi-head latent attention): per layer ONE buffer of the
  compressed latent, latent_buffers[layer]: (capacity + 1, 1, kv_lora_rank + rope_dim): the
  normalized c_kv (kv_lora_rank) then the rotated shared rope key (rope_dim). K and V of every
  head are computed from it; nothing per head is stored. Code written for K/V heads (the C++ and
  Triton MHA kernels, the host pool, speculative drafts) does not take this pool: the runner
  refuses those features with MLA (attention/mla_backend.check_mla_args).
The allocator, req_to_token and the radix cache only see slots, so they work on either pool.
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
    kind = "mha"

    def __init__(self, capacity: int, num_layers: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: str | torch.device):
        self.capacity = capacity
        self.num_layers = num_layers
        self.dtype = dtype
        self.kv = zeros_lazy((num_layers, 2, capacity + 1, num_kv_heads, head_dim), dtype, device)
        self.k_buffers = [self.kv[layer, 0] for layer in range(num_layers)]
        self.v_buffers = [self.kv[layer, 1] for layer in range(num_layers)]

    def slot_view(self) -> torch.Tensor:
        """(capacity + 1, layers, 2, H_kv, D): the pool indexed by slot first (a strided view)."""
        return self.kv.permute(2, 0, 1, 3, 4)

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * num_kv_heads * head_dim * elem

    def write(self, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """loc: (T,) slots; k, v: (T, H_kv, D)."""
        self.k_buffers[layer].index_copy_(0, loc, k.to(self.dtype))
        self.v_buffers[layer].index_copy_(0, loc, v.to(self.dtype))


class MLAKVPool:
    kind = "mla"

    def __init__(self, capacity: int, num_layers: int, kv_lora_rank: int, rope_dim: int,
                 dtype: torch.dtype, device: str | torch.device):
        self.capacity = capacity
        self.num_layers = num_layers
        self.dtype = dtype
        self.kv_lora_rank, self.rope_dim = kv_lora_rank, rope_dim
        shape = (capacity + 1, 1, kv_lora_rank + rope_dim)  # one latent "head" per token
        self.latent_buffers = [zeros_lazy(shape, dtype, device) for _ in range(num_layers)]

    @staticmethod
    def bytes_per_token(num_layers: int, kv_lora_rank: int, rope_dim: int,
                        dtype: torch.dtype) -> int:
        """The latent only: (kv_lora_rank + rope_dim) values per layer (DeepSeek-V3: 576 x 61
        layers x 2 bytes = 70,272 bytes per token in bf16, vs 128 heads x (192 + 128) x 2 x 61 =
        4,997,120 for the expanded K/V)."""
        elem = torch.empty((), dtype=dtype).element_size()
        return num_layers * (kv_lora_rank + rope_dim) * elem

    def write(self, layer: int, loc: torch.Tensor, latent: torch.Tensor) -> None:
        """loc: (T,) slots; latent: (T, kv_lora_rank + rope_dim)."""
        self.latent_buffers[layer].index_copy_(0, loc, latent.to(self.dtype).unsqueeze(1))
