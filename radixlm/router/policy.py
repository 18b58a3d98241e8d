"""Load-balancing policies: which live worker gets a request.

A policy sees the live workers (their in-flight counters, kept by the proxy: a request counts from
the moment it is routed until its response, streamed or not, has ended) and the request's routing
key (`keys.py`: its text or token ids; None when it has none). Names are SGLang's
(`--load-balance-method`, sgl-router's `--policy`):

  round_robin     the next worker in turn: the reference that ignores caches and load.
  random          a uniformly random worker.
  shortest_queue  the fewest requests in flight.
  minimum_tokens  the fewest prompt units (characters / ids) in flight: long prompts weigh more.
  cache_aware     sgl-router's policy (CacheAware below): the longest cached prefix unless the
                  load is imbalanced. The default for --dp-size.

Everything runs on the router's event loop, one request at a time: no locks.
"""

from __future__ import annotations

import itertools
import random
from abc import ABC, abstractmethod
from typing import Optional, Sequence

from radixlm.router.tree import ApproxTree
from radixlm.router.workers import Worker

POLICIES = ("cache_aware", "round_robin", "shortest_queue", "minimum_tokens", "random")


class Policy(ABC):
    """Contract: `select` gets a non-empty list of live workers and returns one of them; it may
    update the policy's own state (a cache-aware policy records the key as sent there).
    `remove(url)` forgets a worker's state; `stats(url)` is what /list_workers shows of it."""

    name = ""

    @abstractmethod
    def select(self, workers: Sequence[Worker], key: Optional[str]) -> Worker: ...

    def remove(self, url: str) -> None:
        pass

    def stats(self, url: str) -> dict:
        return {}


class RoundRobin(Policy):
    name = "round_robin"

    def __init__(self):
        self._turn = itertools.count()

    def select(self, workers, key):
        return workers[next(self._turn) % len(workers)]


class Random(Policy):
    name = "random"

    def __init__(self, seed: Optional[int] = None):
        self._rng = random.Random(seed)

    def select(self, workers, key):
        return self._rng.choice(list(workers))


def least_loaded(workers: Sequence[Worker]) -> Worker:
    """Fewest in flight; ties go to the one sent the fewest requests so far (spreads an idle
    start instead of piling onto the first worker)."""
    return min(workers, key=lambda w: (w.in_flight, w.routed))


class ShortestQueue(Policy):
    name = "shortest_queue"

    def select(self, workers, key):
        return least_loaded(workers)


class MinimumTokens(Policy):
    name = "minimum_tokens"

    def select(self, workers, key):
        return min(workers, key=lambda w: (w.in_flight_units, w.in_flight, w.routed))


class CacheAware(Policy):
    """sgl-router's cache-aware policy, with its parameters and defaults:

    - imbalanced = max_load - min_load > balance_abs_threshold
                   and max_load > min_load * balance_rel_threshold   (load: requests in flight)
      -> the least-loaded worker (a hot prefix must not pile everything onto one worker);
    - else the worker whose tree matches the most of the key; taken when matched / len(key) >
      cache_threshold (strictly, as sgl-router does);
    - else the worker with the smallest tree (the most room left for a new prefix), fewest in
      flight on ties.
    The key is then inserted into the chosen worker's tree, whichever rule chose it. A request
    without a key (e.g. /tokenize) goes to the least-loaded worker and is not recorded.
    """

    name = "cache_aware"

    def __init__(self, cache_threshold: float = 0.3, balance_abs_threshold: int = 64,
                 balance_rel_threshold: float = 1.5, max_tree_size: int = 1 << 24):
        if not 0.0 <= cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold must be in [0, 1] (got {cache_threshold})")
        self.cache_threshold = cache_threshold
        self.abs_threshold = balance_abs_threshold
        self.rel_threshold = balance_rel_threshold
        self.max_tree_size = max_tree_size
        self.trees: dict[str, ApproxTree] = {}
        self.decisions = {"cache_hit": 0, "smallest_tree": 0, "load_balance": 0, "no_key": 0}

    def tree(self, url: str) -> ApproxTree:
        t = self.trees.get(url)
        if t is None:
            t = self.trees[url] = ApproxTree(self.max_tree_size)
        return t

    def imbalanced(self, workers: Sequence[Worker]) -> bool:
        loads = [w.in_flight for w in workers]
        hi, lo = max(loads), min(loads)
        return hi - lo > self.abs_threshold and hi > lo * self.rel_threshold

    def select(self, workers, key):
        if not key:
            self.decisions["no_key"] += 1
            return least_loaded(workers)
        if len(workers) > 1 and self.imbalanced(workers):
            chosen, why = least_loaded(workers), "load_balance"
        else:
            matched = {w.url: self.tree(w.url).match(key) for w in workers}
            best = max(workers, key=lambda w: (matched[w.url], -w.in_flight, -w.routed))
            if matched[best.url] / len(key) > self.cache_threshold:
                chosen, why = best, "cache_hit"
            else:
                chosen = min(workers, key=lambda w: (self.tree(w.url).size, w.in_flight, w.routed))
                why = "smallest_tree"
        self.decisions[why] += 1
        self.tree(chosen.url).insert(key)
        return chosen

    def remove(self, url: str) -> None:
        self.trees.pop(url, None)

    def stats(self, url: str) -> dict:
        t = self.trees.get(url)
        return {"tree_chars": t.size if t else 0, "tree_evicted_chars": t.evicted if t else 0}


def make_policy(name: str, cache_threshold: float = 0.3, balance_abs_threshold: int = 64,
                balance_rel_threshold: float = 1.5, max_tree_size: int = 1 << 24) -> Policy:
    if name == "cache_aware":
        return CacheAware(cache_threshold, balance_abs_threshold, balance_rel_threshold,
                          max_tree_size)
    classes = {"round_robin": RoundRobin, "shortest_queue": ShortestQueue,
               "minimum_tokens": MinimumTokens, "random": Random}
    if name not in classes:
        raise ValueError(f"unknown load-balance method {name!r}; choose from {POLICIES}")
    return classes[name]()
