"""Verification of draft tokens against the target's distribution, row by row.

Each row r of a verify batch is one position of one request: its logits give the target's next
token distribution p_r there, given the request's text and the drafts before r. `draft[r]` is
the draft token proposed for that next position, or -1 (the last row of a request: nothing is
proposed there, its token is the bonus).

- Greedy rows: accept iff argmax p_r == draft[r]; the row's token otherwise is argmax p_r, which
  is exactly what plain decoding would pick (same penalties, same argmax, same tie-break).
- Sampled rows (Leviathan et al. / Chen et al. with a point-mass draft q = 1[draft]): accept
  with probability min(1, p(d) / q(d)) = p(d); on rejection sample from the residual
  norm(max(0, p - q)), which is p with d removed, renormalized. The emitted token is then
  distributed exactly as p: P(d) = p(d), P(x != d) = (1 - p(d)) * p(x) / (1 - p(d)) = p(x).
  p is the normal sampler's processed distribution (its own code: penalties, logit_bias, masks,
  temperature, top-k / top-p / min-p), so every sampling parameter applies as without drafts.

All rows at once, tensor ops only; seeded requests draw from their own generators.
"""

from __future__ import annotations

import torch

from radixlm.runtime.layers import cpu_fused
from radixlm.runtime.sampling.sampler import Sampler, row_noise
from radixlm.runtime.sampling.sampling_batch_info import SamplingBatchInfo


def accept_rows(logits: torch.Tensor, info: SamplingBatchInfo, reqs: list, draft: torch.Tensor,
                sampler: Sampler) -> tuple[torch.Tensor, torch.Tensor]:
    """logits (R, V) float32 (edited in place), info / reqs: row r's sampling parameters and
    request, draft (R,) int64 (-1: none) -> (accept (R,) bool, token (R,) int64): whether row
    r's draft is accepted, and the row's token when it is not (or when there is none)."""
    info.apply_penalties_and_masks(logits)
    has = draft >= 0
    if info.is_all_greedy:
        ids = cpu_fused.argmax_rows(logits)  # the plain sampler's argmax: the same tie-break
        return has & (ids == draft), ids
    greedy_ids = logits.argmax(dim=-1) if info.any_greedy else None
    probs = sampler.filtered_probs(logits, info)  # (R, V), unnormalized
    d = draft.clamp(min=0).view(-1, 1)  # (R, 1)
    p_d = probs.gather(1, d).view(-1)  # (R,)
    total = probs.sum(dim=-1)  # (R,)
    u = row_noise(total, info, reqs, "uniform")  # (R,) ~ U[0, 1)
    accept = has & (u * total < p_d)
    # the residual: p without the draft token (rows without a draft keep theirs)
    probs.scatter_(1, d, torch.where(has, torch.zeros_like(p_d), p_d).view(-1, 1))
    token = probs.div_(row_noise(probs, info, reqs, "exponential")).argmax(dim=-1)
    if greedy_ids is not None:
        accept = torch.where(info.greedy_rows, has & (greedy_ids == draft), accept)
        token = torch.where(info.greedy_rows, greedy_ids, token)
    return accept, token
