"""Drafts of grammar-constrained requests: checked against the request's matcher, masked per row.

The simplest exact scheme: walk the matcher through the draft and roll it back.
- `truncate`: cut a draft at its first token the grammar does not allow (or after the token that
  terminates it): the target's masked distribution gives such a token probability 0, so it and
  everything after could never be accepted.
- `masker`: row j of a request holds the grammar's mask after its drafts d_1..d_j, filled by
  walking the matcher again and rolled back, so the matcher is unchanged afterwards; the tokens
  the verify keeps are then accepted one by one as in plain decoding (TokenProcessing).
Per draft token that is two matcher steps on the host, the same kind of work plain decoding does
per token; only requests with a grammar pay it. A draft tree the same, node by node along each
node's path (`prune_tree`, `fill_tree_rows`). A draft model's chain (`ChainGrammar`) masks its
q the same way, walking each depth's drafts before the next depth.
A matcher that raises in `masker` or `ChainGrammar` is its request's own failure: `fail(req,
exc, where)` records it (the step fails that request alone, speculative/isolation.py) and the
other requests' rows are masked as before.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from radixlm.runtime.constrained.grammar import MaskBuffer, apply_bitmask_rows
from radixlm.runtime.speculative.tree import DraftTree


def truncate(req, draft: list[int]) -> list[int]:
    m = req.grammar
    if m is None or not draft:
        return draft
    ok = 0
    for t in draft:
        if m.is_terminated() or not m.accept_token(t):
            break
        ok += 1
    if ok:
        m.rollback(ok)
    return draft[:ok]


def masker(reqs: list, drafts: list[list[int]], offsets: list[int], rows: int,
           masks: MaskBuffer, fail: Callable) -> Callable[[torch.Tensor], None]:
    """A function that masks the (rows, V) verify logits of the constrained requests in place.
    A request whose matcher raises goes to `fail`; its rows are left unmasked (never kept)."""
    if not any(r.grammar is not None for r in reqs):
        return lambda logits: None
    bitmask = masks.get(rows)
    bitmask.fill_(-1)  # every token allowed on rows without a grammar (or after termination)
    constrained: list[int] = []
    for req, d, off in zip(reqs, drafts, offsets):
        if req.grammar is None:
            continue
        try:
            fill = fill_tree_rows if isinstance(d, DraftTree) else fill_rows
            constrained += fill(req, d, off, bitmask)
        except Exception as e:
            bitmask[off : off + len(d) + 1].fill_(-1)
            fail(req, e, "its grammar's masks of its verify rows")

    return lambda logits: apply_bitmask_rows(logits, bitmask, constrained, masks.vocab_size)


def fill_rows(req, d: list[int], off: int, bitmask: torch.Tensor) -> list[int]:
    """Fill the masks of `req`'s verify rows off .. off + len(d) (its matcher walked along its
    draft d and rolled back). Returns the rows it filled."""
    m = req.grammar
    walked = 0
    rows = []
    for j in range(len(d) + 1):
        if m.is_terminated():  # a draft ended the grammar: rows after it are never kept
            break
        m.fill_next_token_bitmask(bitmask, off + j)
        rows.append(off + j)
        if j < len(d):
            accepted = m.accept_token(d[j])
            assert accepted, "truncate() kept only drafts the grammar allows"
            walked += 1
    if walked:
        m.rollback(walked)
    return rows


def prune_tree(req, tree: DraftTree) -> DraftTree:
    """The nodes of a draft tree that `req` could keep: none below a stop token, and under a
    grammar none whose token it does not allow after the node's path (or after it ended): the
    target's masked p gives such a node probability 0, so it and its subtree are never kept."""
    stops, m = req.stop_token_ids, req.grammar
    new: list[int] = []  # old node -> new node, -1: pruned
    tokens, parents = [], []
    for n, (tok, par) in enumerate(zip(tree.tokens, tree.parents)):
        ok = par < 0 or (new[par] >= 0 and tree.tokens[par] not in stops)
        if ok and m is not None:
            path = _path(tree, n)
            walked = 0
            for t in path:
                if m.is_terminated() or not m.accept_token(t):
                    break
                walked += 1
            ok = walked == len(path)
            if walked:
                m.rollback(walked)
        new.append(len(tokens) if ok else -1)
        if ok:
            tokens.append(tok)
            parents.append(-1 if par < 0 else new[par])
    return DraftTree(tokens, parents)


