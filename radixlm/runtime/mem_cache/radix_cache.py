"""RadixAttention's prefix cache: a radix tree over token ids whose nodes own KV slots (page size 1).

Each edge (node) holds a run of tokens `key` (tuple[int], length L >= 1) and the KV slots of those
tokens `value` (int64 tensor, shape (L,)); the path root..node spells a token prefix, and the
concatenated values along it are that prefix's KV slots. Children are keyed by their first token, so
two children of one node never start with the same token.

Ownership (the KV accounting invariant of DESIGN.md section 3):
    allocator.free_slots + slots in tree nodes + slots owned by running requests == capacity.
A slot lives in exactly one of those places. The tree takes ownership of a slot when `insert` stores
it, and gives it back to the allocator only in `evict`. For a running request with table row r,
`req_to_token[r, :len(req.prefix_indices)]` are tree slots (locked via `req.last_node`) and the
rest of its written slots are the request's own.

Locking is by path: `inc_lock_ref(node)` adds one reference to every node on root..node, so a node's
lock_ref is always >= each child's. Locked nodes are never evicted; only unlocked leaves are, in LRU
order, and a parent whose last child goes becomes a leaf candidate. `evictable_size` (tokens in
unlocked nodes) and `protected_size` (tokens in locked nodes) move by O(path) on each lock/unlock.

Disabled cache (`disable=True`): the tree stays empty; `match_prefix` returns (empty, root) and the
cache_* methods only manage the request's own slots. `cache_unfinished_req` then sets
`req.prefix_indices` to the request's *own* slots (so the next chunk extends after them) — they are
NOT tree slots: the tree holds 0 tokens, so the accounting counts all of
`req_to_token[r, :kv_len]` as request-owned; see `tree_owned_len`.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Optional

import torch

from radixlm.runtime.mem_cache.allocator import TokenSlotAllocator
from radixlm.runtime.mem_cache.node_logprobs import (TokenLogprobs, check_node_logprobs,
                                                     merge_logprobs, path_logprobs, split_logprobs)
from radixlm.runtime.mem_cache.req_to_token import ReqToTokenPool

_node_ids = itertools.count()


class TreeNode:
    __slots__ = ("key", "value", "parent", "children", "lock_ref", "last_access", "id", "logprobs")

    def __init__(self, key: tuple = (), value: Optional[torch.Tensor] = None, parent=None):
        self.key: tuple[int, ...] = key
        self.value: torch.Tensor = value if value is not None else torch.empty(0, dtype=torch.int64)
        self.parent: Optional[TreeNode] = parent
        self.children: dict[int, TreeNode] = {}  # first token of child.key -> child
        self.lock_ref = 0
        self.last_access = 0  # LRU tick (a counter, so tests are deterministic)
        self.id = next(_node_ids)  # heap tie-break
        # each token's raw-model logprob (and top-k), or None: all unknown (node_logprobs.py)
        self.logprobs: Optional[TokenLogprobs] = None

    def __repr__(self) -> str:
        return f"TreeNode(id={self.id}, len={len(self.key)}, lock={self.lock_ref})"


def _common_len(key: tuple, tokens: tuple, start: int) -> int:
    """Length of the common prefix of `key` and `tokens[start:]` (slice compare first: C speed)."""
    n = min(len(key), len(tokens) - start)
    if key[:n] == tokens[start : start + n]:
        return n
    i = 0
    while key[i] == tokens[start + i]:
        i += 1
    return i


class RadixCache:
    def __init__(
        self,
        allocator: TokenSlotAllocator,
        req_to_token_pool: ReqToTokenPool,
        disable: bool = False,
    ):
        self.allocator = allocator
        self.req_to_token_pool = req_to_token_pool
        self.disable = disable
        self._clock = 0
        self.reset()

    # --- sizes ---------------------------------------------------------------------------------
    def reset(self) -> None:
        """Drop the whole tree. The caller clears the allocator (the slots are not freed here)."""
        self.root = TreeNode(value=self._empty())
        self._evictable = 0
        self._protected = 0
        # non-root nodes without children: the eviction candidates (if unlocked)
        self._leaves: set[TreeNode] = set()

    def evictable_size(self) -> int:
        return self._evictable

    def protected_size(self) -> int:
        return self._protected

    def total_size(self) -> int:
        return self._evictable + self._protected

    def tree_owned_len(self, req) -> int:
        """How many of the request's leading slots the tree owns (0 when the cache is disabled)."""
        return 0 if self.disable else len(req.prefix_indices)

    # --- lookup / insert -------------------------------------------------------------------------
    def match_prefix(self, token_ids: list[int]) -> tuple[torch.Tensor, TreeNode]:
        """Slots (int64, shape (n,)) of the longest cached prefix of `token_ids`, and the node whose
        path spells exactly that prefix (a node is split if the match ends inside it)."""
        if self.disable or not token_ids:
            return self._empty(), self.root
        tokens = tuple(token_ids)
        tick = self._tick()
        node, pos, values = self.root, 0, []
        while pos < len(tokens):
            child = self._descend(node, tokens, pos, tick)
            if child is None:
                break
            values.append(child.value)
            # after a split, `child` ends where the match ends; the next lookup misses and exits
            node, pos = child, pos + len(child.key)
        return (torch.cat(values) if values else self._empty()), node

    def insert(self, token_ids: list[int], slots: torch.Tensor,
               logprobs: Optional[TokenLogprobs] = None) -> int:
        """Store token_ids -> slots (int64, shape (len(token_ids),)). Returns how many leading tokens
        were already cached: the tree keeps its own slots for those, so the caller still owns (and
        must free) `slots[:returned]`; the tree takes ownership of `slots[returned:]`.
        `logprobs` (len(token_ids) tokens' values, NaN unknown) fill the path's unknown entries."""
        if self.disable:
            raise RuntimeError("RadixCache.insert called with the cache disabled")
        assert slots.numel() == len(token_ids), (slots.numel(), len(token_ids))
        tokens = tuple(token_ids)
        tick = self._tick()
        node, pos = self.root, 0
        while pos < len(tokens):
            child = self._descend(node, tokens, pos, tick)
            if child is None:
                # copy: `slots` is often a view of a req_to_token row that will be overwritten
                leaf = self._add_leaf(node, tokens[pos:], slots[pos:].clone(), tick)
                merge_logprobs(leaf, None if logprobs is None else logprobs[pos:])
                return pos
            if logprobs is not None:
                merge_logprobs(child, logprobs[pos : pos + len(child.key)])
            node, pos = child, pos + len(child.key)
        return pos

    def cached_logprobs(self, token_ids: list[int]) -> TokenLogprobs:
        """Stored logprobs (NaN unknown) of the longest cached prefix of token_ids (a copy)."""
        if self.disable or not token_ids:
            return TokenLogprobs.unknown(0)
        return path_logprobs(self.root, token_ids, _common_len)

    # --- locking -------------------------------------------------------------------------------
    def inc_lock_ref(self, node: Optional[TreeNode]) -> None:
        """Lock root..node against eviction. Root (and None) are no-ops."""
        if node is not None and node.parent is None and node is not self.root:
            # evicted nodes are detached (see evict): locking one would count freed slots
            raise AssertionError(f"inc_lock_ref on evicted {node}: the match it came from is stale")
        while node is not None and node is not self.root:
            if node.lock_ref == 0:
                self._evictable -= len(node.key)
                self._protected += len(node.key)
            node.lock_ref += 1
            node = node.parent

    def dec_lock_ref(self, node: Optional[TreeNode]) -> None:
        """Undo one `inc_lock_ref(node)`."""
        while node is not None and node is not self.root:
            if node.lock_ref <= 0:
                raise AssertionError(f"dec_lock_ref on unlocked {node}")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._protected -= len(node.key)
                self._evictable += len(node.key)
            node = node.parent

    # --- eviction ------------------------------------------------------------------------------
    def evict(self, num_tokens: int) -> int:
        """Free >= num_tokens slots (fewer only if everything unlocked is gone) by removing unlocked
        leaves, least recently used first. Returns the number of slots freed."""
        if num_tokens <= 0:
            return 0
        heap = [(n.last_access, n.id, n) for n in self._leaves if n.lock_ref == 0]
        heapq.heapify(heap)
        freed, values = 0, []
        while freed < num_tokens and heap:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            del parent.children[node.key[0]]
            self._leaves.discard(node)
            self._evictable -= len(node.key)
            freed += len(node.key)
            values.append(node.value)
            node.parent = None  # detached: a stale reference can no longer lock a live path
            if parent is not self.root and not parent.children:
                self._leaves.add(parent)
                if parent.lock_ref == 0:
                    heapq.heappush(heap, (parent.last_access, parent.id, parent))
        if values:
            self.allocator.free(torch.cat(values))
        return freed

    # --- request hooks -------------------------------------------------------------------------
    def cache_finished_req(self, req, token_ids: list[int]) -> None:
        """Hand a finished request's KV to the tree. `token_ids` are exactly the tokens whose KV is
        at `req_to_token[req.req_pool_idx, :len(token_ids)]`; slots beyond that in the row are the
        caller's to free. Frees the row and unlocks `req.last_node`; `req` itself is not modified."""
        row, n = req.req_pool_idx, len(token_ids)
        slots = self.req_to_token_pool.req_to_token[row, :n]  # (n,) view; insert copies what it keeps
        if self.disable:
            self.allocator.free(slots)
        else:
            self._insert_req_slots(req, token_ids, slots)
            self.dec_lock_ref(req.last_node)
        self.req_to_token_pool.free(row)

    def cache_unfinished_req(self, req, token_ids: list[int]) -> None:
        """Share a running request's computed prefix (e.g. after a prefill chunk). Afterwards the
        tree owns all of token_ids's KV, `req_to_token[row, :n]` holds the tree's slots, and the
        request holds a lock on the node for token_ids (the old lock is released)."""
        row, n = req.req_pool_idx, len(token_ids)
        slots = self.req_to_token_pool.req_to_token[row, :n]  # (n,) view; insert copies what it keeps
        if self.disable:
            # request-owned, not tree-owned (see module docstring / tree_owned_len)
            req.prefix_indices = slots.clone()
            req.last_node = self.root
            return
        self._insert_req_slots(req, token_ids, slots)
        indices, node = self.match_prefix(token_ids)
        assert indices.numel() == n, f"re-match found {indices.numel()} of {n} tokens just inserted"
        self.req_to_token_pool.write(row, 0, indices)
        self.inc_lock_ref(node)  # lock new before unlocking old: the shared path never dips to 0
        self.dec_lock_ref(req.last_node)
        req.prefix_indices = indices
        req.last_node = node

    def _insert_req_slots(self, req, token_ids: list[int], slots: torch.Tensor) -> int:
        """Insert; free the request's own slots that duplicate tree content: positions
        [len(prefix_indices), already) (those before came from the tree and are the tree's)."""
        already = self.insert(token_ids, slots, req.known_token_logprobs(len(token_ids)))
        own_start = len(req.prefix_indices)
        assert already >= min(own_start, len(token_ids)), "request's locked prefix left the tree"
        if already > own_start:
            self.allocator.free(slots[own_start:already])
        return already

    # --- debugging -----------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Walk the whole tree and assert the invariants in the module docstring."""
        evictable = protected = 0
        values, leaves = [], set()
        stack = [self.root]
        while stack:
            node = stack.pop()
            if node is not self.root:
                if not node.key or len(node.key) != node.value.numel():
                    raise AssertionError(f"{node}: key/value length mismatch")
                if node.lock_ref < 0:
                    raise AssertionError(f"{node}: negative lock_ref")
                check_node_logprobs(node)
                if node.parent is not self.root and node.lock_ref > node.parent.lock_ref:
                    raise AssertionError(f"{node}: locked more than its parent")
                if node.lock_ref:
                    protected += len(node.key)
                else:
                    evictable += len(node.key)
                values.append(node.value)
                if not node.children:
                    leaves.add(node)
            for first, child in node.children.items():
                if not child.key or child.key[0] != first or child.parent is not node:
                    raise AssertionError(f"{child}: bad link under first token {first}")
                stack.append(child)
        if (evictable, protected) != (self._evictable, self._protected):
            raise AssertionError(
                f"sizes: walked evictable={evictable} protected={protected}, "
                f"tracked {self._evictable}/{self._protected}"
            )
        if leaves != self._leaves:
            raise AssertionError("tracked leaf set differs from the tree's leaves")
        all_slots = torch.cat(values) if values else self._empty()
        if torch.unique(all_slots).numel() != all_slots.numel():
            raise AssertionError("a slot is owned by two tree positions")
        if all_slots.numel() and bool((all_slots < 1).any() | (all_slots > self.allocator.capacity).any()):
            raise AssertionError("tree holds a slot outside 1..capacity")
        if torch.isin(all_slots, self.allocator.free_slots.to(all_slots.device)).any():
            raise AssertionError("a tree slot is also in the allocator's free list")

    def pretty_print(self) -> str:
        lines = []

        def walk(node: TreeNode, depth: int) -> None:
            for child in node.children.values():
                lines.append(
                    f"{'  ' * depth}{list(child.key)} slots={child.value.tolist()} "
                    f"lock={child.lock_ref} t={child.last_access}"
                )
                walk(child, depth + 1)

        walk(self.root, 0)
        text = "\n".join(lines) + f"\n#tokens={self.total_size()} evictable={self._evictable}"
        print(text)
        return text

    # --- internals -----------------------------------------------------------------------------
    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _empty(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.int64, device=self.allocator.device)

    def _descend(self, node: TreeNode, tokens: tuple, pos: int, tick: int) -> Optional[TreeNode]:
        """The child of `node` that matches tokens[pos:], cut where the match ends (so the whole
        returned node matches) and touched at `tick`; None when no child starts with tokens[pos]."""
        child = node.children.get(tokens[pos])
        if child is None:
            return None
        n = _common_len(child.key, tokens, pos)
        if n < len(child.key):
            child = self._split(child, n)
        child.last_access = tick
        return child

    def _add_leaf(self, parent: TreeNode, key: tuple, value: torch.Tensor, tick: int) -> TreeNode:
        leaf = TreeNode(key, value, parent)
        leaf.last_access = tick
        parent.children[key[0]] = leaf
        self._leaves.discard(parent)  # no-op for root, which is never in the set
        self._leaves.add(leaf)
        self._evictable += len(key)  # new nodes start unlocked
        return leaf

    def _split(self, node: TreeNode, n: int) -> TreeNode:
        """Cut `node` after its first n tokens (0 < n < len(key)); return the new upper node.
        The upper node inherits lock_ref and last_access: every lock through `node` passes through
        it, so evictable/protected sizes and the leaf set do not change."""
        upper = TreeNode(node.key[:n], node.value[:n], node.parent)
        upper.lock_ref = node.lock_ref
        upper.last_access = node.last_access
        upper.children[node.key[n]] = node
        node.parent.children[node.key[0]] = upper
        split_logprobs(upper, node, n)
        node.key, node.value, node.parent = node.key[n:], node.value[n:], upper
        return upper
