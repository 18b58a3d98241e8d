"""Shared-prefix (cascade) decode attention: a prefix that many running requests share is read
once per step for all of them, not once per request.

Why: with the radix cache, requests that share a prompt prefix hold the *same* KV slots for it
(`req_to_token[row, :n]` are the tree's slots). Plain decode attention still reads those slots
once per request per layer; with 16 requests on one 2048-token system prompt that is 16x the
memory traffic the prefix needs.

How (per layer, decode batches only):
1. own part: each row attends to its own keys `[kv_start[b], seq_len[b])`, where kv_start is
   its group's shared length (0 for rows in no group), giving (out_own, lse_own);
2. shared part: the queries of each group's members, packed together, attend non-causally to
   the group's prefix `req_to_token[rep_row, :shared_len]` in one extend-style call, so each
   key tile is loaded once for all members (out_sh, lse_sh);
3. merge by log-sum-exp: out = (out_own * e^lse_own + out_sh * e^lse_sh) / (e^lse_own + e^lse_sh).

Groups come from the radix tree: a running request's `last_node` is the tree node that ends its
tree-owned prefix; requests whose paths to the root pass through one node share every slot up
to that node's depth. `PrefixGrouper` assigns each request to its deepest ancestor that another
running request also passes through, and keeps the plan while the batch is unchanged.

A backend opts in with `supports_shared_prefix = True` and two ranged ops returning
(out, lse) with lse (rows, Hq) fp32 natural-log sum-exp of the scaled (and soft-capped, for
models with a logit soft-cap) scores; a model with any sliding-window layer plans no groups
(AttentionBackend.__init__ turns `supports_shared_prefix` off):
  ranged_decode(q (B,Hq,D), k_buf, v_buf, req_pool_indices (B,), kv_start (B,), seq_lens (B,))
  prefix_attention(q (M,Hq,D), k_buf, v_buf, groups: PrefixGroups)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

# A group is worth a second attention call only when it skips enough key reads; below these the
# extra launch and merge cost more than they save.
DEFAULT_MIN_SHARED = 128  # tokens of prefix a group must share
DEFAULT_MIN_SAVED_FRACTION = 0.25  # of all keys the plain decode step would read


@dataclass
class PrefixGroups:
    rows: torch.Tensor  # (M,) int64 batch rows of grouped requests, group after group
    qo_indptr: torch.Tensor  # (G+1,) int64 group g's rows are rows[qo_indptr[g]:qo_indptr[g+1]]
    rep_pool_indices: torch.Tensor  # (G,) int64 a member's req_to_token row (same prefix slots)
    shared_lens: torch.Tensor  # (G,) int64 prefix tokens the group shares
    zeros: torch.Tensor  # (G,) int64 the shared keys start at position 0
    kv_start: torch.Tensor  # (B,) int64 first own key of each row (its group's shared_len or 0)
    max_group: int  # most members in one group (sizes the extend grid)
    shared_lens_cpu: list[int]
    group_sizes_cpu: list[int]
    saved_tokens: int  # keys per layer per step the plain path would read and this one skips


class PrefixGrouper:
    """Plans `PrefixGroups` for decode batches of running requests.

    The plan is recomputed only when the batch changes (a request joins, leaves, or moves to
    another pool row or tree node); the tree-owned prefix slots of a running request are locked,
    so a kept plan stays exact while the batch is unchanged."""

    def __init__(self, device: torch.device, min_shared: int = DEFAULT_MIN_SHARED,
                 min_saved_fraction: float = DEFAULT_MIN_SAVED_FRACTION):
        self.device = device
        self.min_shared = min_shared
        self.min_saved_fraction = min_saved_fraction
        self._key: Optional[tuple] = None
        self._plan: Optional[PrefixGroups] = None
        self._total_at_plan = 0

    def plan(self, reqs: list) -> Optional[PrefixGroups]:
        key = tuple((r.rid, r.req_pool_idx, id(r.last_node)) for r in reqs)
        if key != self._key:
            self._key = key
            self._plan = find_prefix_groups(reqs, self.device, self.min_shared)
        if self._plan is None:
            return None
        # sequences grow every step: the share of keys the groups save shrinks slowly
        total = sum(r.kv_len + 1 for r in reqs)
        if self._plan.saved_tokens < self.min_saved_fraction * total:
            return None
        return self._plan


def find_prefix_groups(reqs: list, device: torch.device,
                       min_shared: int = DEFAULT_MIN_SHARED) -> Optional[PrefixGroups]:
    """Group the rows of `reqs` (a decode batch, in batch order) by shared tree prefix."""
    passes: dict[int, int] = {}  # id(node) -> running requests whose path passes through it
    chains: list[list[tuple[object, int]]] = []
    for r in reqs:
        chain = []
        node, depth = r.last_node, len(r.prefix_indices)
        while node is not None and node.parent is not None and depth >= min_shared:
            chain.append((node, depth))  # deepest first
            passes[id(node)] = passes.get(id(node), 0) + 1
            depth -= len(node.key)
            node = node.parent
        chains.append(chain)
    by_node: dict[int, tuple[int, list[int]]] = {}  # id(node) -> (depth, rows)
    for row, chain in enumerate(chains):
        for node, depth in chain:
            if passes[id(node)] >= 2:
                by_node.setdefault(id(node), (depth, []))[1].append(row)
                break
    groups = [(depth, rows) for depth, rows in by_node.values() if len(rows) >= 2]
    if not groups:
        return None
    rows, indptr, reps, lens, sizes = [], [0], [], [], []
    kv_start = [0] * len(reqs)
    for depth, members in groups:
        rows.extend(members)
        indptr.append(len(rows))
        reps.append(reqs[members[0]].req_pool_idx)
        lens.append(depth)
        sizes.append(len(members))
        for m in members:
            kv_start[m] = depth
    g = len(groups)
    # one host->device copy: [rows (M) | indptr (G+1) | reps (G) | lens (G) | zeros (G) | kv_start (B)]
    packed = torch.tensor(rows + indptr + reps + lens + [0] * g + kv_start, dtype=torch.int64)
    if device.type == "cuda":
        packed = packed.pin_memory()
    packed = packed.to(device, non_blocking=True)
    m = len(rows)
    cuts = [m, g + 1, g, g, g, len(reqs)]
    parts = torch.split(packed, cuts)
    return PrefixGroups(
        rows=parts[0], qo_indptr=parts[1], rep_pool_indices=parts[2], shared_lens=parts[3],
        zeros=parts[4], kv_start=parts[5], max_group=max(sizes), shared_lens_cpu=lens,
        group_sizes_cpu=sizes, saved_tokens=sum((n - 1) * d for n, d in zip(sizes, lens)))


def merge_states(o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor,
                 lse_b: torch.Tensor) -> torch.Tensor:
    """Attention over the union of two disjoint key sets from each set's (out, lse).
    o_* (R, H, D), lse_* (R, H) fp32 -> (R, H, D) in o_a's dtype."""
    m = torch.maximum(lse_a, lse_b)
    w_a = torch.exp(lse_a - m).unsqueeze(-1)  # (R, H, 1); a side with no keys has lse -inf -> 0
    w_b = torch.exp(lse_b - m).unsqueeze(-1)
    out = (o_a.float() * w_a + o_b.float() * w_b) / (w_a + w_b)
    return out.to(o_a.dtype)


