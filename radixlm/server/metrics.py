"""Prometheus metrics (`--enable-metrics`, served at GET /metrics), named like SGLang's.

Latencies are observed in the TokenizerManager as updates arrive; gauges that live in the
scheduler (running/queued requests, token usage, cache hit rate) are fetched when scraped.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class ServerMetrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        p = "radixlm:"
        self.requests = Counter(p + "num_requests", "Requests received", registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens received", registry=r)
        self.generation_tokens = Counter(p + "generation_tokens", "Tokens generated", registry=r)
        self.ttft = Histogram(p + "time_to_first_token_seconds", "Time to first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram(p + "inter_token_latency_seconds", "Time between output updates",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram(p + "e2e_request_latency_seconds", "End-to-end request latency",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.num_running = Gauge(p + "num_running_reqs", "Requests decoding", registry=r)
        self.num_queued = Gauge(p + "num_queue_reqs", "Requests waiting", registry=r)
        self.token_usage = Gauge(p + "token_usage", "Fraction of KV slots in use or cached", registry=r)
        self.cache_hit_rate = Gauge(p + "cache_hit_rate", "Cached prompt tokens / prompt tokens",
                                    registry=r)
        # --enable-hierarchical-cache only (labelled gauges have no samples until set)
        self.tier_tokens = Gauge(p + "hicache_cached_tokens", "Tokens whose KV a tier holds "
                                 "(storage: the tree's index of stored tokens)", ["tier"],
                                 registry=r)
        self.tier_capacity = Gauge(p + "hicache_capacity_tokens", "Tokens a tier's pool holds",
                                   ["tier"], registry=r)
        self.tier_hits = Gauge(p + "hicache_hit_tokens", "Prompt tokens served from a tier",
                               ["tier"], registry=r)
        self.tier_bytes = Gauge(p + "hicache_bytes_moved", "KV bytes copied between tiers",
                                ["direction"], registry=r)
        # speculative decoding (0 when off): per request and verify, tokens appended / verifies
        self.spec_accept_length = Gauge(p + "spec_accept_length",
                                        "Mean tokens a request appended per verify it drafted in",
                                        registry=r)
        self.spec_verify_steps = Gauge(p + "spec_verify_steps", "Verify forwards run",
                                       registry=r)

    def on_request(self, prompt_tokens: int) -> None:
        self.requests.inc()
        self.prompt_tokens.inc(prompt_tokens)

    def on_tokens(self, state, n: int, now: float) -> None:
        self.generation_tokens.inc(n)
        if state.last_token_time is None:
            self.ttft.observe(now - state.created)
        else:
            # one update may carry several tokens: spread the gap over them
            gap = (now - state.last_token_time) / n
            for _ in range(n):
                self.itl.observe(gap)

    def on_finish(self, state, now: float) -> None:
        self.e2e.observe(now - state.created)

    def render(self, stats: dict) -> bytes:
        self.num_running.set(stats.get("num_running", 0))
        self.num_queued.set(stats.get("num_waiting", 0))
        cap = stats.get("kv_capacity") or 1
        self.token_usage.set(1 - stats.get("kv_free", cap) / cap)
        prompt = stats.get("prompt_tokens") or 0
        self.cache_hit_rate.set(stats.get("cached_tokens", 0) / prompt if prompt else 0.0)
        tiers = stats.get("hicache")
        if tiers:
            for tier in ("device", "host"):
                self.tier_tokens.labels(tier).set(tiers[tier]["cached"])
                self.tier_capacity.labels(tier).set(tiers[tier]["capacity"])
            self.tier_tokens.labels("storage").set(tiers["storage"]["index_tokens"])
            for tier in ("device", "host", "storage"):
                self.tier_hits.labels(tier).set(tiers["hit_tokens_" + tier])
            for way in ("device_to_host", "host_to_device", "host_to_storage", "storage_to_host"):
                self.tier_bytes.labels(way).set(tiers["bytes_" + way])
        verifies = stats.get("spec_verify_reqs") or 0
        self.spec_accept_length.set(stats.get("spec_verify_tokens", 0) / verifies
                                    if verifies else 0.0)
        self.spec_verify_steps.set(stats.get("spec_verify_steps", 0))
        return generate_latest(self.registry)
