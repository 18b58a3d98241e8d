"""Which pages of a file store's folder are on disk, least recently used first, and the cap that
bounds them (file_backend.FileStorage; `file_storage_max_gb` in the extra config).

Without a cap a store grows until its disk is full (two 8-minute soaks of the bundled model left
12 GB in /tmp), and a full disk turns its writes off for good. With one, each page written or
read moves to the recent end, and a write past the cap removes the least recently used pages'
files. The budget counts the pages this process wrote, read or found on disk at start (a scan,
oldest modification first): replicas sharing a folder each hold their own view, so together they
can exceed it by what the others wrote since they started.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from typing import Optional


class PageBudget:
    def __init__(self, max_pages: Optional[int]):
        if max_pages is not None and max_pages < 1:
            raise ValueError(f"a page budget must allow at least one page (got {max_pages})")
        self.max_pages = max_pages
        self._order: OrderedDict[bytes, None] = OrderedDict()  # oldest first
        self._lock = threading.Lock()  # (the scheduler's, reader and writer threads)

    def __contains__(self, key: bytes) -> bool:
        return key in self._order

    def __len__(self) -> int:
        return len(self._order)

    def touch(self, key: bytes) -> list[bytes]:
        """`key` is on disk and was just used: the keys now past the cap, oldest first (removed
        from the budget; the caller deletes their files)."""
        with self._lock:
            self._order[key] = None
            self._order.move_to_end(key)
            if self.max_pages is None:
                return []
            over = len(self._order) - self.max_pages
            return [self._order.popitem(last=False)[0] for _ in range(max(over, 0))]

    def discard(self, key: bytes) -> None:
        with self._lock:
            self._order.pop(key, None)

    def clear(self) -> None:
        with self._lock:
            self._order.clear()

    def scan(self, folder: str) -> list[bytes]:
        """Enter the page files under `folder` (<kk>/<key hex>.kv), oldest modified first; the
        keys past the cap are returned as by `touch`."""
        found = []
        for e, key in page_files(folder):
            try:
                found.append((e.stat(follow_symlinks=False).st_mtime, key))
            except OSError:
                continue
        over = []
        for _, key in sorted(found):
            over += self.touch(key)
        return over


def page_files(folder: str):
    """(directory entry, key) of each page file under `folder` (<kk>/<key hex>.kv), lazily."""
    for sub in _entries(folder):
        if not sub.is_dir(follow_symlinks=False):
            continue
        for e in _entries(sub.path):
            name = e.name
            if not name.endswith(".kv") or len(name) != 67:  # 64 hex digits + ".kv"
                continue
            try:
                yield e, bytes.fromhex(name[:64])
            except ValueError:
                continue


def _entries(path: str) -> list:
    try:
        with os.scandir(path) as it:
            return list(it)
    except OSError:
        return []