def decode_with_groups(backend, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
                       fb) -> torch.Tensor:
    """Decode attention for q (B, Hq, D) of `fb` (mode DECODE, fb.prefix_groups set)."""
    groups: PrefixGroups = fb.prefix_groups
    out, lse = backend.ranged_decode(q, k_buf, v_buf, fb.req_pool_indices, groups.kv_start,
                                     fb.seq_lens)
    q_sh = q.index_select(0, groups.rows)  # (M, Hq, D), members packed group by group
    o_sh, lse_sh = backend.prefix_attention(q_sh, k_buf, v_buf, groups)
    merge_into = getattr(backend, "merge_prefix_into", None)  # a backend's fused version
    if merge_into is not None:
        return merge_into(out, lse, groups.rows, o_sh, lse_sh)
    merged = merge_states(o_sh, lse_sh, out.index_select(0, groups.rows),
                          lse.index_select(0, groups.rows))
    out.index_copy_(0, groups.rows, merged)
    return out


# --- plain torch versions of the ranged ops (the reference; TorchNativeAttention uses them) -----
def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor],
            scale: float, softcap: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """q (R, Hkv, G, D), k/v (R, Hkv, L, D), mask (R, 1, 1, L) bool or None -> out (R, Hkv*G, D)
    in q's dtype and lse (R, Hkv*G) fp32; a row with no visible key gives out 0, lse -inf.
    softcap c > 0: scores c * tanh(score / c) (the lse is of the capped scores, so merges stay
    exact)."""
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale  # (R, Hkv, G, L)
    if softcap:
        s = torch.tanh(s / softcap) * softcap
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # (R, Hkv, G)
    p = torch.exp(s - lse.unsqueeze(-1)).nan_to_num(0.0)
    out = torch.matmul(p, v.float())  # (R, Hkv, G, D)
    r = q.shape[0]
    return out.reshape(r, -1, q.shape[-1]).to(q.dtype), lse.reshape(r, -1)


