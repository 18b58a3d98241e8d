"""The L3 storage contract: pages of KV by content key (storage/keys.py).

A page is the KV of `page_tokens` consecutive positions, all layers, as raw bytes in one layout:
(layers, 2 [K, V], page_tokens, KV heads, head dim) in the pool's dtype, C order. A store keeps
pages by key; it never interprets them.

Contract for an implementation (a file store here; Mooncake, 3FS or a Redis-like KV plug in the
same way, by implementing these methods and registering a name in `storage/__init__.py`):
- `exists(key)` may be optimistic: a page reported present can still fail to read (deleted,
  evicted by another process, corrupt). Callers must treat `get` as the truth.
- `get(key)` returns the page's payload, verified (length and checksum, stored key == key), or
  None when the page is missing, truncated, corrupt or foreign. It never raises for a bad page and
  never returns one: the caller then recomputes those tokens.
- `get_into(key, out)` is `get` into the caller's buffer (`out`: a writable, contiguous CPU
  buffer of exactly `page_bytes`, e.g. a uint8 view of host-pool rows): True when a verified page
  is there. On False `out` may hold any bytes (a store may read into it before it checks); the
  caller must not use them. The default is `get` and a copy; a store that can read straight into
  `out` (the file store) saves a pass over the page and the page-sized allocation.
- `put(key, payload)` stores a page (payload: bytes-like, `page_bytes` long; called from the
  cache's page-writer thread, while the scheduler's thread may call `exists` / `get`), possibly
  asynchronously (a later `get` of a queued page must
  return it). Returns False when the page was not accepted (writes off, queue full); the caller
  then does not count the page as stored.
- The batch forms act on a list of keys that chain (page j+1 extends page j): `batch_exists`
  returns how many leading keys exist, `batch_get` stops at the first missing page.
- `clear()` removes every page of this store's namespace; `close()` finishes queued writes.
- `load_meta(name)` / `save_meta(name, doc)` (optional; the defaults keep nothing): a small JSON
  document kept beside the pages, e.g. the rates the cache measured (tier_transfers.py), so that
  a restart on the store starts with them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Optional

import torch


class StorageBackend(ABC):
    page_bytes: int  # every payload's size

    @abstractmethod
    def exists(self, key: bytes) -> bool: ...

    @abstractmethod
    def get(self, key: bytes) -> Optional[bytes]: ...

    def get_into(self, key: bytes, out) -> bool:
        dest = byte_view(out, self.page_bytes)
        payload = self.get(key)
        if payload is None:
            return False
        dest[:] = memoryview(payload).cast("B")
        return True

    @abstractmethod
    def put(self, key: bytes, payload: bytes) -> bool: ...

    def batch_exists(self, keys: list[bytes]) -> int:
        for i, key in enumerate(keys):
            if not self.exists(key):
                return i
        return len(keys)

    def batch_get(self, keys: list[bytes]) -> list[bytes]:
        """The payloads of the leading keys that read back valid (stops at the first that does
        not)."""
        out = []
        for key in keys:
            payload = self.get(key)
            if payload is None:
                break
            out.append(payload)
        return out

    def batch_put(self, keys: list[bytes], payloads: list[bytes]) -> int:
        """Store pages in order; returns how many leading pages were accepted."""
        for i, (key, payload) in enumerate(zip(keys, payloads)):
            if not self.put(key, payload):
                return i
        return len(keys)

    @abstractmethod
    def clear(self) -> None: ...

    def flush(self) -> None:
        """Wait until every accepted page is stored (tests; shutdown)."""

    def close(self) -> None:
        self.flush()

    def stats(self) -> dict:
        return {}

    def sample_keys(self, n: int) -> list[bytes]:
        """Keys of up to n pages the store holds, any n (a first measure of its read rate:
        tier_prefetch.probe_read_rate); [] when it cannot say cheaply."""
        return []

    def load_meta(self, name: str) -> Optional[dict]:
        return None

    def save_meta(self, name: str, doc: dict) -> None:
        pass


def byte_view(out, nbytes: int) -> memoryview:
    """`out` (a CPU torch tensor, or any object with the buffer protocol) as a writable flat byte
    view of exactly nbytes; ValueError for anything else (a wrong size is a caller's bug: a page
    of another layout would land in rows it does not fit)."""
    if isinstance(out, torch.Tensor):
        if out.device.type != "cpu" or not out.is_contiguous():
            raise ValueError(f"get_into: out must be a contiguous CPU tensor (got {out.device}, "
                             f"contiguous={out.is_contiguous()})")
        out = out.detach().view(torch.uint8).numpy()  # the same memory (pinned too), a buffer
    view = memoryview(out)
    if view.readonly or not view.c_contiguous:
        raise ValueError("get_into: out must be a writable, contiguous buffer")
    view = view.cast("B")
    if view.nbytes != nbytes:
        raise ValueError(f"get_into: out is {view.nbytes} bytes, a page is {nbytes}")
    return view
