"""Draft trees: their shape, how their nodes are chosen, and how a tree is accepted.

A request's tree hangs below its last token (the root, depth 0). Node n has a token, a parent
(-1: the root) and a depth; nodes are listed parent first. The verify computes one logits row
per node and one for the root: row x gives the target's distribution p_x of the token after
x's path. Acceptance walks from the root: at node x, either one of x's children is accepted
(the walk moves there) or x's own token is emitted and the walk ends, so a verify appends the
accepted path's tokens plus one, as a chain does.

Per node, with children c_1..c_m (distinct tokens, fixed by the draft's outputs before the
target is read, so each is a point mass q = 1[c_i]):
- greedy: the child whose token is argmax p_x, if any; else argmax p_x is emitted;
- sampled (SpecInfer's multi-candidate rejection with deterministic drafts): try c_1 .. c_m in
  order; c_i is accepted with probability p_i(c_i), p_1 = p_x, p_{i+1} = p_i with c_i removed
  and renormalized; if none is, the token is drawn from p_{m+1}. Then P(c_i) = p_x(c_i) for
  every child and P(y) = p_x(y) for the rest: the emitted token follows p_x exactly, and so,
  node by node down the accepted path, the appended tokens follow the target.
Every row's outcome is computed at once on the device (independent draws per row; the walk
reads at most one outcome per depth), the walk on the host after the step's one sync.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixlm.runtime.layers import cpu_fused
from radixlm.runtime.sampling.sampler import Sampler, row_noise
from radixlm.runtime.sampling.sampling_batch_info import SamplingBatchInfo


@dataclass
class DraftTree:
    tokens: list[int]  # (N,) node tokens, a parent before its children
    parents: list[int]  # (N,) each node's parent node, -1: the root (the request's last token)

    def __len__(self) -> int:
        return len(self.tokens)

    def depths(self) -> list[int]:
        out: list[int] = []
        for p in self.parents:
            out.append(1 if p < 0 else out[p] + 1)
        return out

    @property
    def depth(self) -> int:
        """The deepest node's depth: the most drafts one verify can accept."""
        return max(self.depths(), default=0)


def select_tree(scores: list[float], tokens: list[int], parents: list[int], depths: list[int],
                n: int, max_depth: int) -> DraftTree:
    """The n best candidates of depth <= max_depth by score as a tree. Candidate c has a score
    (its path's log-probability under the draft: never above its parent's), a token, a parent
    candidate (-1: the root) and a depth. Ties go to the shallower candidate, so a node's parent
    is always chosen before it: the chosen set is closed under parents."""
    order = sorted((c for c in range(len(scores)) if depths[c] <= max_depth),
                   key=lambda c: (-scores[c], depths[c], c))[:n]
    order.sort(key=lambda c: (depths[c], -scores[c], c))  # parents first
    node_of = {c: i for i, c in enumerate(order)}
    return DraftTree([tokens[c] for c in order],
                     [-1 if parents[c] < 0 else node_of[parents[c]] for c in order])


def accept_tree_rows(logits: torch.Tensor, info: SamplingBatchInfo, reqs: list,
                     children: torch.Tensor, sampler: Sampler
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """logits (R, V) float32 (edited in place), info / reqs: row r's sampling parameters and
    request, children (R, T) int64: row r's children's tokens in trial order, -1 padded ->
    (choice (R,) int64: the accepted child's column, -1: none; token (R,) int64: the row's
    token when none is accepted)."""
    info.apply_penalties_and_masks(logits)
    R, T = children.shape
    none = torch.full((R,), -1, dtype=torch.int64, device=logits.device)
    if info.is_all_greedy:
        ids = cpu_fused.argmax_rows(logits)  # the plain sampler's argmax: the same tie-break
        return _column_of(children, ids, none), ids
    greedy_ids = logits.argmax(dim=-1) if info.any_greedy else None
    probs = sampler.filtered_probs(logits, info)  # (R, V) unnormalized
    p = probs.div_(probs.sum(dim=-1, keepdim=True))  # (R, V) p_x
    residual = p.clone()
    choice = none.clone()
    for i in range(T):
        c = children[:, i]  # (R,)
        live = (c >= 0) & (choice < 0)
        col = c.clamp(min=0).view(-1, 1)
        p_c = residual.gather(1, col).view(-1)
        mass = residual.sum(dim=-1)  # p_i's normalizer
        u = row_noise(p_c, info, reqs, "uniform")
        choice = torch.where(live & (u * mass < p_c), torch.full_like(choice, i), choice)
        residual.scatter_(1, col, torch.where(live.view(-1, 1), 0.0, p_c.view(-1, 1)))
    # every child rejected: draw from what is left (all of p on the children, p_x up to
    # rounding: a rejection of them all has probability ~0; draw from p_x then)
    empty = (residual.sum(dim=-1) <= 0).view(-1, 1)
    residual = torch.where(empty, p, residual)
    token = residual.div_(row_noise(residual, info, reqs, "exponential")).argmax(dim=-1)
    if greedy_ids is not None:
        g = info.greedy_rows
        choice = torch.where(g, _column_of(children, greedy_ids, none), choice)
        token = torch.where(g, greedy_ids, token)
    return choice, token


def _column_of(children: torch.Tensor, ids: torch.Tensor, none: torch.Tensor) -> torch.Tensor:
    """(R,) the column of children (R, T) holding ids[r] (children are distinct), else -1."""
    hit = children == ids.view(-1, 1)  # (R, T); -1 padding never equals a token id
    col = hit.to(torch.int64).argmax(dim=-1)
    return torch.where(hit.any(dim=-1), col, none)
