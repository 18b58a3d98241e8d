"""L2: the host-memory KV pool, and the copies between it and the device pool (L1).

`HostKVPool.kv` is (capacity + 1, layers, 2 [K, V], KV heads, head dim) in the device pool's dtype,
indexed by host slot (slot 0 unused, as on the device); its slots come from its own
`TokenSlotAllocator`. Slot-major: a slot's K and V of every layer lie together, so a run of
consecutive host slots is ONE contiguous block (run length x token_bytes), the unit a copy moves.
(It was layer-major until 2026-11-27: a run cost 2 x layers copies of a few hundred KB each, and an
H200 host loaded at ~13 GB/s effective where PCIe 5 moves ~50 GB/s in large copies.) On the CPU it
is a second RAM pool (lazily mapped, like the device pool); on CUDA it is pinned, so copies are
DMA. Store pages (file format 3) are the same layout: a page's bytes are its host rows.

The device pool stays layer-major (its kernels read one layer's K or V at a time); KVPool keeps it
in one tensor so that `slot_view()` gathers or scatters a run of slots of all layers in one kernel.

The copies between the tiers: kv_mover.py.
"""

from __future__ import annotations

from typing import Optional

import torch

from radixlm.runtime.mem_cache.allocator import TokenSlotAllocator
from radixlm.runtime.mem_cache.kv_pool import KVPool, zeros_lazy


# A copy whose host slots form at most this many runs of consecutive slots moves each run by DMA
# straight from / to the pinned pool (one copy a run); a more scattered one goes through a pinned
# staging block gathered (or landed) on the CPU, then one DMA.
MAX_DIRECT_RUNS = 8
# ... or more runs when they average at least this many bytes: a DMA costs ~5-10 us to issue and
# set up, the CPU gather costs every byte once more on the scheduler's thread (~8 GB/s: 64 KiB
# ~8 us; both estimates, not measured here). An 8B model's token is 128 KiB, so its runs always
# go direct.
MIN_RUN_BYTES = 64 << 10


def direct_runs(idx: torch.Tensor, token_bytes: int) -> Optional[list[tuple[int, int, int]]]:
    """idx's runs (contiguous_runs) when a copy of them by DMA beats gathering them first."""
    return contiguous_runs(idx, max(MAX_DIRECT_RUNS, idx.numel() * token_bytes // MIN_RUN_BYTES))


def contiguous_runs(idx: torch.Tensor, max_runs: int) -> Optional[list[tuple[int, int, int]]]:
    """idx (n,) host slots as runs of consecutive slots: [(offset in idx, first slot, length)],
    or None when there are more than max_runs."""
    n = idx.numel()
    if n == 0:
        return []
    starts = (torch.nonzero(idx[1:] - idx[:-1] != 1).flatten() + 1).tolist()
    if len(starts) + 1 > max_runs:
        return None
    starts = [0] + starts
    firsts = idx[starts].tolist()
    return [(a, first, b - a) for a, b, first in zip(starts, starts[1:] + [n], firsts)]


def as_words(t: torch.Tensor) -> torch.Tensor:
    """t's bits as 8-byte words along its last dim, when its row bytes allow: a gather or scatter
    kernel moves one element a thread, so bf16 KV copied as int64 takes 4x fewer (bit-exact)."""
    if (t.element_size() < 8 and (t.shape[-1] * t.element_size()) % 8 == 0
            and t.data_ptr() % 8 == 0 and t.stride(-1) == 1):
        return t.view(torch.int64)
    return t


def split_runs(runs: list[tuple[int, int, int]], lo: int, hi: int) -> list[tuple[int, int, int]]:
    """The parts of runs (offset, first slot, length) inside offsets [lo, hi), offsets from lo."""
    out = []
    for off, first, length in runs:
        a, b = max(off, lo), min(off + length, hi)
        if a < b:
            out.append((a - lo, first + a - off, b - a))
    return out


class HostKVPool:
    def __init__(self, capacity: int, device_pool: KVPool, device: torch.device):
        if getattr(device_pool, "kind", "mha") != "mha":
            raise ValueError("the host pool holds K/V heads; an MLA latent pool is not supported")
        heads, head_dim = device_pool.k_buffers[0].shape[1:]
        self.num_layers = device_pool.num_layers
        self.dtype = device_pool.dtype
        self.capacity = capacity
        self.pinned = device.type == "cuda"
        shape = (capacity + 1, self.num_layers, 2, heads, head_dim)
        self.kv = (torch.empty(shape, dtype=self.dtype, pin_memory=True) if self.pinned
                   else zeros_lazy(shape, self.dtype, "cpu"))
        self.allocator = TokenSlotAllocator(capacity, "cpu")
        self.token_bytes = KVPool.bytes_per_token(self.num_layers, heads, head_dim, self.dtype)

        self.words = as_words(self.kv)  # the same memory as 8-byte words (see as_words)

    def block_shape(self, n: int) -> tuple[int, ...]:
        """Shape of n tokens' KV gathered out of the pool (and of a stored page): (n, L, 2, H, D)."""
        return (n,) + tuple(self.kv.shape[1:])

    def rows(self, idx: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """(n, L, 2, H, D) copy of host slots idx (into `out` when given)."""
        if out is None:
            return self.words.index_select(0, idx).view(self.dtype)
        words = as_words(out)
        if words.dtype == self.words.dtype:
            torch.index_select(self.words, 0, idx, out=words)
        else:
            torch.index_select(self.kv, 0, idx, out=out)
        return out

    def put_rows(self, idx: torch.Tensor, block: torch.Tensor) -> None:
        """block (n, L, 2, H, D) -> host slots idx."""
        words = as_words(block)  # (a page read into a bytearray may not be 8-byte aligned)
        if words.dtype == self.words.dtype:
            self.words.index_copy_(0, idx, words)
        else:
            self.kv.index_copy_(0, idx, block)
