"""Draft trees of a draft model or an EAGLE-3 head (`--speculative-eagle-topk` > 1): the
draft expands the best paths.

From the draft's logits after each drafting request's last token, level 1 is its top-k tokens.
Then at each level j = 2..S the top-k beams (the best paths so far by summed log-probability
under the draft) each run one draft decode row, the beam's token at position base + j - 2
(base: the position of the request's first draft input: the draft model's seqlen, the head's
kv_len), and propose top-k children: k * k candidates, of which the best k are the next beams.
Every candidate is kept; after the last level the best `nodes` of them (never deeper than the
request's chosen depth) form its tree (tree.select_tree), verified by tree_verify.py.

A beam's row attends to its own path only: each beam has a scratch row of the draft's
req_to_token (ReqToTokenPool.spare_rows: the target's for the head, whose KV is indexed by the
target's slots; the draft model's own) holding the request's history and its path's slots,
copied from its parent's row at each level (one gather), its K/V in a slot taken from the
draft's free slots and freed after the drafting: the verify computes the kept tokens for real,
and the draft's next catch-up computes them on the draft. Rows are request-major: request f's
beams are rows f*k .. f*k + k - 1, and a request whose depth ends before level j leaves the
batch there (the requests come deepest first), so no row ever runs past its request's room.

Scores are the draft's raw log-probabilities (no penalties, temperature or grammar: they only
choose which nodes are verified; the verify applies the request's sampling exactly). One
device -> host copy of all candidates after the last level: the tree's shape is the host's
to know (the verify's rows and scratch rows are laid out there).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from radixlm.runtime.executor.forward_batch import ForwardBatch, ForwardMode
from radixlm.runtime.speculative import grammar_drafts
from radixlm.runtime.speculative.tree import DraftTree, select_tree


@dataclass
class Beams:
    """The draft side of a tree's drafting."""

    topk: int
    rt: torch.Tensor  # (rows, context) the draft's req_to_token (scratch rows included)
    allocator: object  # the draft's slot allocator (the beams' K/V)
    # forward(fb, state (rows, H) or None) -> (logits (rows, V) float32 over the target's
    # vocabulary, the next level's state (rows, H) or None): one decode batch of beams
    forward: Callable


def draft_trees(beams: Beams, c_rows: torch.Tensor, c_base: torch.Tensor, base: list[int],
                spare: torch.Tensor, depths: list[int], nodes: list[int], first: torch.Tensor,
                state: Optional[torch.Tensor]) -> tuple[list[DraftTree], int]:
    """For F drafting requests, deepest first: c_rows (F,) their rows of beams.rt, c_base /
    base (F,) on the device / host their first draft positions; spare (F * k,)
    scratch rows of beams.rt, a beam's each; depths / nodes: each one's tree depth (<= its
    room) and node count; first (F, V): the draft's logits after each one's last token;
    state (F, H): what a beam's row reads besides its token (EAGLE-3: the head's pre-norm
    output there), or None. Returns (their trees, draft forwards run)."""
    T, F, S = beams.topk, len(depths), max(depths)
    rt, dev = beams.rt, first.device
    lp, tok = _top(first, T)  # (F, T) each
    levels = [(lp, tok, None)]  # per level: scores, tokens (a, k or k * k), parent candidate
    beam_score, beam_tok = lp, tok  # (a, T)
    beam_cand = torch.arange(T, device=dev).expand(F, T)  # candidate index within the request
    feat = None if state is None else state.repeat_interleave(T, dim=0)  # (F * T, H)
    src = c_rows.repeat_interleave(T)  # (F * T,) the req_to_token row its history comes from
    pos0 = c_base.repeat_interleave(T)  # (F * T,)
    n_temp = T * sum(max(0, d - 1) for d in depths)
    temp = beams.allocator.alloc(n_temp) if n_temp else None
    assert temp is not None or not n_temp, "draft() checked the free slots"
    forwards, used, n_cand = 0, 0, T
    try:
        for j in range(2, S + 1):
            a = sum(1 for d in depths if d >= j)  # requests still drafting (a prefix)
            rows, p = spare[: a * T], pos0[: a * T] + (j - 2)
            width = max(base[:a]) + j - 2  # columns before each row's own position
            rt[rows, :width] = rt[src[: a * T], :width]  # (gathered first: rows may be sources)
            slots = temp[used : used + a * T]
            used += a * T
            rt[rows, p] = slots
            fb = ForwardBatch(
                mode=ForwardMode.DECODE, input_ids=beam_tok[:a].reshape(-1), positions=p,
                out_cache_loc=slots, req_pool_indices=rows, seq_lens=p + 1,
                logits_indices=torch.arange(a * T, device=dev),
                seq_lens_cpu=[base[f] + j - 1 for f in range(a) for _ in range(T)])
            forwards += 1
            logits, nxt = beams.forward(fb, None if feat is None else feat[: a * T])
            c_lp, c_tok = _top(logits, T)
            # (a, T * T): child (beam i, choice c) at column i * T + c
            score = (beam_score[:a].reshape(-1, 1) + c_lp).view(a, T * T)
            c_tok = c_tok.view(a, T * T)
            parent = beam_cand[:a].repeat_interleave(T, dim=1)  # (a, T * T)
            levels.append((score, c_tok, parent))
            if j < S:
                b = sum(1 for d in depths if d > j)
                beam_score, best = score[:b].topk(T, dim=-1)  # (b, T)
                beam_tok = c_tok[:b].gather(1, best)
                beam_cand = n_cand + best
                from_row = (torch.arange(b, device=dev).view(-1, 1) * T
                            + torch.div(best, T, rounding_mode="floor")).view(-1)  # (b * T,)
                src = rows[from_row]
                if nxt is not None:  # (a copy: nxt may be a graph's buffer)
                    feat = nxt[from_row]
            n_cand += T * T
    finally:
        if temp is not None:
            beams.allocator.free(temp)
    return _trees(levels, depths, nodes), forwards


