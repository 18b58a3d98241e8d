"""The verify forward of draft trees (tree.py), as decode rows over scratch req_to_token rows.

Request b (kv_len L_b, pool row P_b, tree of N_b nodes) computes N_b + 1 rows: its root (its
last token) at position L_b in its own row P_b, and node n at position L_b + depth(n) in a
scratch row of its own (ReqToTokenPool.spare_rows) that holds P_b's first L_b + 1 slots (the
history and the root) and then the slots of n's path: its ancestors' and its own. As a decode
row of seq_len L_b + depth(n) + 1, node n then attends to exactly its history and its path: the
tree's attention mask, with no mask, no extend kernel, and through the decode CUDA graphs (the
pool rows are a graph input). Every row's K/V is in the pool before any attention runs, and
each row computes what a plain decode step at its position computes (verify.py's `as_decode`).

Host work: the rows' layout, one int64 tensor copied once (verify.py's staging); device: the
root slots and the scratch rows' paths (one index_copy_ each) and their history (one gather
of (nodes, max L_b + 1)). After acceptance the caller writes the accepted path's slots into
P_b (`write_paths`) and frees every other slot of the step.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
import torch

from radixlm.runtime.executor.forward_batch import ForwardBatch, ForwardMode
from radixlm.runtime.executor.host_staging import staged
from radixlm.runtime.request import Req
from radixlm.runtime.sampling.logprobs import token_logprobs
from radixlm.runtime.sampling.sampler import SampleOutput
from radixlm.runtime.scheduler.output import LogprobRows
from radixlm.runtime.speculative.tree import DraftTree, accept_tree_rows
from radixlm.runtime.speculative.verify import VerifyPlan, VerifyResult


@dataclass
class TreePlan(VerifyPlan):
    children: list[list[int]] = None  # (R,) each row's children's rows, in trial order


def build_tree_verify(reqs: list[Req], running_rows: list[int], drafts: list, req_pool,
                      allocator, device: torch.device) -> tuple[ForwardBatch, TreePlan]:
    """drafts[b]: a DraftTree, or [] (the root alone). Decode rows, request by request."""
    B = len(reqs)
    trees = [d if isinstance(d, DraftTree) else DraftTree([], []) for d in drafts]
    ext = [len(t) + 1 for t in trees]
    offsets = [0, *itertools.accumulate(ext)][:-1]
    R = sum(ext)
    spare = req_pool.spare_rows
    assert R - B <= len(spare), "the drafter chose within the scratch rows"
    slots = allocator.alloc(R)
    assert slots is not None, "the caller checked the free slots"
    width = req_pool.req_to_token.shape[1]
    kv_lens = [r.kv_len for r in reqs]
    ids, pos, pool, row_b, depth, children = [], [], [], [], [], []
    anc: list[list[int]] = []  # (R,) each row's path tokens below the root (the drafts before)
    src, dst, path_flat, path_slot = [], [], [], []  # scratch rows' history and paths
    root_flat, root_row = [], []
    used = 0
    for b, (req, t) in enumerate(zip(reqs, trees)):
        off, L, P = offsets[b], kv_lens[b], req.req_pool_idx
        dep = t.depths()
        last = req.output_ids[-1]
        kids: list[list[int]] = [[] for _ in range(len(t) + 1)]
        paths: list[list[int]] = [[]]  # row offset -> its path's rows (root excluded)
        for n, parent in enumerate(t.parents):
            kids[parent + 1].append(off + n + 1)
            paths.append(paths[parent + 1] + [off + n + 1])
        ids += [last] + t.tokens
        pos += [L] + [L + d for d in dep]
        rows = spare[used : used + len(t)]
        used += len(t)
        pool += [P] + rows
        row_b += [b] * (len(t) + 1)
        depth += [0] + dep
        children += kids
        root_flat.append(P * width + L)
        root_row.append(off)
        anc.append([])  # the root's row: no drafts before it
        for n, row in enumerate(rows):
            path = paths[n + 1]
            anc.append([ids[r] for r in path])  # (ids: the tokens by row, so far)
            src.append(P)
            dst.append(row)
            path_flat += [row * width + L + 1 + i for i in range(len(path))]
            path_slot += path
    T = max(map(len, children), default=0) or 1
    D = max(depth, default=0) or 1
    kid_grid = [[ids[c] for c in k] + [-1] * (T - len(k)) for k in children]
    anc_grid = [a + [-1] * (D - len(a)) for a in anc]
    S, H = len(src), len(path_flat)
    flat = staged(
        ids + pos + pool + [p + 1 for p in pos] + row_b + depth
        + [running_rows[b] for b in row_b] + list(range(R))
        + list(itertools.chain.from_iterable(kid_grid))
        + list(itertools.chain.from_iterable(anc_grid))
        + root_flat + root_row + src + dst + path_flat + path_slot, device)
    rows8 = flat[: 8 * R].view(8, R)
    row = rows8.unbind(0)
    at = 8 * R
    kid_dev = flat[at : at + R * T].view(R, T)
    at += R * T
    anc_dev = flat[at : at + R * D].view(R, D)
    at += R * D
    root_idx, root_src, src_dev, dst_dev, path_idx, path_src = torch.split(
        flat[at:], [B, B, S, S, H, H])
    rt = req_pool.req_to_token
    rt.view(-1).index_copy_(0, root_idx, slots[root_src])
    if S:
        hist = max(L for L, t in zip(kv_lens, trees) if len(t)) + 1
        rt[dst_dev, :hist] = rt[src_dev, :hist]  # (a gather first: dst rows are not sources)
        rt.view(-1).index_copy_(0, path_idx, slots[path_src])
    dev = {"row_b": row[4], "depth": row[5], "info_row": row[6], "children": kid_dev,
           "ancestors": anc_dev}
    fb = ForwardBatch(
        mode=ForwardMode.DECODE, input_ids=row[0], positions=row[1], out_cache_loc=slots,
        req_pool_indices=row[2], seq_lens=row[3], logits_indices=row[7],
        seq_lens_cpu=[p + 1 for p in pos], graph_inputs=rows8[:4])
    plan = TreePlan(reqs, running_rows, [list(t.tokens) for t in trees], offsets, kv_lens, slots,
                    row_b, dev, children=children)
    return fb, plan


def verify_tree(logits: torch.Tensor, plan: TreePlan, running_info, sampler, apply_grammar,
                want_logprob: bool, top_logprobs_num: int) -> VerifyResult:
    """Accept every request's tree at once (tree.py): logits (R, V) float32 in plan's rows."""
    dev = plan.dev
    info = running_info.take([plan.running_rows[b] for b in plan.row_b], index=dev["info_row"],
                             lazy=True)
    anc = dev["ancestors"]  # (R, D) the drafts before each row (they count as output)
    if info.output_counts is not None:
        info.output_counts.scatter_add_(1, anc.clamp(min=0), (anc >= 0).float())
    if info.min_tokens_left is not None:
        info.min_tokens_left = (info.min_tokens_left - dev["depth"]).clamp_(min=0)
    apply_grammar(logits)
    raw = logits.clone() if want_logprob else None
    kids = dev["children"]
    choice, token = accept_tree_rows(logits, info, [plan.reqs[b] for b in plan.row_b], kids,
                                     sampler)
    # (R,) the token each row emits when the walk passes it: its accepted child's, or its own
    chosen = torch.where(choice >= 0, kids.gather(1, choice.clamp(min=0).view(-1, 1)).view(-1),
                         token)
    lp = None
    if want_logprob:
        vals, top_vals, top_ids = token_logprobs(raw, chosen, top_logprobs_num)
        lp = LogprobRows(SampleOutput(chosen, vals, top_vals, top_ids, raw_logits=raw))
    R = plan.num_rows
    flat = torch.cat([choice, chosen]).tolist()  # the step's one sync
    ch, tok = flat[:R], flat[R:]
    accepted, tokens, paths = [], [], []
    for off in plan.offsets:
        r, path = off, [off]
        while ch[r] >= 0:
            r = plan.children[r][ch[r]]
            path.append(r)
        accepted.append(len(path) - 1)
        tokens.append([tok[x] for x in path])
        paths.append(path)
    return VerifyResult(accepted, tokens, lp, paths)


def write_paths(plan: TreePlan, paths: list[list[int]], req_pool) -> None:
    """Request b's accepted nodes' slots into its own row at L_b + 1 .. (the root's is there)."""
    width = req_pool.req_to_token.shape[1]
    flat, rows = [], []
    for b, path in enumerate(paths):
        base = plan.reqs[b].req_pool_idx * width + plan.kv_lens[b]
        flat += [base + j for j in range(1, len(path))]
        rows += path[1:]
    if flat:
        idx = staged(flat + rows, plan.slots.device)
        n = len(flat)
        req_pool.req_to_token.view(-1).index_copy_(0, idx[:n], plan.slots[idx[n:]])

