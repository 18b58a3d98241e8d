"""The router's approximate tree, its policies and routing keys (radixlm/router), no HTTP."""

from __future__ import annotations

import random

import pytest

from radixlm.router import keys
from radixlm.router.policy import CacheAware, MinimumTokens, RoundRobin, ShortestQueue, make_policy
from radixlm.router.tree import ApproxTree, common_prefix_len, ids_key
from radixlm.router.workers import Worker


# --- tree -----------------------------------------------------------------------------------------

def test_common_prefix_len_matches_a_plain_loop():
    rng = random.Random(0)
    for _ in range(500):
        a = "".join(rng.choice("ab") for _ in range(rng.randrange(0, 40)))
        b = "".join(rng.choice("ab") for _ in range(rng.randrange(0, 40)))
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        assert common_prefix_len(a, b) == n


def test_match_is_the_longest_inserted_prefix():
    t = ApproxTree()
    t.insert("You are a helpful assistant. Q: capital of France?")
    t.insert("You are a helpful assistant. Q: capital of Spain?")
    t.insert("Translate: hello")
    assert t.match("You are a helpful assistant. Q: capital of Italy?") == len(
        "You are a helpful assistant. Q: capital of ")
    assert t.match("You are a helpful assistant. Q: capital of Spain?!") == len(
        "You are a helpful assistant. Q: capital of Spain?")
    assert t.match("Translate: hello world") == len("Translate: hello")
    assert t.match("Zebra") == 0 and t.match("") == 0
    # the size counts characters on edges: shared prefixes once
    common = len("You are a helpful assistant. Q: capital of ")
    assert t.size == common + len("France?") + len("Spain?") + len("Translate: hello")


def test_random_inserts_agree_with_a_brute_force_prefix_set():
    rng = random.Random(1)
    t, inserted = ApproxTree(), []
    for _ in range(300):
        k = "".join(rng.choice("abc") for _ in range(rng.randrange(1, 12)))
        t.insert(k)
        inserted.append(k)
    for _ in range(300):
        q = "".join(rng.choice("abc") for _ in range(rng.randrange(0, 14)))
        assert t.match(q) == max(common_prefix_len(q, k) for k in inserted)


def test_eviction_bounds_the_size_and_drops_least_recently_used_first():
    t = ApproxTree(max_size=100)
    for i in range(50):
        t.insert(f"prefix-{i:03d}-" + "x" * 20)  # 31 characters, 27 after the shared "prefix-"
        assert t.size <= 100
    assert t.evicted > 0
    # the newest keys survive, the oldest are gone
    assert t.match("prefix-049-" + "x" * 20) == 31
    assert t.match("prefix-000-" + "x" * 20) < 31
    # touching an old key makes it recent: it outlives a newer one
    t2 = ApproxTree(max_size=70)
    t2.insert("a" * 30)
    t2.insert("b" * 30)
    t2.insert("a" * 30)  # a is now the most recent
    t2.insert("c" * 30)  # over 70: evicts b, not a
    assert t2.match("a" * 30) == 30 and t2.match("b" * 30) == 0 and t2.match("c" * 30) == 30


def test_eviction_keeps_edges_compressed():
    t = ApproxTree(max_size=1000)
    t.insert("shared-" + "a" * 10)
    t.insert("shared-" + "b" * 10)
    t.evict(t.size - 10)  # drops the older leaf ("a..."): its parent merges with "b..."
    assert t.num_nodes() == 1
    assert t.match("shared-" + "b" * 10) == 17 and t.size == 17


def test_ids_key_never_matches_text():
    t = ApproxTree()
    t.insert(ids_key([72, 105, 33]))  # chr(72) chr(105) chr(33) == "Hi!"
    assert t.match("Hi!") == 0
    assert t.match(ids_key([72, 105, 7])) == len(ids_key([72, 105]))


# --- policies -------------------------------------------------------------------------------------

def _workers(n: int) -> list[Worker]:
    return [Worker(f"http://w{i}") for i in range(n)]


def test_round_robin_cycles_and_skips_nothing():
    ws, p = _workers(3), RoundRobin()
    assert [p.select(ws, None).url for _ in range(6)] == [w.url for w in ws] * 2


def test_shortest_queue_and_minimum_tokens():
    ws = _workers(3)
    ws[0].in_flight, ws[1].in_flight, ws[2].in_flight = 3, 1, 2
    assert ShortestQueue().select(ws, "x") is ws[1]
    ws[1].in_flight_units, ws[2].in_flight_units, ws[0].in_flight_units = 5000, 10, 10
    # minimum_tokens: ws[2] and ws[0] tie on units; fewer requests in flight wins
    assert MinimumTokens().select(ws, "x") is ws[2]


def test_cache_aware_sends_a_shared_prefix_to_the_same_worker():
    ws, p = _workers(2), CacheAware(cache_threshold=0.5)
    system_a = "You are a pirate. " * 20
    system_b = "You are a poet. " * 20
    first_a = p.select(ws, system_a + "Q1")
    first_b = p.select(ws, system_b + "Q1")
    assert first_a is not first_b  # no match: the smaller tree (the empty one) gets system_b
    for q in range(2, 20):
        assert p.select(ws, system_a + f"Q{q}") is first_a
        assert p.select(ws, system_b + f"Q{q}") is first_b
    assert p.decisions["cache_hit"] == 36 and p.decisions["smallest_tree"] == 2


def test_cache_aware_threshold_is_strict_and_falls_back_to_the_smallest_tree():
    ws, p = _workers(2), CacheAware(cache_threshold=0.5)
    p.select(ws, "abcd" + "x" * 100)  # w0's tree: 104 characters
    p.select(ws, "zz")  # w1 (smallest tree)
    # "abcd" + 4 new characters matches exactly half of w0: not > 0.5 -> the smallest tree (w1)
    assert p.select(ws, "abcd" + "yyyy") is ws[1]
    assert p.decisions["cache_hit"] == 0
    # a longer match wins
    assert p.select(ws, "abcd" + "x" * 50) is ws[0]


