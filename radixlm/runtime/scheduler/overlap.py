"""The overlap schedule: the CPU works on step N's outputs while the GPU runs step N+1.

A decode step is split in two halves:
  launch    build the batch, enqueue forward + sampling on the GPU, start a non-blocking copy of
            the sampled ids (and logprobs) into pinned host memory; returns an `InFlightDecode`.
  complete  wait for that copy, append tokens, decide finishes, free or cache KV.

With overlap, step N+1 is launched *before* step N is completed: its input ids are step N's
sampled ids, read on the device, so the CPU never waits for the GPU between steps. Requests
that finish at step N have already been given a row in step N+1; that row's token is dropped
when N+1 completes (one wasted row per finishing request), and its KV slot, written at the
position of step N's last token, is a valid entry the radix tree takes with the request.

Chaining is only done when it cannot change any result:
- no request in the batch is constrained by a grammar (its mask needs step N's token accepted);
- no request waits to be admitted, except those that cannot be admitted yet: the running batch
  is full (max_running_requests), their host prefix is still being copied to the device or
  their pages are still coming from the store (hierarchical cache; scheduler/waiting.py); when
  one can be, the step launched before step N completes is the extend that admits it, the
  running requests decoding in it (overlap_extend.py; the chained decode when that round
  admits nothing, e.g. no memory), or, where that extend needs the host in between, none:
  admission then runs after completion;
- every chained request gets its slot without eviction of locked nodes or retraction.
Requests that surely finish at step N (their last allowed token) are left out of step N+1.
While a step is in flight, every request in it has kv_len == len(fill_ids) (its last known
token's KV is being computed); after completion kv_len == len(fill_ids) - 1, as without overlap.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from radixlm.runtime.executor.host_staging import staged
from radixlm.runtime.request import Req
from radixlm.runtime.sampling.sampler import SampleOutput


@dataclass
class InFlightDecode:
    reqs: list[Req]  # row i of the outputs belongs to reqs[i]
    out: SampleOutput  # device tensors
    host: SampleOutput  # host copies; valid once `ready` has completed
    ready: Optional[torch.cuda.Event]
    on_complete: Optional[Callable[[], None]] = None  # after the wait (an extend's prefill rate)

    def wait(self) -> SampleOutput:
        if self.ready is not None:
            self.ready.synchronize()
        if self.on_complete is not None:
            self.on_complete()
            self.on_complete = None
        return self.host


def start_host_copy(reqs: list[Req], out: SampleOutput) -> InFlightDecode:
    """Begin the step's one device->host transfer (ids and any logprobs) without blocking."""
    if out.next_token_ids.device.type != "cuda":
        return InFlightDecode(reqs, out, out, None)

    def to_host(t):
        # a non-blocking D2H copy lands in pinned memory; it is valid after the event below
        return None if t is None else t.to("cpu", non_blocking=True)

    host = SampleOutput(next_token_ids=to_host(out.next_token_ids), logprobs=to_host(out.logprobs),
                        top_logprobs_vals=to_host(out.top_logprobs_vals),
                        top_logprobs_ids=to_host(out.top_logprobs_ids))
    ready = torch.cuda.Event()
    ready.record()
    return InFlightDecode(reqs, out, host, ready)


def surely_finishes(req: Req, context_len: int) -> bool:
    """True when the token being sampled now is this request's last (length limits)."""
    n_out = len(req.output_ids) + 1
    return (n_out >= req.sampling_params.max_new_tokens
            or req.seqlen + 1 >= context_len)


def chained_input_ids(prev: InFlightDecode, reqs: list[Req]) -> torch.Tensor:
    """The input ids of `reqs` for the next step: their rows of the previous step's samples."""
    ids = prev.out.next_token_ids
    if len(reqs) == len(prev.reqs) and all(a is b for a, b in zip(reqs, prev.reqs)):
        return ids
    pos = {id(r): i for i, r in enumerate(prev.reqs)}
    # through pinned memory: from pageable memory the copy would wait for the step in flight
    return ids.index_select(0, staged([pos[id(r)] for r in reqs], ids.device))
