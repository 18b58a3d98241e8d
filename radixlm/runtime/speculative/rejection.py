"""Verification of draft tokens against the target's distribution, row by row.

Each row r of a verify batch is one position of one request: its logits give the target's next
token distribution p_r there, given the request's text and the drafts before r. `draft[r]` is
the draft token proposed for that next position, or -1 (the last row of a request: nothing is
proposed there, its token is the bonus).

- Greedy rows: accept iff argmax p_r == draft[r]; the row's token otherwise is argmax p_r, which
  is exactly what plain decoding would pick (same penalties, same argmax, same tie-break).
- Sampled rows (Leviathan et al. / Chen et al.): the draft token d was drawn from the draft's
  distribution q. Accept with probability min(1, p(d) / q(d)); on rejection sample from the
  residual norm(max(0, p - q)). The emitted token is then distributed exactly as p:
  P(x) = q(x) min(1, p(x)/q(x)) + (1 - sum_y min(p(y), q(y))) * max(0, p(x) - q(x)) / Z
       = min(p(x), q(x)) + max(0, p(x) - q(x)) = p(x),  Z = sum_y max(0, p(y) - q(y)).
  Two kinds of q, one code path: a draft model's q is a dense row (`draft_probs`, processed with
  the request's own sampling parameters, see `sample_draft`); a deterministic draft (n-grams)
  is the point mass q = 1[d], kept sparse: q(d) = 1, and max(0, p - q) is p with d removed.
  p is the normal sampler's processed distribution (its own code: penalties, logit_bias, masks,
  temperature, top-k / top-p / min-p), so every sampling parameter applies as without drafts.

All rows at once, tensor ops only; seeded requests draw from their own generators.
"""

from __future__ import annotations

from typing import Optional

import torch

from radixlm.runtime.layers import cpu_fused
from radixlm.runtime.sampling.sampler import Sampler, row_noise
from radixlm.runtime.sampling.sampling_batch_info import SamplingBatchInfo


def accept_rows(logits: torch.Tensor, info: SamplingBatchInfo, reqs: list, draft: torch.Tensor,
                sampler: Sampler, draft_probs: Optional[torch.Tensor] = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """logits (R, V) float32 (edited in place), info / reqs: row r's sampling parameters and
    request, draft (R,) int64 (-1: none) -> (accept (R,) bool, token (R,) int64): whether row
    r's draft is accepted, and the row's token when it is not (or when there is none).
    `draft_probs` (R, V) float32, rows summing to 1: the distribution q each row's draft was
    drawn from (rows without a draft: ignored); None: every draft is a point mass."""
    info.apply_penalties_and_masks(logits)
    if info.is_all_greedy:
        ids = cpu_fused.argmax_rows(logits)  # the plain sampler's argmax: the same tie-break
        return ids == draft, ids  # (ids >= 0: a row without a draft, -1, never accepts)
    has = draft >= 0
    greedy_ids = logits.argmax(dim=-1) if info.any_greedy else None
    probs = sampler.filtered_probs(logits, info)  # (R, V), unnormalized
    p = probs.div_(probs.sum(dim=-1, keepdim=True))  # (R, V) the target's distribution
    d = draft.clamp(min=0).view(-1, 1)  # (R, 1)
    p_d = p.gather(1, d).view(-1)  # (R,)
    u = row_noise(p_d, info, reqs, "uniform")  # (R,) ~ U[0, 1)
    if draft_probs is None:  # q = 1[d] (0 on rows without a draft): subtracted sparsely
        q_d = has.to(p.dtype)  # (R,)
        residual = p.scatter_add(1, d, -q_d.view(-1, 1))
    else:
        q_d = draft_probs.gather(1, d).view(-1) * has  # (R,)
        residual = p - draft_probs * has.view(-1, 1)
    accept = has & (u * q_d < p_d)  # P = min(1, p(d) / q(d))
    residual.clamp_(min=0.0)  # (R, V) max(0, p - q), unnormalized: the race needs no sum
    # p <= q everywhere (p == q up to rounding): a rejection has probability ~0; sample p then
    # rather than the all-zero row (whose race would pick token 0)
    empty = (residual.sum(dim=-1) <= 0).view(-1, 1)
    residual = torch.where(empty, p, residual)
    token = residual.div_(row_noise(residual, info, reqs, "exponential")).argmax(dim=-1)
    if greedy_ids is not None:
        accept = torch.where(info.greedy_rows, has & (greedy_ids == draft), accept)
        token = torch.where(info.greedy_rows, greedy_ids, token)
    return accept, token


def sample_draft(logits: torch.Tensor, info: SamplingBatchInfo, reqs: list, sampler: Sampler
                 ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """A draft model's step: logits (B, V) float32 (edited in place), processed exactly as the
    target's rows will be (penalties, bias, masks, temperature, top-k / top-p / min-p: the same
    `info` rows, the drafts before counted as output) -> (tokens (B,) int64, q (B, V) rows
    summing to 1, or None when every row is greedy: the draft is then the argmax, which the
    target accepts iff its own argmax agrees)."""
    info.apply_penalties_and_masks(logits)
    if info.is_all_greedy:
        return cpu_fused.argmax_rows(logits), None
    greedy_ids = logits.argmax(dim=-1) if info.any_greedy else None
    probs = sampler.filtered_probs(logits, info)  # (B, V), unnormalized
    q = probs.div_(probs.sum(dim=-1, keepdim=True))
    tokens = (q / row_noise(q, info, reqs, "exponential")).argmax(dim=-1)  # (B,) one draw of q
    if greedy_ids is not None:
        tokens = torch.where(info.greedy_rows, greedy_ids, tokens)
    return tokens, q