def test_cache_aware_defaults_keep_affinity_through_ordinary_load_swings():
    """The defaults (SGLang gateway's 0.3 / 64 / 1.5). With the old 32 / 1.0001, two H100
    replicas at 128 requests in flight (about 64 each) crossed a 33-request gap often enough that
    48 of 512 requests were load-balanced away from their tenant's replica; each one copied the
    tenant to the other tree, and the hit rate fell from 0.88 to 0.77 (dp_router, 2 x H100)."""
    ws, p = _workers(2), CacheAware()
    assert (p.cache_threshold, p.abs_threshold, p.rel_threshold) == (0.3, 64, 1.5)
    tenant = "tenant system prompt " * 40
    owner = p.select(ws, tenant + "q0")
    other = ws[1] if owner is ws[0] else ws[0]
    owner.in_flight, other.in_flight = 81, 47  # gap 34: an ordinary swing, not an imbalance
    assert p.select(ws, tenant + "q1") is owner
    owner.in_flight, other.in_flight = 100, 30  # gap 70 > 64 and 100 > 45: imbalanced
    assert p.select(ws, tenant + "q2") is other
    assert p.decisions == {"cache_hit": 1, "smallest_tree": 1, "load_balance": 1, "no_key": 0}


def test_cache_aware_load_gap_overrides_the_cache():
    ws, p = _workers(2), CacheAware(cache_threshold=0.5, balance_abs_threshold=4,
                                    balance_rel_threshold=1.5)
    key = "shared system prompt " * 10
    mine = key + "only the owner saw this " * 4
    owner = p.select(ws, mine)
    other = ws[1] if owner is ws[0] else ws[0]
    owner.in_flight, other.in_flight = 5, 0  # gap 5 > 4 and 5 > 0 * 1.5: imbalanced
    assert p.select(ws, key + "1") is other
    assert p.decisions["load_balance"] == 1
    # the load-balanced request was recorded in the other worker's tree
    assert p.tree(other.url).match(key + "1") == len(key) + 1
    owner.in_flight, other.in_flight = 6, 4  # gap 2: balanced again -> the longest match wins
    assert p.select(ws, mine + "2") is owner
    owner.in_flight, other.in_flight = 12, 8  # gap 4, not > 4 -> balanced
    assert p.select(ws, mine + "3") is owner
    owner.in_flight, other.in_flight = 20, 14  # gap 6 > 4 but 20 <= 14 * 1.5 -> balanced
    assert p.select(ws, mine + "4") is owner
    owner.in_flight, other.in_flight = 22, 14  # 22 > 21: imbalanced
    assert p.select(ws, mine + "5") is other
    # equal matches (both trees hold `key`): the less loaded worker
    owner.in_flight, other.in_flight = 3, 2
    assert p.select(ws, key + "9") is other


def test_cache_aware_removed_worker_is_forgotten():
    ws, p = _workers(2), CacheAware()
    key = "a long shared prefix " * 10
    owner = p.select(ws, key + "x")
    p.remove(owner.url)
    rest = [w for w in ws if w is not owner]
    assert p.select(rest, key + "y") is rest[0]
    assert owner.url not in p.trees
    assert p.stats(owner.url) == {"tree_chars": 0, "tree_evicted_chars": 0}


def test_cache_aware_tree_size_is_bounded():
    ws, p = _workers(2), CacheAware(max_tree_size=1000)
    rng = random.Random(2)
    for _ in range(300):
        p.select(ws, "".join(rng.choice("abcdefgh") for _ in range(80)))
    assert all(p.tree(w.url).size <= 1000 for w in ws)


def test_cache_aware_without_key_goes_to_the_least_loaded():
    ws, p = _workers(2), CacheAware()
    ws[0].in_flight = 3
    assert p.select(ws, None) is ws[1]
    assert p.trees == {} or all(t.size == 0 for t in p.trees.values())


def test_make_policy_names():
    for name in ("cache_aware", "round_robin", "shortest_queue", "minimum_tokens", "random"):
        assert make_policy(name).name == name
    with pytest.raises(ValueError):
        make_policy("least_busy")


# --- routing keys ---------------------------------------------------------------------------------

def test_routing_keys_preserve_prefixes():
    k = keys.routing_key
    assert k("/generate", {"text": "hello"}) == "hello"
    assert k("/generate", {"text": ["a", "b"]}) == "a"
    assert k("/generate", {"input_ids": [1, 2, 3]}) == ids_key([1, 2, 3])
    assert k("/generate", {"input_ids": [[1, 2], [3]]}) == ids_key([1, 2])
    assert k("/v1/completions", {"prompt": [5, 6]}) == ids_key([5, 6])
    turn1 = [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}]
    turn2 = turn1 + [{"role": "assistant", "content": "hello"}, {"role": "user", "content": "x"}]
    a = k("/v1/chat/completions", {"messages": turn1})
    b = k("/v1/chat/completions", {"messages": turn2})
    assert b.startswith(a) and len(b) > len(a)
    parts = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    assert k("/v1/chat/completions", {"messages": parts}).endswith("hi")
    m1 = k("/v1/messages", {"system": "S", "messages": turn1[1:]})
    m2 = k("/v1/messages", {"system": "S", "messages": turn2[1:]})
    assert m2.startswith(m1)
    assert k("/v1/embeddings", {"input": "e"}) == "e"
    assert k("/tokenize", {"text": "t"}) is None and k("/generate", [1]) is None
