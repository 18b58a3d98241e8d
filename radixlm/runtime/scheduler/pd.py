"""The scheduler's two disaggregation roles (--disaggregation-mode prefill | decode).

Who computes what: the prefill server computes the whole prompt (and its prompt logprobs) and
sends the KV of prompt tokens [start, n - 1) to the decode server; the decode server computes
the last prompt token itself, in a one-token extend, and samples the first output token there.
So sampling, stop conditions, grammars, output logprobs and streaming all run on one side, as
colocated, and the decode side recomputes one token, never the prompt. (SGLang instead samples
the first token on the prefill side and ships it with the KV.)

Prefix hits: the decode side matches prompt[:n - 1] against its own radix tree and asks only for
the tokens past the match (`start`); the match stays locked until the KV is in the tree.

A room's life on the decode side (pd_decode.py): reserve slots (while the pool has no room, the
request waits in arrival order, within --disaggregation-timeout) -> READY -> pages land in the
slots -> the prompt goes into the radix tree (the tree owns the slots) and the request enters
the waiting queue with its path locked; admission then finds n - 1 cached tokens. On a link
failure, a CANCEL, an abort or the timeout, the reserved slots go back to the allocator and the
request fails with an error.
On the prefill side (pd_prefill.py) a request waits (held) for its room's READY, then runs as a
prompt-only request (max_new_tokens 0); after every extend step the newly computed KV goes out
in pages, on the link's thread, while the next chunk computes. A request that ends before its
KV is all sent (abort, failure) sends CANCEL.
"""

from __future__ import annotations

import time

import torch

from radixlm.runtime.request import Finish, FinishReason, Req

# Tokens per page on the wire (one gather, one header). Each page costs 2 x layers small index
# kernels on both schedulers' threads (gather; scatter between decode steps): 256-token pages
# put 2,048 launches (~10 ms) into the decode loop per 8k-token prompt on the 8B shape. A page
# still never spans two prefill chunks, so larger pages cost no overlap.
PAGE_TOKENS = 2048


def link_timeout(room_timeout: float) -> float:
    """How long a link's blocking call may wait. Longer than a room's life: every room a
    receiver waits for ends in pages or a CANCEL within about two room timeouts (a READY whose
    request never reaches the prefill side is cancelled a timeout after it came), and a link
    that times out fails every room on it, not only the late one."""
    return 2 * room_timeout + 10


def gather_kv(pool, slots: torch.Tensor) -> torch.Tensor:
    """slots (T,) -> (L, 2, T, H_kv, D): the pool's K and V at those slots, one tensor."""
    return torch.stack([torch.stack((k.index_select(0, slots), v.index_select(0, slots)))
                        for k, v in zip(pool.k_buffers, pool.v_buffers)])


def scatter_kv(pool, slots: torch.Tensor, kv: torch.Tensor) -> None:
    """kv (L, 2, T, H_kv, D) into the pool at slots (T,)."""
    for layer, (k, v) in enumerate(zip(pool.k_buffers, pool.v_buffers)):
        k.index_copy_(0, slots, kv[layer, 0])
        v.index_copy_(0, slots, kv[layer, 1])


def fail(req: Req, message: str, status: int) -> None:
    """Finish a request that never ran (or ran on the other side) with an error status."""
    req.finish = Finish(FinishReason.ABORT, message=message, status=status)
    req.finished_at = time.perf_counter()
