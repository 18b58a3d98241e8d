"""The router's sharded HTTP clients: a shard carries at most per_shard requests until
max_shards exist; a released slot is reused before a new shard is made."""

import asyncio

import httpx
import pytest

from radixlm.router.client_shards import ClientShards
from radixlm.router.tree import ids_key


def test_shards_grow_only_when_full_and_reuse_released_slots():
    made = []

    def make():
        made.append(httpx.AsyncClient())
        return made[-1]

    shards = ClientShards(make, per_shard=2, max_shards=3)
    got = [shards.acquire() for _ in range(4)]
    assert shards.num_shards == 2 and got[0] is got[1] and got[2] is got[3]
    shards.release(got[0])
    assert shards.acquire() is got[0]  # the freed slot, not a third shard
    assert shards.num_shards == 2
    more = [shards.acquire() for _ in range(4)]
    assert shards.num_shards == 3  # capped: past it the least-loaded shard takes more
    assert shards.in_flight() == 8
    for c in got[1:] + [got[0]] + more:
        shards.release(c)
    assert shards.in_flight() == 0
    asyncio.run(shards.aclose())
    assert shards.num_shards == 0


def test_shards_reject_bad_sizes():
    with pytest.raises(ValueError, match="per_shard"):
        ClientShards(httpx.AsyncClient, per_shard=0)


def test_ids_key_fast_and_fallback_paths_agree_on_real_ids():
    ids = [0, 1, 128000, 151935]
    assert ids_key(ids) == ids_key(iter(ids))
    # out of Unicode's range wraps; a non-int becomes U+FFFD instead of failing the request
    assert ids_key([0x110000 + 5, 7]).endswith(chr(5) + chr(7))
    assert ids_key([1, "x"]).endswith(chr(1) + "\ufffd")
