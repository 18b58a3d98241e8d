"""The verify forward: each request's last token and its draft chain, as one extend batch.

Request b (kv_len L_b, draft d_1..d_k) computes the k + 1 tokens [last, d_1, ..., d_k] at
positions L_b .. L_b + k over its paged history: the extend path with causal attention inside
the request, which is exactly a chain's mask. (A draft tree, top-k > 1, would add a per-request
tree mask to the ForwardBatch that the backends apply instead of the causal one; the rows and
`VerifyPlan` below stay as they are, with `parent` links replacing "the row before".)
Every row is a logits row: row (b, j) gives the target's distribution for the token after d_j
(d_0 = last). Requests without a draft (k = 0) come last as the batch's decode tail, so a
backend runs them as a batched decode.

`as_decode`: the same rows as a DECODE batch instead, one row per token: row (b, j) is request
b's pool row with seq_len L_b + j + 1. Every row's K/V is in the pool before any attention runs,
so row (b, j) sees exactly [.., last, d_1..d_j]: the chain's causal mask, with no extend kernel.
The batch then replays the decode CUDA graph of R rows (an eager verify of 8 drafts cost 3.9x a
graph-replayed decode step at batch 1 on an H200, Llama-3.1-8B shape), and each row computes
what a plain decode step at its position computes. Its attention reads request b's history once
per row, k_b + 1 times in all: the caller uses it where a graph replays the batch, and on the CPU,
where the kernels' rows do not depend on the rows beside them (the GGUF projections up to
DIRECT_MAX_M rows, the attention's key splits planned per row), so a verify row's logits equal
a plain step's bit for bit, bf16 included.

KV slots: R = sum(k_b + 1) new slots, taken without eviction (the caller checked they are
free), written at req_to_token[row_b, L_b : L_b + k_b + 1]. After acceptance the caller keeps
the first m_b (the tokens the request kept) and frees the others in the same step.

Host -> device: everything the forward and the acceptance read is packed into one int64 tensor
and copied once, before the forward; device -> host: one copy of each row's (accepted, token,
draft) after it, from which the host counts the accepted prefixes. At batch 1 on a GPU the
verify's host work cannot overlap the GPU (its drafts need the last step's tokens), so every
device op on this path is a launch (~10-20 us) the step waits for: the layout is computed on
the host, not by small device ops.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Optional

import torch

from radixlm.runtime.executor.forward_batch import ForwardBatch, ForwardMode
from radixlm.runtime.executor.host_staging import staged
from radixlm.runtime.request import Req
from radixlm.runtime.sampling.logprobs import token_logprobs
from radixlm.runtime.sampling.sampler import SampleOutput
from radixlm.runtime.scheduler.output import LogprobRows
from radixlm.runtime.speculative.rejection import accept_rows


@dataclass
class VerifyPlan:
    reqs: list[Req]  # batch order: requests with a draft first, then the plain decodes
    running_rows: list[int]  # each one's row in the running batch (its sampling row)
    drafts: list[list[int]]  # (their lengths; the tokens: dev["grid"], see build_verify)
    offsets: list[int]  # first logits row of each request; request b has len(drafts[b]) + 1
    kv_lens: list[int]  # kv_len of each before the step
    slots: torch.Tensor  # (R,) the step's new KV slots, in row order
    row_b: list[int]  # (R,) host: each row's request
    dev: dict  # device views: row_b, row_j, draft, info_row (R,); grid (B, K + 1)

    @property
    def num_rows(self) -> int:
        return len(self.row_b)


@dataclass
class VerifyResult:
    accepted: list[int]  # per request: draft tokens accepted (n_b <= k_b)
    tokens: list[list[int]]  # per request: the n_b + 1 tokens to append (drafts, then one more)
    logprobs: Optional[LogprobRows]  # row paths[b][j]: the logprob of tokens[b][j]
    paths: list[list[int]]  # per request: the rows of its kept tokens (a chain: off .. off + n)


def build_verify(reqs: list[Req], running_rows: list[int], drafts: list[list[int]], req_pool,
                 allocator, device: torch.device,
                 device_drafts: Optional[torch.Tensor] = None,
                 as_decode: bool = False) -> tuple[ForwardBatch, VerifyPlan]:
    """`device_drafts` (B, >= K) int64 on the device: request b's drafts in row b, read instead
    of the values in `drafts` (whose lengths still count): a draft model's tokens, used before
    they reach the host, so the verify is queued behind the draft chain without a sync.
    `as_decode`: the verify as a DECODE batch (see the module docstring)."""
    B = len(reqs)
    ext = [len(d) + 1 for d in drafts]
    offsets = [0, *itertools.accumulate(ext)][:-1]
    R, K = offsets[-1] + ext[-1], max(ext) - 1
    slots = allocator.alloc(R)
    assert slots is not None, "the caller checked the free slots"
    kv_lens = [r.kv_len for r in reqs]
    ids, row_b, row_j, nxt = [], [], [], []
    for b, (req, d) in enumerate(zip(reqs, drafts)):
        ids.append(req.output_ids[-1])
        ids.extend(d)
        row_b.extend([b] * len(d) + [b])
        row_j.extend(range(len(d) + 1))
        nxt.extend(d)
        nxt.append(-1)  # the last row proposes nothing: its token is the bonus
    grid = [d + [-1] * (K + 1 - len(d)) for d in drafts]  # (B, K + 1) drafts, -1 padded
    pool = [r.req_pool_idx for r in reqs]
    positions = [kv_lens[b] + j for b, j in zip(row_b, row_j)]
    # rows (9, R): input id, position, pool row, position + 1 (a decode row's seq len; the
    # first four: a decode graph's inputs, fb.graph_inputs), request, j, next draft, sampling
    # row, row index (the logits rows); requests (2, B): pool row, seq len; then the
    # (B, K + 1) grid. (Built here rather than by device ops: each op's launch is host time a
    # verify cannot hide behind the GPU.)
    # ... and last (R,) each row's flat index into req_to_token (its pool row, its position)
    width = req_pool.req_to_token.shape[1]
    flat = staged(
        ids + positions + [pool[b] for b in row_b] + [p + 1 for p in positions] + row_b + row_j
        + nxt + [running_rows[b] for b in row_b] + list(range(R)) + pool
        + [n + e for n, e in zip(kv_lens, ext)] + list(itertools.chain.from_iterable(grid))
        + [pool[b] * width + p for b, p in zip(row_b, positions)], device)
    rows, reqs_part = flat[: 9 * R].view(9, R), flat[9 * R : 9 * R + 2 * B].view(2, B)
    row = rows.unbind(0)  # (one op for the nine views)
    dev = {"row_b": row[4], "row_j": row[5], "draft": row[6], "info_row": row[7],
           "grid": flat[9 * R + 2 * B : -R].view(B, K + 1)}
    if device_drafts is not None:
        _take_device_drafts(device_drafts, rows, dev)
    # req_to_token[row[2], row[1]] = slots as one index_copy_ at host-computed flat indices
    # (the advanced-index assignment runs index_put_'s broadcasting and checks: host time,
    # which on this path the GPU waits through)
    req_pool.req_to_token.view(-1).index_copy_(0, flat[-R:], slots)
    seq_lens = [n + e for n, e in zip(kv_lens, ext)]
    if as_decode:
        fb = ForwardBatch(
            mode=ForwardMode.DECODE, input_ids=row[0], positions=row[1], out_cache_loc=slots,
            req_pool_indices=row[2], seq_lens=row[3], logits_indices=row[8],
            seq_lens_cpu=[p + 1 for p in positions], graph_inputs=rows[:4])
        return fb, VerifyPlan(reqs, running_rows, drafts, offsets, kv_lens, slots, row_b, dev)
    fb = ForwardBatch(
        mode=ForwardMode.EXTEND,
        input_ids=row[0],
        positions=row[1],
        out_cache_loc=slots,
        req_pool_indices=reqs_part[0],
        seq_lens=reqs_part[1],
        logits_indices=row[8],
        seq_lens_cpu=seq_lens,
        extend_prefix_lens_cpu=kv_lens,
        extend_lens_cpu=ext,
        num_decode_tail=sum(1 for d in drafts if not d),
    )
    return fb, VerifyPlan(reqs, running_rows, drafts, offsets, kv_lens, slots, row_b, dev)


def _take_device_drafts(drafts: torch.Tensor, rows: torch.Tensor, dev: dict) -> None:
    """Fill the grid, the input ids and the next-draft column from device drafts (B, >= K):
    grid[b, j] = drafts[b, j] for j < k_b, else -1; a row's input is the request's last token
    (row 0) or the draft before it; its next draft is grid[b, j] (-1 on the bonus row)."""
    grid = dev["grid"]  # (B, K + 1), host-built: -1 past each k_b
    K = grid.shape[1] - 1
    if K:
        grid[:, :K] = torch.where(grid[:, :K] >= 0, drafts[:, :K], grid[:, :K])
    row_b, row_j = dev["row_b"], dev["row_j"]
    rows[0] = torch.where(row_j == 0, rows[0], grid[row_b, (row_j - 1).clamp(min=0)])
    dev["draft"].copy_(grid[row_b, row_j])


def verify(logits: torch.Tensor, plan: VerifyPlan, running_info, sampler, apply_grammar,
           want_logprob: bool, top_logprobs_num: int,
           draft_probs: Optional[torch.Tensor] = None) -> VerifyResult:
    """Accept the drafts of every request at once. logits (R, V) float32, row order of `plan`;
    `apply_grammar(logits)` masks the constrained rows (before logprobs, as plain decoding
    does); `draft_probs` (R, V): the draft model's q of each row's draft (None: point masses,
    see rejection.py)."""
    R = plan.num_rows
    dev = plan.dev
    row_b, row_j, grid = dev["row_b"], dev["row_j"], dev["grid"]
    K = grid.shape[1] - 1
    # row r's sampling parameters: its request's, with the drafts before it counted as output
    info = running_info.take([plan.running_rows[b] for b in plan.row_b], index=dev["info_row"],
                             lazy=True)
    if info.output_counts is not None and K:
        before = grid[row_b, :K].clamp(min=0)  # (R, K) request's drafts; those at >= j unseen
        seen = (torch.arange(K, device=grid.device).view(1, -1) < row_j.view(-1, 1)).float()
        info.output_counts.scatter_add_(1, before, seen)
    if info.min_tokens_left is not None:
        info.min_tokens_left = (info.min_tokens_left - row_j).clamp_(min=0)
    apply_grammar(logits)
    raw = logits.clone() if want_logprob else None
    draft = dev["draft"]
    accept, token = accept_rows(logits, info, [plan.reqs[b] for b in plan.row_b], draft,
                                sampler, draft_probs)
    lp = None
    if want_logprob:
        # (R,) the token each row emits if it is kept: row j < n_b was accepted (its draft),
        # row n_b was not (or has no draft: the bonus row), so it emits its own token; rows
        # past a rejection are unused (>= 0 either way)
        chosen = torch.where(accept, draft, token)
        vals, top_vals, top_ids = token_logprobs(raw, chosen, top_logprobs_num)
        lp = LogprobRows(SampleOutput(chosen, vals, top_vals, top_ids, raw_logits=raw))
    # the step's one sync; the leading accepted drafts of each request are counted here, on
    # the host (a handful of ints), rather than by a chain of small device ops before it
    flat = torch.cat([accept, token, draft]).tolist()
    acc, tok, drafted = flat[:R], flat[R : 2 * R], flat[2 * R :]
    accepted, rows, paths = [], [], []
    for b, off in enumerate(plan.offsets):
        n, k = 0, len(plan.drafts[b])
        while n < k and acc[off + n]:
            n += 1
        accepted.append(n)
        rows.append(drafted[off : off + n] + [tok[off + n]])
        paths.append(list(range(off, off + n + 1)))
    return VerifyResult(accepted, rows, lp, paths)
