"""An approximate radix tree of the prefixes the router sent to one worker.

Why approximate: the router never asks a worker what its RadixCache holds (a round trip per
request, and a tie to one server's internals); it remembers what it *sent* there. A worker evicts
on its own schedule, so a match here is a guess that the KV is still cached. That guess is all
cache-aware routing needs: requests sharing a prefix keep going to the worker that saw it first.

Keys are `str`. Text requests use their characters, as sgl-router does (no tokenizer in the
router: tokenizing every request again would cost more than the routing saves). Token-id requests
use `ids_key(ids)`: one character per id, behind a marker so ids never match text. Edges hold
substrings, so matching a 2000-character system prompt is a few string compares done in C, not a
Python loop per character.

Size bound: `size` is the number of characters on all edges. When an insert takes it over
`max_size`, least-recently-used leaves are evicted until it is back at `LOW_WATER * max_size`
(a batch at a time, so eviction's cost is amortized over many inserts). Inserting touches every
node on the key's path, so a parent is never older than its children and leaves go first, the
way the workers' own RadixCaches evict.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Iterable, Optional

LOW_WATER = 0.9
_IDS_MARK = "\x00ids\x00"


def ids_key(ids: Iterable[int]) -> str:
    """A token-id prompt as a key: chr(id) per id (ids beyond Unicode's range wrap, anything but
    an int maps to U+FFFD: the tree is approximate anyway, and the worker rejects bad ids)."""
    try:
        return _IDS_MARK + "".join(map(chr, ids))  # C speed: every id of a real vocabulary fits
    except (TypeError, ValueError, OverflowError):
        return _IDS_MARK + "".join(chr(i % 0x110000) if isinstance(i, int) else "\ufffd"
                                   for i in ids)


def common_prefix_len(a: str, b: str) -> int:
    """Length of the longest common prefix of a and b, by slice compares (C speed)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # invariant: a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class _Node:
    __slots__ = ("label", "children", "parent", "last")

    def __init__(self, label: str, parent: Optional["_Node"], last: int):
        self.label = label
        self.children: dict[str, _Node] = {}  # first character of the child's label -> child
        self.parent = parent
        self.last = last  # access stamp (a counter, not a clock: deterministic in tests)


class ApproxTree:
    """The prefixes sent to one worker. `match(key)` -> characters matched; `insert(key)`."""

    def __init__(self, max_size: int = 1 << 24):
        if max_size < 1:
            raise ValueError("max_size must be >= 1")
        self.max_size = max_size
        self._clock = itertools.count(1)
        self.root = _Node("", None, 0)
        self.size = 0  # characters on all edges
        self.evicted = 0  # characters evicted so far (reported in /list_workers)

    def match(self, key: str) -> int:
        """How many leading characters of `key` the tree holds. Touches nothing."""
        node, pos = self.root, 0
        while pos < len(key):
            child = node.children.get(key[pos])
            if child is None:
                break
            k = common_prefix_len(child.label, key[pos:pos + len(child.label)])
            pos += k
            if k < len(child.label):
                break
            node = child
        return pos

    def insert(self, key: str) -> None:
        """Add `key` (its path becomes the most recently used), then evict if over the bound."""
        stamp = next(self._clock)
        node, pos = self.root, 0
        node.last = stamp
        while pos < len(key):
            child = node.children.get(key[pos])
            if child is None:
                node.children[key[pos]] = _Node(key[pos:], node, stamp)
                self.size += len(key) - pos
                break
            k = common_prefix_len(child.label, key[pos:pos + len(child.label)])
            if k < len(child.label):  # split: node -> mid (label[:k]) -> child (label[k:])
                mid = _Node(child.label[:k], node, stamp)
                child.label = child.label[k:]
                child.parent = mid
                mid.children[child.label[0]] = child
                node.children[key[pos]] = mid
                child = mid
            child.last = stamp
            node, pos = child, pos + k
        if self.size > self.max_size:
            self.evict(int(self.max_size * LOW_WATER))

    def evict(self, target: int) -> None:
        """Remove least-recently-used leaves until `size <= target`."""
        tie = itertools.count()
        heap = [(n.last, next(tie), n) for n in self._leaves()]
        heapq.heapify(heap)
        while self.size > target and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            del parent.children[leaf.label[0]]
            self.size -= len(leaf.label)
            self.evicted += len(leaf.label)
            if parent is self.root:
                continue
            if not parent.children:
                heapq.heappush(heap, (parent.last, next(tie), parent))
            elif len(parent.children) == 1:  # keep edges compressed: merge parent into its child
                (only,) = parent.children.values()
                only.label = parent.label + only.label
                only.parent = parent.parent
                parent.parent.children[only.label[0]] = only

    def _leaves(self) -> list[_Node]:
        out, stack = [], list(self.root.children.values())
        while stack:
            n = stack.pop()
            if n.children:
                stack.extend(n.children.values())
            else:
                out.append(n)
        return out

    def num_nodes(self) -> int:
        count, stack = 0, list(self.root.children.values())
        while stack:
            n = stack.pop()
            count += 1
            stack.extend(n.children.values())
        return count