def fill_tree_rows(req, tree: DraftTree, off: int, bitmask: torch.Tensor) -> list[int]:
    """Fill the masks of `req`'s tree verify rows: row off (the root) and off + 1 + n (node n)
    hold the grammar's mask after the node's path (its matcher walked along it and rolled
    back; prune_tree kept only paths it allows). A row whose path ended the grammar is left
    unfilled: the request finishes at that node's token, its row is never kept."""
    m = req.grammar
    rows = []
    if not m.is_terminated():
        m.fill_next_token_bitmask(bitmask, off)
        rows.append(off)
    for n in range(len(tree)):
        path = _path(tree, n)
        for t in path:
            accepted = m.accept_token(t)
            assert accepted, "prune_tree() kept only paths the grammar allows"
        if not m.is_terminated():
            m.fill_next_token_bitmask(bitmask, off + 1 + n)
            rows.append(off + 1 + n)
        m.rollback(len(path))
    return rows


def _path(tree: DraftTree, n: int) -> list[int]:
    """The tokens from the root's child down to node n."""
    out = []
    while n >= 0:
        out.append(tree.tokens[n])
        n = tree.parents[n]
    return out[::-1]


class ChainGrammar:
    """Grammar masks along a draft model's chain (standalone.py), so its q is masked as the
    target's p will be: before depth j each constrained request's matcher has walked
    d_1..d_{j-1} (undone by `rollback`). A draft that ends its grammar ends its chain (`cut`:
    drafts kept per chain request). Without grammars: nothing, no sync. A matcher that raises
    goes to `fail` and ends its chain request's drafts (the request fails after the chain)."""

    def __init__(self, creqs: list, masks: MaskBuffer, fail: Callable):
        self.creqs, self.masks, self.fail = creqs, masks, fail
        self.rows = [a for a, r in enumerate(creqs) if r.grammar is not None]
        self.cut = [1 << 30] * len(creqs)
        self.walked = [0] * len(creqs)
        self.host: Optional[list[int]] = None if not self.rows else []

    def mask(self, logits: torch.Tensor, active: int) -> None:
        live = [a for a in self.rows if a < active and self.cut[a] > self.walked[a]]
        if not live:
            return
        bitmask = self.masks.get(active)
        for a in list(live):
            try:
                self.creqs[a].grammar.fill_next_token_bitmask(bitmask, a)
            except Exception as e:
                live.remove(a)
                self._failed(a, e)
        apply_bitmask_rows(logits, bitmask, live, self.masks.vocab_size)

    def walk(self, tok: torch.Tensor, active: int) -> None:
        if not self.rows:
            return
        toks = tok.tolist()  # the matcher needs this depth's drafts on the host
        self.host += toks
        for a in self.rows:
            if a >= active or self.cut[a] <= self.walked[a]:
                continue
            try:
                self.walk_row(a, toks[a])
            except Exception as e:
                self._failed(a, e)

    def walk_row(self, a: int, tok: int) -> None:
        """Chain request a's matcher accepts its draft `tok`."""
        m = self.creqs[a].grammar
        ok = m.accept_token(tok)
        assert ok, "the draft was sampled under the grammar's mask"
        self.walked[a] += 1
        if m.is_terminated():
            self.cut[a] = self.walked[a]

    def rollback(self) -> None:
        for a in self.rows:
            walked, self.walked[a] = self.walked[a], 0
            if walked and self.cut[a] >= 0:
                try:
                    self.creqs[a].grammar.rollback(walked)
                except Exception as e:
                    self._failed(a, e)

    def _failed(self, a: int, exc: BaseException) -> None:
        """Chain request a's matcher raised: no drafts from it (cut -1: no more matcher calls,
        not even a rollback: the request fails and its matcher goes with it)."""
        if self.cut[a] >= 0:
            self.fail(self.creqs[a], exc, "its grammar in the draft chain")
        self.cut[a] = -1
