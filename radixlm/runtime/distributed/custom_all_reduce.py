"""The TP all-reduce for small messages within one node: torch symmetric memory, no NCCL.

Why: a decode step of the Llama-3.1-8B shape at TP=2 makes 64 all-reduces of one (B, 4096) bf16
activation each (8 KB at batch 1). NCCL's general path costs tens of microseconds per call at
that size, a large part of a ~2 ms step; a batch-1 TP=2 step ran only 1.09x faster than TP=1
(2 x H200). Here every rank's buffer is mapped into every other rank's address space (torch's
symmetric memory: CUDA IPC / P2P over NVLink), and `two_shot_all_reduce_` sums in place in one
kernel: each rank reduces its share of the elements by reading the peers' buffers, then every
rank reads the reduced shares (a reduce-scatter plus an all-gather through loads), with
barriers on the signal pads at both ends, so a buffer is never overwritten while a peer still
reads it. It runs inside CUDA graphs (its barriers reset their own flags).

NVLink multicast (`multimem_*` operations, NVLS) is never used: these machines keep it off
(NCCL_NVLS_ENABLE=0); P2P loads and stores only.

Taken for CUDA bf16 / fp32 tensors up to `max_bytes` (rank-symmetric shapes, as TP's are);
anything else (another dtype, larger messages, several nodes) goes to NCCL. With two ranks
the sum is a + b rounded once, as NCCL's, so greedy tokens are the same with it on and off.
`--disable-custom-all-reduce` turns it off. If symmetric memory cannot be set up (no P2P between
the GPUs, an older torch), one warning names the reason and NCCL serves every call.
"""

from __future__ import annotations

import logging
import os
from typing import Optional

import torch

logger = logging.getLogger(__name__)

MAX_BYTES = 8 << 20  # per rank: decode and small extends; larger messages are NCCL's (bandwidth)


DTYPES = (torch.bfloat16, torch.float32)


class SymmMemAllReduce:
    def __init__(self, group, device: torch.device, max_bytes: int = MAX_BYTES):
        import torch.distributed._symmetric_memory as symm_mem

        self.symm_mem = symm_mem
        self.group_name = group.group_name
        enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
        if enable is not None:  # needed by older torch; harmless where it is a no-op
            enable(self.group_name)
        # bytes, viewed as the call's dtype: one buffer serves bf16 activations and fp32 sums
        self.buffer = symm_mem.empty(max_bytes, dtype=torch.uint8, device=device)
        self.handle = None
        # RADIXLM_CUSTOM_ALL_REDUCE_OP=one_shot: one_shot_all_reduce (each rank reads every
        # peer's whole buffer; out of place) instead of two_shot_all_reduce_ (in place)
        self.one_shot = os.environ.get("RADIXLM_CUSTOM_ALL_REDUCE_OP", "two_shot") == "one_shot"

    def rendezvous(self) -> None:
        """Map the peers' buffers (collective: every rank, same order)."""
        self.handle = self.symm_mem.rendezvous(self.buffer, self.group_name)

    def takes(self, x: torch.Tensor) -> bool:
        nbytes = x.numel() * x.element_size()  # the kernels move 4-byte words
        return x.is_cuda and x.dtype in DTYPES and nbytes % 4 == 0 and nbytes <= self.buffer.numel()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks of x (any shape); the result in x's shape (x itself when contiguous)."""
        buf = self.buffer.view(x.dtype)[: x.numel()]
        buf.copy_(x.reshape(-1))
        if self.one_shot:
            res = torch.ops.symm_mem.one_shot_all_reduce(buf, "sum", self.group_name)
        else:
            torch.ops.symm_mem.two_shot_all_reduce_(buf, "sum", self.group_name)
            res = buf
        out = x if x.is_contiguous() else torch.empty_like(x, memory_format=torch.contiguous_format)
        out.view(-1).copy_(res)  # out of the shared buffer before the next call reuses it
        return out


def try_create(group, device: torch.device) -> Optional[SymmMemAllReduce]:
    """The custom all-reduce for this TP group, or None (one warning) where it cannot run. Every
    rank calls it: the ranks first agree over NCCL that each could allocate its buffer, so a rank
    that cannot never leaves the others waiting in the (collective) rendezvous."""
    import torch.distributed as dist

    if device.type != "cuda":
        return None
    ar, why = None, ""
    try:
        ar = SymmMemAllReduce(group, device)
    except Exception as e:  # noqa: BLE001 - any setup failure means NCCL for every call
        why = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
    ok = torch.tensor([1 if ar is not None else 0], dtype=torch.int32, device=device)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)
    if int(ok.item()) == 1:
        try:
            ar.rendezvous()
            return ar
        except Exception as e:  # noqa: BLE001
            why = f"rendezvous: {type(e).__name__}: {str(e).splitlines()[0][:300]}"
    logger.warning("custom all-reduce unavailable, NCCL serves every TP all-reduce: %s",
                   why or "another rank could not set it up")
    return None