def torch_ranged_decode(q, k_buf, v_buf, req_to_token, req_pool_indices, kv_start, seq_lens,
                        scale: float, softcap: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Row b attends to slots req_to_token[req_pool_indices[b], kv_start[b]:seq_lens[b]]."""
    bsz, hq, d = q.shape
    hkv = k_buf.shape[1]
    max_len = int(seq_lens.max())
    slots = req_to_token[req_pool_indices, :max_len].reshape(-1)
    k = k_buf.index_select(0, slots).view(bsz, max_len, hkv, d).transpose(1, 2)
    v = v_buf.index_select(0, slots).view(bsz, max_len, hkv, d).transpose(1, 2)
    ar = torch.arange(max_len, device=q.device)
    mask = (ar[None, :] >= kv_start[:, None]) & (ar[None, :] < seq_lens[:, None])
    return _attend(q.view(bsz, hkv, hq // hkv, d), k, v, mask.view(bsz, 1, 1, max_len), scale,
                   softcap)


def torch_prefix_attention(q, k_buf, v_buf, req_to_token, groups: PrefixGroups, scale: float,
                           softcap: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """q (M, Hq, D) packed by group; group g's rows attend to its rep row's first shared_len."""
    hkv, d = k_buf.shape[1], k_buf.shape[2]
    hq = q.shape[1]
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
    reps = groups.rep_pool_indices.tolist()
    start = 0
    for rep, n, size in zip(reps, groups.shared_lens_cpu, groups.group_sizes_cpu):
        slots = req_to_token[rep, :n]
        k = k_buf.index_select(0, slots).transpose(0, 1).unsqueeze(0)  # (1, Hkv, n, D)
        v = v_buf.index_select(0, slots).transpose(0, 1).unsqueeze(0)
        # all members' query heads of one KV head form one block of rows: (1, Hkv, size*G, D)
        qg = q[start:start + size].view(size, hkv, hq // hkv, d).permute(1, 0, 2, 3)
        o, l = _attend(qg.reshape(1, hkv, -1, d), k, v, None, scale, softcap)  # (1, Hkv*size*G, ...)
        out[start:start + size] = o.view(hkv, size, hq // hkv, d).permute(1, 0, 2, 3).reshape(
            size, hq, d)
        lse[start:start + size] = l.view(hkv, size, hq // hkv).permute(1, 0, 2).reshape(size, hq)
        start += size
    return out, lse