def prune_trees(spec, reqs: list, chain: list[int], trees: list[DraftTree]) -> list:
    """Each drafting request's tree cut by its stop tokens and grammar (reqs[chain[f]] drafted
    trees[f]); the others' drafts: [] each. A grammar that raises fails its request alone."""
    drafts: list = [[] for _ in reqs]
    for i, t in zip(chain, trees):
        try:
            drafts[i] = grammar_drafts.prune_tree(reqs[i], t)
        except Exception as e:
            spec.draft_failed(reqs[i], e, "its grammar in the draft tree")
    return drafts


def tree_sizes(cfg, spare: int, cap, ks: list[int]) -> list[int]:
    """Each request's tree size for depth ks[i] (0: none), within the verify's rows (`cap`,
    None: no limit) and the `spare` scratch rows (a beam's row while drafting, a node's in the
    verify); ks of requests that do not fit become 0 (edited in place)."""
    rows, drafting, nodes = len(ks), 0, []
    for i, k in enumerate(ks):
        n = cfg.tree_rows(k)
        if n and ((cap is not None and rows + n > cap) or sum(nodes) + n > spare
                  or (drafting + 1) * cfg.topk > spare):
            ks[i], n = 0, 0
        rows += n
        drafting += 1 if n else 0
        nodes.append(n)
    return nodes


def _top(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """logits (N, V) -> the k best (log-probabilities (N, k) float32, token ids (N, k))."""
    return torch.log_softmax(logits.float(), dim=-1).topk(k, dim=-1)


def _trees(levels, depths: list[int], nodes: list[int]) -> list[DraftTree]:
    """Every level's candidates to the host in one copy, then each request's tree."""
    parts = []
    for score, tok, parent in levels:
        parts += [score.double().reshape(-1), tok.double().reshape(-1)]
        if parent is not None:
            parts.append(parent.double().reshape(-1))
    flat = torch.cat(parts).tolist()  # the drafting's one sync
    F = len(depths)
    cand = [([], [], [], []) for _ in range(F)]  # per request: scores, tokens, parents, depths
    at = 0
    for j, (score, _, parent) in enumerate(levels, start=1):
        a, w = score.shape
        s, t = flat[at : at + a * w], flat[at + a * w : at + 2 * a * w]
        at += 2 * a * w
        par = [-1.0] * (a * w)
        if parent is not None:
            par = flat[at : at + a * w]
            at += a * w
        for f in range(a):
            c = cand[f]
            c[0].extend(s[f * w : (f + 1) * w])
            c[1].extend(int(x) for x in t[f * w : (f + 1) * w])
            c[2].extend(int(x) for x in par[f * w : (f + 1) * w])
            c[3].extend([j] * w)
    return [select_tree(*cand[f], nodes[f], depths[f]) for f in range(F)]
