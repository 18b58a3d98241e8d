"""The verify forward: each request's last token and its draft chain, as one extend batch.

Request b (kv_len L_b, draft d_1..d_k) computes the k + 1 tokens [last, d_1, ..., d_k] at
positions L_b .. L_b + k over its paged history: the extend path with causal attention inside
the request, which is exactly a chain's mask. (A draft tree, top-k > 1, would add a per-request
tree mask to the ForwardBatch that the backends apply instead of the causal one; the rows and
`VerifyPlan` below stay as they are, with `parent` links replacing "the row before".)
Every row is a logits row: row L_b + j gives the target's distribution for the token after
d_j (d_0 = last). Requests without a draft (k = 0) come last as the batch's decode tail, so a
backend runs them as a batched decode.

KV slots: R = sum(k_b + 1) new slots, taken without eviction (the caller checked they are
free), written at req_to_token[row_b, L_b : L_b + k_b + 1]. After acceptance the caller keeps
the first m_b (the tokens the request kept) and frees the others in the same step.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Optional

import torch

from radixlm.runtime.executor.forward_batch import ForwardBatch, ForwardMode
from radixlm.runtime.request import Req
from radixlm.runtime.sampling.logprobs import token_logprobs
from radixlm.runtime.sampling.sampler import SampleOutput
from radixlm.runtime.scheduler.output import LogprobRows
from radixlm.runtime.speculative.rejection import accept_rows


@dataclass
class VerifyPlan:
    reqs: list[Req]  # batch order: requests with a draft first, then the plain decodes
    running_rows: list[int]  # each one's row in the running batch (its sampling row)
    drafts: list[list[int]]
    offsets: list[int]  # first logits row of each request; request b has len(drafts[b]) + 1
    kv_lens: list[int]  # kv_len of each before the step
    slots: torch.Tensor  # (R,) the step's new KV slots, in row order

    @property
    def num_rows(self) -> int:
        return self.offsets[-1] + len(self.drafts[-1]) + 1


@dataclass
class VerifyResult:
    accepted: list[int]  # per request: draft tokens accepted (n_b <= k_b)
    tokens: list[list[int]]  # per request: the n_b + 1 tokens to append (drafts, then one more)
    logprobs: Optional[LogprobRows]  # row offsets[b] + j: the logprob of tokens[b][j]


def build_verify(reqs: list[Req], running_rows: list[int], drafts: list[list[int]], req_pool,
                 allocator, device: torch.device) -> tuple[ForwardBatch, VerifyPlan]:
    ext = [len(d) + 1 for d in drafts]
    offsets = [0, *itertools.accumulate(ext)][:-1]
    R = offsets[-1] + ext[-1]
    slots = allocator.alloc(R)
    assert slots is not None, "the caller checked the free slots"
    kv_lens = [r.kv_len for r in reqs]
    ids = []
    for req, d in zip(reqs, drafts):
        ids.append(req.output_ids[-1])
        ids.extend(d)
    ext_t = torch.tensor(ext, dtype=torch.int64)
    first = torch.tensor(kv_lens, dtype=torch.int64).repeat_interleave(ext_t, output_size=R)
    within = torch.arange(R) - torch.tensor(offsets).repeat_interleave(ext_t, output_size=R)
    pool_rows = [r.req_pool_idx for r in reqs]
    host = torch.stack([torch.tensor(ids, dtype=torch.int64), first + within,
                        torch.tensor(pool_rows).repeat_interleave(ext_t, output_size=R)])
    meta = host.to(device, non_blocking=True)  # (3, R): input ids, positions, pool rows
    req_pool.req_to_token[meta[2], meta[1]] = slots
    seq_lens = [n + e for n, e in zip(kv_lens, ext)]
    fb = ForwardBatch(
        mode=ForwardMode.EXTEND,
        input_ids=meta[0],
        positions=meta[1],
        out_cache_loc=slots,
        req_pool_indices=torch.tensor(pool_rows, dtype=torch.int64, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int64, device=device),
        logits_indices=torch.arange(R, device=device),
        seq_lens_cpu=seq_lens,
        extend_prefix_lens_cpu=kv_lens,
        extend_lens_cpu=ext,
        num_decode_tail=sum(1 for d in drafts if not d),
    )
    return fb, VerifyPlan(reqs, running_rows, drafts, offsets, kv_lens, slots)


def verify(logits: torch.Tensor, plan: VerifyPlan, running_info, sampler, device,
           apply_grammar, want_logprob: bool, top_logprobs_num: int) -> VerifyResult:
    """Accept the drafts of every request at once. logits (R, V) float32, row order of `plan`;
    `apply_grammar(logits)` masks the constrained rows (before logprobs, as plain decoding
    does). One device -> host copy for the tokens (and one for the logprobs if asked)."""
    B, R = len(plan.reqs), plan.num_rows
    K = max(len(d) for d in plan.drafts)
    ks = [len(d) for d in plan.drafts]
    # (B, K) drafts, padded with -1; row r = (b, j): request b, position j
    grid = torch.full((B, K + 1), -1, dtype=torch.int64)
    for b, d in enumerate(plan.drafts):
        grid[b, : len(d)] = torch.tensor(d, dtype=torch.int64)
    ext_t = torch.tensor(ks, dtype=torch.int64) + 1
    row_b = torch.arange(B).repeat_interleave(ext_t, output_size=R)  # (R,)
    row_j = torch.arange(R) - torch.tensor(plan.offsets).repeat_interleave(ext_t, output_size=R)
    host = torch.stack([row_b, row_j, grid[row_b, row_j]])  # (3, R); the last: row's draft
    meta = host.to(device, non_blocking=True)
    row_b, row_j, draft = meta[0], meta[1], meta[2]
    grid = grid.to(device, non_blocking=True)

    rb = host[0].tolist()
    info = running_info.take([plan.running_rows[b] for b in rb])  # row r: its request's params
    if info.output_counts is not None:  # penalties see the drafts before each row as output
        before = grid[row_b, :K].clamp(min=0)  # (R, K)
        seen = (torch.arange(K, device=device).view(1, -1) < row_j.view(-1, 1)).float()
        info.output_counts.scatter_add_(1, before, seen)
    if info.min_tokens_left is not None:
        info.min_tokens_left = (info.min_tokens_left - row_j).clamp_(min=0)
    apply_grammar(logits)
    raw = logits.clone() if want_logprob else None
    accept, token = accept_rows(logits, info, [plan.reqs[b] for b in rb], draft, sampler)

    offsets = torch.tensor(plan.offsets, device=device)
    cols = torch.arange(K, device=device).view(1, -1)
    in_draft = cols < ext_t.to(device).view(-1, 1) - 1  # (B, K)
    acc = accept[(offsets.view(-1, 1) + cols).clamp(max=R - 1)] & in_draft  # (B, K)
    n = acc.to(torch.int64).cumprod(dim=1).sum(dim=1)  # (B,) leading accepted drafts
    last = token[offsets + n]  # (B,) the correction, or the bonus after a fully accepted draft
    emitted = grid.scatter(1, n.view(-1, 1), last.view(-1, 1))  # (B, K + 1)
    lp = None
    if want_logprob:
        # (R,) the token each row emits if it is kept (rows past a rejection: unused, >= 0)
        chosen = emitted[row_b, row_j].clamp(min=0)
        vals, top_vals, top_ids = token_logprobs(raw, chosen, top_logprobs_num)
        lp = LogprobRows(SampleOutput(chosen, vals, top_vals, top_ids, raw_logits=raw))
    flat = torch.cat([n, emitted.view(-1)]).tolist()  # the step's one sync
    accepted = flat[:B]
    rows = [flat[B + b * (K + 1) : B + b * (K + 1) + accepted[b] + 1] for b in range(B)]
    return VerifyResult(accepted, rows, lp)
