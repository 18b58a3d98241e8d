"""The tensor-parallel process group and the two collectives TP needs.

One process per rank; all ranks of the world form the one TP group (tp_size = world size, over
`nnodes` nodes: ranks node_rank * (tp_size // nnodes) ...). Backend: nccl on CUDA, gloo on the
CPU (so CI tests TP without GPUs). Layers get the `TPGroup` at construction (no hidden global
reads in the forward); `get_tp_group()` is the process's group once `init_distributed` ran.

Collectives:
- all_reduce(x): sum of the ranks' partial outputs (after o_proj, down_proj, the vocab-parallel
  embedding). gloo on half dtypes sums in fp32 (gloo's bf16 support varies by build; fp32 sums
  are also the better numerics), then rounds once.
- all_gather(x, dim): the ranks' slices side by side (the vocab-parallel LM head's logits).
- broadcast(x): rank 0's batch payload to the workers (batch_sync), in stream order.
- broadcast_host(x): a host tensor over a gloo group of its own (`host_group`), for what a
  worker must read on its host (batch_sync's headers): over NCCL that read would wait for the
  GPU. Its timeout is HOST_WAIT_TIMEOUT: an idle worker waits there for the next batch for as
  long as the server idles (the TP group's own timeout, 300 s by default, would end an idle
  server's workers).
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TPGroup:
    rank: int
    size: int
    group: Optional[object] = None  # a torch.distributed ProcessGroup; None when size == 1
    backend: str = "gloo"
    fast: Optional[object] = None  # custom_all_reduce.SymmMemAllReduce (one node, CUDA) or None
    host_group: Optional[object] = None  # gloo ProcessGroup for broadcast_host

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks; returns a tensor of x's shape and dtype (x may be reused)."""
        if self.size == 1:
            return x
        if self.fast is not None and self.fast.takes(x):
            return self.fast(x)
        if self.backend == "gloo" and x.dtype in (torch.bfloat16, torch.float16):
            acc = x.float()
            dist.all_reduce(acc, group=self.group)
            return acc.to(x.dtype)
        x = x.contiguous()
        dist.all_reduce(x, group=self.group)
        return x

    def all_reduce_async(self, x: torch.Tensor):
        """all_reduce started, not waited for: returns (result, wait). The result is valid
        once wait() returned (CUDA: the calling stream waits for the collective, whose own
        stream ran meanwhile beside the kernels launched after it). Messages the custom
        all-reduce takes are reduced at once (wait is then a no-op)."""
        if self.size == 1 or (self.fast is not None and self.fast.takes(x)):
            return self.all_reduce(x), _no_wait
        if self.backend == "gloo" and x.dtype in (torch.bfloat16, torch.float16):
            acc = x.float()
            work = dist.all_reduce(acc, group=self.group, async_op=True)
            out = torch.empty_like(x)

            def wait():
                work.wait()
                out.copy_(acc)
            return out, wait
        x = x.contiguous()
        work = dist.all_reduce(x, group=self.group, async_op=True)
        return x, work.wait

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """(..., n, ...) per rank -> (..., size * n, ...), rank r's slice at [r * n, (r+1) * n)."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=dim)

    def min_int(self, value: int, device: torch.device | str = "cpu") -> int:
        """The smallest `value` over the ranks (e.g. a KV capacity every rank can hold)."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """In place: every rank's x becomes rank `src`'s (same shape and dtype on all ranks)."""
        if self.size > 1:
            dist.broadcast(x, src=src, group=self.group)
        return x

    def broadcast_host(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """As broadcast, for a CPU tensor, over the host group: returns once rank `src`'s data
        is here, whatever the GPUs are doing."""
        if self.size > 1:
            dist.broadcast(x, src=src, group=self.host_group)
        return x


SINGLE = TPGroup(rank=0, size=1)
# a worker waits for rank 0's next batch in broadcast_host for as long as the server idles
HOST_WAIT_TIMEOUT = timedelta(days=365)
_TP: TPGroup = SINGLE


def default_backend(device: torch.device | str) -> str:
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def init_distributed(tp_size: int, tp_rank: int, init_method: str,
                     device: torch.device | str = "cpu", timeout_s: float = 300.0,
                     custom_all_reduce: bool = False) -> TPGroup:
    """Join the TP process group (every rank calls this with the same tp_size and init_method,
    e.g. tcp://host:port or file:///path) and make it this process's group. Idempotent for the
    same (rank, size). custom_all_reduce (CUDA, one node): small all-reduces through symmetric
    memory (custom_all_reduce.py) instead of NCCL."""
    global _TP
    if tp_size < 1 or not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank {tp_rank} is not in [0, tp_size={tp_size})")
    if tp_size == 1:
        _TP = SINGLE
        return _TP
    if dist.is_initialized():
        if (dist.get_rank(), dist.get_world_size()) != (tp_rank, tp_size):
            raise RuntimeError(f"torch.distributed already initialized as rank "
                               f"{dist.get_rank()}/{dist.get_world_size()}, not {tp_rank}/{tp_size}")
    else:
        backend = default_backend(device)
        if backend == "nccl":
            # one GPU per rank of the node: cuda:<local rank> unless the device names one (ranks
            # are node-major, so the local rank is tp_rank modulo the node's GPUs in use)
            index = torch.device(device).index
            if index is None:
                index = int(os.environ.get("LOCAL_RANK", tp_rank % torch.cuda.device_count()))
            torch.cuda.set_device(index)
        dist.init_process_group(backend, init_method=init_method, world_size=tp_size,
                                rank=tp_rank, timeout=timedelta(seconds=timeout_s))
    fast = None
    if custom_all_reduce and dist.get_backend() == "nccl":
        from radixlm.runtime.distributed import custom_all_reduce as car

        fast = car.try_create(dist.group.WORLD, torch.device("cuda", torch.cuda.current_device()))
    # every rank creates it, in the same order (a collective); a dead peer still ends a wait
    # at once (gloo sees the closed connection), so the long timeout only covers idling
    host_group = dist.new_group(backend="gloo", timeout=HOST_WAIT_TIMEOUT)
    _TP = TPGroup(rank=tp_rank, size=tp_size, group=dist.group.WORLD,
                  backend=dist.get_backend(), fast=fast, host_group=host_group)
    return _TP


def get_tp_group() -> TPGroup:
    return _TP


def destroy_distributed(timeout_s: Optional[float] = None) -> bool:
    """Leave the group. Every rank should call this at about the same time: tearing down an NCCL
    communicator is a collective among a node's ranks, so a rank alone (its peers exited without
    leaving, were killed, or wait for it elsewhere) blocks in it forever. With `timeout_s`, the
    teardown runs in a daemon thread and is abandoned after that long (logged; the process is
    on its way out and its GPU context goes with it). Returns whether the group was torn down."""
    global _TP
    _TP = SINGLE
    if not dist.is_initialized():
        return True
    if timeout_s is None:
        dist.destroy_process_group()
        return True
    done = threading.Event()

    def teardown():
        try:
            dist.destroy_process_group()
        finally:
            done.set()

    threading.Thread(target=teardown, name="tp-destroy", daemon=True).start()
    if done.wait(timeout_s):
        return True
    logger.warning("leaving the TP process group did not finish in %.0fs (a peer rank did not "
                   "leave with this one); abandoned", timeout_s)
    return False


def _no_wait() -> None:
    pass
