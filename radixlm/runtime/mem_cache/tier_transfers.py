"""HiRadixCache's moves up the tiers: loads (host -> device) for a scheduled request, and the
counters and rates of every tier. (Backups, device -> host, and page writes, host -> storage, are
in tier_writes.py; reads from storage into the host pool, the prefetch, in tier_prefetch.py.) A
mixin: the state is HiRadixCache's.

Load of a match (`load_back`), for the request the scheduler is admitting, whose device prefix it
has locked: device slots for every host-resident node of the path (evicting others to make room),
one batched copy (KVMover: synchronous on the CPU; on CUDA queued on the mover's streams, with an
event that the compute stream waits for, or that the scheduler polls for a preload). The path's nodes are pinned (host_ref) throughout,
so the evictions a load causes cannot take the copies it is moving. Storage is never read here:
what the prefetch landed for the request was put into the tree as host nodes just before.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from radixlm.runtime.mem_cache.head_split import HEAD_RATE_WEIGHT
from radixlm.runtime.mem_cache.storage.keys import extend_chain

EMA = 0.2  # weight of the newest sample in the rate estimates
MIN_PREFILL_SAMPLE = 32  # extends shorter than this measure overhead more than compute
KEY_MEMO_ENTRIES = 256
# the measured rates kept in the store at shutdown (storage.save_meta) and read back at start
RATES_META = "rates"
RATE_NAMES = ("prefill_tps", "read_bps", "head_tps")


class TierTransfers:
    def _init_transfers(self) -> None:
        self.counters = {
            "hit_tokens_device": 0, "hit_tokens_host": 0, "hit_tokens_storage": 0,
            "bytes_device_to_host": 0, "bytes_host_to_device": 0,
            "bytes_host_to_storage": 0, "bytes_storage_to_host": 0,
            "pages_stored": 0, "pages_write_dropped": 0, "pages_loaded": 0,
            "storage_load_failures": 0, "storage_loads_skipped": 0,
            "preloads": 0,  # loads whose copy ran beside the forwards (CUDA; prefill.py)
            "prefetch_started": 0, "prefetch_dropped": 0,
            # compute the head, read the tail (head_split.py): requests split, tokens computed
            "head_splits": 0, "head_split_tokens": 0,
            "device_evicted_tokens": 0, "host_evicted_tokens": 0, "dropped_tokens": 0,
            # seconds the scheduler's thread spent on page writes (queueing, or writing them
            # itself with write_queue_pages 0) and on applying their completions
            "storage_write_scheduler_s": 0.0}
        self._prefill_tps: Optional[float] = None  # tokens/s the forward computes (EMA)
        self._read_bps: Optional[float] = None  # bytes/s the store reads (EMA)
        # tokens/s of split heads computed (head_split.py), and of extends that are as one (a
        # single prompt from its first token: scheduler/split_heads.py `_head_like`)
        self._head_tps: Optional[float] = None
        # the rates an earlier run on this store measured: the head split (tier_prefetch.py) uses
        # them until this run has measured its own, so that the first requests after a restart
        # (the ones a restart on a warm store is for) can split too. Only priors: one mis-sized
        # head at worst if the store moved to other hardware. (Read-or-recompute, below, waits
        # for this run's own rates, as before: unknown, it reads.)
        self._rate_priors = self._load_rate_priors()
        self._key_memo: dict = {}  # tokens tuple -> its page keys so far (match re-runs each step)

    # --- statistics ------------------------------------------------------------------------------
    def record_hits(self, details: dict) -> None:
        for tier, n in details.items():
            self.counters["hit_tokens_" + tier] += n

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        if tokens >= MIN_PREFILL_SAMPLE and seconds > 0:
            self._prefill_tps = _ema(self._prefill_tps, tokens / seconds)

    def observe_head(self, tokens: int, seconds: float) -> None:
        """A split head's compute (tokens from its request's cached prefix to head_end), or an
        extend's that is as one."""
        if tokens > 0 and seconds > 0:
            self._head_tps = _ema(self._head_tps, tokens / seconds, HEAD_RATE_WEIGHT)

    def _storage_pays(self) -> bool:
        """Whether reading a token's KV from the store beats computing it (unknown rates: try)."""
        if self._prefill_tps is None or self._read_bps is None:
            return True
        return self.host.token_bytes / self._read_bps < 1.0 / self._prefill_tps

    def _rate(self, name: str) -> Optional[float]:
        """A rate of RATE_NAMES: this run's measure, else the store's prior (None: neither)."""
        live = getattr(self, "_" + name, None)
        return live if live is not None else self._rate_priors.get(name)

    def _load_rate_priors(self) -> dict:
        doc = self.storage.load_meta(RATES_META) if self.storage is not None else None
        return {k: float(v) for k, v in (doc or {}).items()
                if k in RATE_NAMES and isinstance(v, (int, float)) and not isinstance(v, bool)
                and math.isfinite(v) and v > 0}

    def save_rates(self) -> None:
        """Keep the rates in the store for the next run on it (shutdown)."""
        if self.storage is None:
            return
        doc = {k: self._rate(k) for k in RATE_NAMES if self._rate(k) is not None}
        if doc:
            self.storage.save_meta(RATES_META, doc)

    def tier_stats(self) -> dict:
        """Each tier's use and the counters (finished page writes and prefetch reports applied
        first: scheduler thread)."""
        self.apply_write_completions()
        self.apply_prefetch_news(release=False)
        host = self.host
        out = {"write_policy": self.write_policy,
               "device": {"capacity": self.allocator.capacity,
                          "free": self.allocator.available_size(), "cached": self.total_size()},
               "host": {"capacity": host.capacity, "free": host.allocator.available_size(),
                        "cached": self._host_tokens, "bytes_per_token": host.token_bytes},
               "storage": {"index_tokens": self._store_tokens, "page_tokens": self.page},
               "prefill_tokens_per_s": self._prefill_tps, "storage_read_bytes_per_s": self._read_bps,
               "head_tokens_per_s": self._head_tps, "rate_priors": dict(self._rate_priors)}
        if self.storage is not None:
            out["storage"].update(self.storage.stats())
            out["storage"]["write_queue"] = self.write_queue_stats()
            out["storage"]["prefetch"] = self.prefetch_stats()
        out.update(self.counters)
        return out

    # --- storage lookups -------------------------------------------------------------------------
    def _keys(self, tokens: tuple, n_pages: int) -> list[bytes]:
        keys = self._key_memo.get(tokens)
        if keys is None:
            if len(self._key_memo) >= KEY_MEMO_ENTRIES:
                del self._key_memo[next(iter(self._key_memo))]
            keys = self._key_memo[tokens] = []
        return extend_chain(keys, self.seed, tokens, self.page, n_pages)

    # --- loads -----------------------------------------------------------------------------------
    def load_back(self, match, stored: Optional[tuple[int, int]] = None
                  ) -> tuple[torch.Tensor, object, dict]:
        """Bring the match's host part into device slots. The caller holds the lock on match[1]
        (the device node). `stored`: the absolute token range the prefetch just gave the tree
        (reported as storage hits). Returns (device slots of the whole loaded prefix, its deepest
        node, {"device": n, "host": n, "storage": n} tokens from each tier)."""
        return self._load(match, stored, detached=False)[:3]

    def preload_back(self, match, stored: Optional[tuple[int, int]] = None):
        """load_back whose copy runs beside the forwards queued after it (CUDA): also returns
        the copy's event (None where it is done already: the CPU), which must have completed
        before a forward reads the slots; the caller keeps the returned node locked until
        then. The nodes are device nodes at once (a match finds them), so only a request that
        waits for the event may use them: the one that made the load."""
        return self._load(match, stored, detached=True)

    def _load(self, match, stored, detached: bool):
        slots, node = match[0], match[1]
        d = slots.numel()
        details = {"device": d, "host": 0, "storage": 0}
        nodes = [n for n in match.lower if n.host_value is not None]
        if not nodes:
            return slots, node, details, None
        for n in nodes:
            n.host_ref += 1
        try:
            n_tok = sum(len(n.key) for n in nodes)
            dev = self._alloc_device(n_tok)
            event = self.mover.to_device(torch.cat([n.host_value for n in nodes]), dev)
            if event is not None and not detached:  # the next forward is ordered after it
                torch.cuda.current_stream(self.mover.device).wait_event(event)
                event = None
            off = 0
            for n in nodes:  # root-down: each node's parent is on the device before it
                n.value = dev[off:off + len(n.key)]
                n.loading = event
                off += len(n.key)
                self._evictable += len(n.key)
                self._sync(n)
                self._sync(n.parent)
        finally:
            for n in nodes:
                n.host_ref -= 1
        self.counters["bytes_host_to_device"] += n_tok * self.host.token_bytes
        self.counters["preloads"] += event is not None
        if stored is not None:
            details["storage"] = max(0, min(stored[1], d + n_tok) - max(stored[0], d))
        details["host"] = n_tok - details["storage"]
        return torch.cat((slots, dev)), nodes[-1], details, event

    def loading(self, node) -> bool:
        """Whether a preload still writes the device KV of node's path (root to node): a request
        matching it waits (prefill.py) rather than read slots still being written. Completed
        loads are forgotten on the way."""
        pending = False
        while node is not None and node is not self.root:
            ev = getattr(node, "loading", None)
            if ev is not None:
                if ev.query():
                    node.loading = None
                else:
                    pending = True
            node = node.parent
        return pending

    def finish_loading(self, node) -> None:
        """Wait until the preloads writing node's path have finished (before its lock goes
        without a forward having waited for them: an abort), so that no copy can land in slots
        that eviction has given to another request by then."""
        while node is not None and node is not self.root:
            if getattr(node, "loading", None) is not None:
                node.loading.synchronize()
                node.loading = None
            node = node.parent

    def _alloc_device(self, n: int) -> torch.Tensor:
        if not self.allocator.can_alloc(n):
            self.evict(n - self.allocator.available_size())
        slots = self.allocator.alloc(n)
        if slots is None:  # admission budgets a load like a compute of the same tokens
            raise RuntimeError(f"KV pool exhausted loading {n} cached tokens: "
                               f"{self.allocator.available_size()} free after eviction")
        return slots

    def _alloc_host(self, n: int) -> Optional[torch.Tensor]:
        alloc = self.host.allocator
        if not alloc.can_alloc(n):
            self.evict_host(n - alloc.available_size())
        return alloc.alloc(n)


def _ema(old: Optional[float], new: float, weight: float = EMA) -> float:
    return new if old is None else (1 - weight) * old + weight * new

