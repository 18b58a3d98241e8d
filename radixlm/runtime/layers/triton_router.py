"""DeepSeek's expert choice in one Triton kernel (models/deepseek_moe.Router on CUDA): from the
router's fp32 logits to each token's top-k experts in ascending order with their weights.

Why: the torch form is a softmax or sigmoid, a top-k, a product, and (for the grouped methods) a
view, a group top-k, a zeros, a scatter and a masked fill, then the experts' sort of the ids and
gather of the weights (models/moe.Experts): 5-11 launches a MoE layer, the same again in every
layer of a batch-1 decode step. Here one program per token does all of it in registers:
  - scores: softmax(logits) (V2) or sigmoid(logits) (V3), in fp32;
  - groups (group_limited_greedy: a group's best score; noaux_tc: the sum of its two best
    bias-corrected scores): the topk_group best groups kept, the others' experts out;
  - top-k: k rounds of "the best expert left" (the lowest index among equals), then the chosen
    set written out in ascending expert order (HF adds the experts' outputs in that order);
  - weights: the chosen plain scores (V3: divided by their sum + 1e-20 with norm_topk_prob),
    times routed_scaling_factor.
Same math as Router.forward; softmax and sums may round differently from torch's kernels in
the last bit of fp32 (a tie within one ulp at the k-th place could then choose another expert).
The logits stay a cuBLAS GEMV: computed in this kernel (one program a token reading the router's
0.5 MB fp32 weight, V2-Lite) batch-1 decode fell from 297 to 247 tok/s on an H200.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

GREEDY, GROUP_MAX, GROUP_TOP2 = 0, 1, 2  # the choice: plain top-k, V2's groups, V3's groups


@triton.jit
def _best(v, ee):
    # (the value, the lowest index holding it) of v (N,)
    m = tl.max(v, axis=0)
    return m, tl.min(tl.where(v == m, ee, v.shape[0]), axis=0)


@triton.jit
def _select_kernel(Logits, Bias, Ids, W, E, scaling, K: tl.constexpr, E_PAD: tl.constexpr,
                   SIGMOID: tl.constexpr, GROUPS: tl.constexpr, N_GROUP: tl.constexpr,
                   TOPK_GROUP: tl.constexpr, NORM: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    ee = tl.arange(0, E_PAD)
    ok = ee < E
    x = tl.load(Logits + t * E + ee, mask=ok, other=float("-inf"))
    if SIGMOID:
        scores = 1.0 / (1.0 + tl.exp(-x))
        choice = scores + tl.load(Bias + ee, mask=ok, other=0.0)
    else:
        p = tl.exp(x - tl.max(x, axis=0))
        scores = p / tl.sum(p, axis=0)
        choice = scores
    choice = tl.where(ok, choice, float("-inf"))
    if GROUPS != 0:
        S: tl.constexpr = E_PAD // N_GROUP
        g = tl.reshape(choice, (N_GROUP, S))
        gs = tl.arange(0, S)
        top = tl.max(g, axis=1)  # (N_GROUP,)
        if GROUPS == 2:  # the two best: the best, then the best of the rest
            first = tl.min(tl.where(g == top[:, None], gs[None, :], S), axis=1)
            rest = tl.where(gs[None, :] == first[:, None], float("-inf"), g)
            top = top + tl.max(rest, axis=1)
        gi = tl.arange(0, N_GROUP)
        keep = gi < 0
        for _ in tl.static_range(TOPK_GROUP):
            _, j = _best(tl.where(keep, float("-inf"), top), gi)
            keep = keep | (gi == j)
        kept = tl.reshape(tl.broadcast_to(keep[:, None], (N_GROUP, S)), (E_PAD,))
        # V2 zeroes the dropped groups' scores (they can still be chosen past the kept ones), V3
        # rules them out
        choice = tl.where(kept, choice, 0.0 if GROUPS == 1 else float("-inf"))
        choice = tl.where(ok, choice, float("-inf"))
    chosen = ee < 0
    for _ in tl.static_range(K):
        _, j = _best(tl.where(chosen, float("-inf"), choice), ee)
        chosen = chosen | (ee == j)
    w = tl.where(chosen, scores, 0.0)
    if GROUPS == 1:  # (V2's weights are the masked scores: 0 for a dropped group's expert)
        w = tl.where(chosen, choice, 0.0)
    if NORM:
        w = w / (tl.sum(w, axis=0) + 1e-20)
    slot = tl.cumsum(chosen.to(tl.int32), axis=0) - 1  # ascending expert order
    tl.store(Ids + t * K + slot, ee.to(tl.int64), mask=chosen)
    tl.store(W + t * K + slot, w * scaling, mask=chosen)


def select(logits: torch.Tensor, top_k: int, scaling: float, *, sigmoid: bool, groups: int = 0,
           n_group: int = 1, topk_group: int = 1, norm: bool = False,
           bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits (T, E) fp32 -> (ids (T, k) int64 ascending, weights (T, k) fp32); `groups`: GREEDY,
    GROUP_MAX or GROUP_TOP2 (n_group groups of E / n_group experts, topk_group kept)."""
    t, e = logits.shape
    assert logits.dtype == torch.float32 and logits.is_contiguous() and top_k <= e
    e_pad = triton.next_power_of_2(e)
    if groups:
        assert e % n_group == 0 and e_pad == e and n_group == triton.next_power_of_2(n_group)
    ids = torch.empty((t, top_k), dtype=torch.int64, device=logits.device)
    w = torch.empty((t, top_k), dtype=torch.float32, device=logits.device)
    if t:
        _select_kernel[(t,)](logits, bias if bias is not None else logits, ids, w, e,
                             float(scaling), K=top_k, E_PAD=e_pad, SIGMOID=sigmoid,
                             GROUPS=groups, N_GROUP=n_group if groups else 1,
                             TOPK_GROUP=topk_group if groups else 1, NORM=norm,
                             num_warps=1 if e_pad <= 64 else 4)
    return ids, w
