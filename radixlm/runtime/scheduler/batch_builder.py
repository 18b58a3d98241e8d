"""Turns the scheduled requests into a ForwardBatch and assigns their KV slots.

Extend: each request computes `fill_ids[kv_len : kv_len + extend_len]` on top of its cached prefix.
Decode: each request computes its last sampled token at position `kv_len`.
Slots for the whole batch come from one allocation (evicting from the tree if needed).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

from radixlm.runtime.executor.forward_batch import ForwardBatch, ForwardMode
from radixlm.runtime.executor.host_staging import staged_parts
from radixlm.runtime.request import Req


@dataclass
class LogitRows:
    """Where each request's rows sit in the (N, vocab) logits of an extend batch."""

    sample_reqs: list[Req] = field(default_factory=list)  # requests that sample this step
    sample_rows: list[int] = field(default_factory=list)
    # (req, first logits row, number of rows, first prompt position scored) for prompt logprobs
    input_spans: list[tuple[Req, int, int, int]] = field(default_factory=list)


def alloc_slots(n: int, allocator, tree_cache) -> torch.Tensor:
    if not allocator.can_alloc(n):
        tree_cache.evict(n - allocator.available_size())
    slots = allocator.alloc(n)
    if slots is None:  # admission/decode budgeting guarantees this cannot happen
        raise RuntimeError(f"KV pool exhausted: needed {n} slots, "
                           f"{allocator.available_size()} free after eviction")
    return slots


def build_extend(reqs: list[Req], req_pool, allocator, tree_cache, device,
                 tail_ids: Optional[torch.Tensor] = None) -> tuple[ForwardBatch, LogitRows]:
    """`tail_ids` (T,) on the device: the last T requests each extend one token not yet on the
    host, the in-flight step's samples (an extend chained onto it, scheduler/overlap_extend.py)."""
    rt = req_pool.req_to_token
    n_tail = 0 if tail_ids is None else len(tail_ids)
    first_tail = len(reqs) - n_tail
    for req in reqs:
        if req.req_pool_idx is None:
            req.req_pool_idx = req_pool.alloc()
            assert req.req_pool_idx is not None, "admission checked req_pool capacity"
            req_pool.write(req.req_pool_idx, 0, req.prefix_indices.to(device))
    slots = alloc_slots(sum(r.extend_len for r in reqs), allocator, tree_cache)

    ids, positions, rows = [], [], LogitRows()
    logit_index: list[int] = []
    mm_inputs = None
    offset = 0
    for i, req in enumerate(reqs):
        start, ext = req.kv_len, req.extend_len
        if req.mm is not None and start < req.mm.images[-1].offset + req.mm.images[-1].length:
            mm_inputs = (mm_inputs or []) + [(offset, start, ext, req.mm)]
        rt[req.req_pool_idx, start : start + ext] = slots[offset : offset + ext]
        if i >= first_tail:
            ids.append(0)  # a placeholder: the device's token is written below
        else:
            ids.extend(req.fill_ids[start : start + ext])
        positions.append(np.arange(start, start + ext))
        if req.wants_input_logprobs and not req.input_logprobs_done:
            # logits at position q score prompt token q + 1
            first_q = max(req.logprob_start_len - 1, start)
            last_q = min(len(req.origin_input_ids) - 1, start + ext)  # exclusive
            if last_q > first_q:
                rows.input_spans.append((req, len(logit_index), last_q - first_q, first_q + 1))
                logit_index.extend(range(offset + first_q - start, offset + last_q - start))
        if not req.is_chunked:
            rows.sample_reqs.append(req)
            rows.sample_rows.append(len(logit_index))
            logit_index.append(offset + ext - 1)
        offset += ext

    seq_lens = [r.kv_len + r.extend_len for r in reqs]
    # one copy through pinned memory (host_staging.py), not five synchronous pageable ones
    input_ids, pos, pool_idx, lens, logits_indices = staged_parts(
        [ids, np.concatenate(positions), [r.req_pool_idx for r in reqs], seq_lens, logit_index],
        device)
    if n_tail:
        input_ids[-n_tail:] = tail_ids  # (queued after the staging copy, on the same stream)
    fb = ForwardBatch(
        mode=ForwardMode.EXTEND,
        input_ids=input_ids,
        positions=pos,
        out_cache_loc=slots,
        req_pool_indices=pool_idx,
        seq_lens=lens,
        logits_indices=logits_indices,
        seq_lens_cpu=seq_lens,
        extend_prefix_lens_cpu=[r.kv_len for r in reqs],
        extend_lens_cpu=[r.extend_len for r in reqs],
        mm_inputs=mm_inputs,
    )
    return fb, rows


def build_decode(reqs: list[Req], req_pool, allocator, tree_cache, device,
                 input_ids: Optional[torch.Tensor] = None) -> ForwardBatch:
    """`input_ids` (B,) on the device: the tokens to run when they are not yet on the host (the
    overlap schedule chains a step onto the previous one's samples); else each request's last."""
    bsz = len(reqs)
    slots = alloc_slots(bsz, allocator, tree_cache)
    kv_lens = [r.kv_len for r in reqs]
    # one host tensor, one copy: rows = (pool row, position[, input id])
    cols = [[r.req_pool_idx for r in reqs], kv_lens]
    if input_ids is None:
        cols.append([r.output_ids[-1] if r.output_ids else r.origin_input_ids[-1] for r in reqs])
    meta = staged_parts(cols, device)  # (pinned, one copy: executor/host_staging.py)
    pool_idx, positions = meta[0], meta[1]
    if input_ids is None:
        input_ids = meta[2]
    req_pool.req_to_token[pool_idx, positions] = slots
    seq_lens_cpu = [n + 1 for n in kv_lens]
    return ForwardBatch(
        mode=ForwardMode.DECODE,
        input_ids=input_ids,
        positions=positions,
        out_cache_loc=slots,
        req_pool_indices=pool_idx,
        seq_lens=positions + 1,
        logits_indices=torch.arange(bsz, device=device),
        seq_lens_cpu=seq_lens_cpu,
    )


def as_decode(fb: ForwardBatch, rows: LogitRows, reqs: list[Req]) -> ForwardBatch:
    """`fb` as a DECODE batch where it is one: every request extends exactly one token and
    samples it, and nothing else reads its logits or hidden states. A decode computes the same
    thing (one token at position kv_len over the cached prefix) and replays a decode CUDA graph
    where an extend runs eagerly: a disaggregated decode server admits each arriving prompt so
    (its KV came from the prefill server; the last prompt token is computed here), mixed with
    every running request, which otherwise all waited for an eager step at each arrival (an
    inter-token latency spike for the whole batch). Left as it is: prompt logprob rows, images and embeddings."""
    b = fb.batch_size
    if (fb.num_tokens != b or fb.mm_inputs or rows.input_spans
            or rows.sample_rows != list(range(b)) or any(r.embed_pooling for r in reqs)):
        return fb
    fb.mode = ForwardMode.DECODE  # the extend lists stay (EAGLE-3 reads them after the step)
    return fb
