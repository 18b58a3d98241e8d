"""Storage keys: content hashes, so a page can only ever be found by a request that would compute
exactly that KV.

A page holds the KV of `page_tokens` consecutive positions [j*P, (j+1)*P) of one token prefix. Its
key chains the hashes of every page before it, seeded with what else decides the KV bytes:

    seed = H("radixlm-kv", model fingerprint, dtype, layout)      layout: layers, KV heads, head dim,
    key_0 = H(seed, tokens[0:P])                                   page tokens, TP rank/size
    key_j = H(key_{j-1}, tokens[j*P:(j+1)*P])

so key_j names the whole prefix tokens[:(j+1)*P]. H is BLAKE2b-256; tokens are int64 little-endian.
A different model, dtype, layout or any earlier token gives a different key: a wrong hit cannot
happen (short of a hash collision), and a store survives restarts and can be shared by replicas.
"""

from __future__ import annotations

import hashlib
import os
from array import array
from typing import Iterable, Sequence

KEY_BYTES = 32


def _h(*parts: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=KEY_BYTES)
    for p in parts:
        h.update(p)
    return h.digest()


def namespace_seed(model_fingerprint: str, dtype: str, layout: Iterable[int]) -> bytes:
    text = "|".join(["radixlm-kv-v1", model_fingerprint, dtype, ",".join(map(str, layout))])
    return _h(text.encode())


def extend_chain(keys: list[bytes], seed: bytes, tokens: Sequence[int], page: int,
                 n_pages: int) -> list[bytes]:
    """Grow `keys` (the keys of the first len(keys) pages of `tokens`) to n_pages keys, in place."""
    prev = keys[-1] if keys else seed
    for j in range(len(keys), n_pages):
        prev = _h(prev, array("q", tokens[j * page:(j + 1) * page]).tobytes())
        keys.append(prev)
    return keys


def page_keys(seed: bytes, tokens: Sequence[int], page: int, n_pages: int) -> list[bytes]:
    return extend_chain([], seed, tokens, page, n_pages)


def file_fingerprint(paths: Iterable[str], sample: int = 1 << 20) -> str:
    """A cheap content fingerprint of weight files: name, size and BLAKE2b of the first and last
    `sample` bytes of each (hashing a 16 GB checkpoint in full would add seconds to every start).
    A replaced file with the same size and the same head and tail would fool it; the model's
    config, dtype and numeric settings are hashed alongside (see hicache_config)."""
    h = hashlib.blake2b(digest_size=16)
    for path in sorted(paths):
        size = os.path.getsize(path)
        h.update(f"{os.path.basename(path)}:{size}".encode())
        with open(path, "rb") as f:
            h.update(f.read(sample))
            if size > 2 * sample:
                f.seek(size - sample)
                h.update(f.read(sample))
    return h.hexdigest()
