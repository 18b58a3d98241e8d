"""Prometheus metrics (`--enable-metrics`, served at GET /metrics).

Names (`--metrics-names`): by default SGLang's, for what both servers measure, with SGLang's
documented label set (`model_name`, the served name), so dashboards written for SGLang
(`sglang:num_running_reqs`, `sglang:time_to_first_token_seconds`, ...) read this server as they
are. One name per quantity rather than both side by side: two names for one series would double
every sum a dashboard takes over a name pattern. `--metrics-names radixlm` gives the names this
server had before (`radixlm:*`, unlabelled) for dashboards built on those. What SGLang has no
metric of the same meaning for (the hierarchical cache's tiers, speculative verify steps) keeps
a `radixlm:` name either way: an `sglang:` name would promise a meaning it does not have.

Latencies are observed in the TokenizerManager as updates arrive; gauges that live in the
scheduler (running/queued requests, token usage, cache hit rate) are fetched when scraped.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
NAME_STYLES = ("sglang", "radixlm")


class ServerMetrics:
    def __init__(self, model_name: str = "default", names: str = "sglang"):
        if names not in NAME_STYLES:
            raise ValueError(f"--metrics-names {names!r}: choose from {NAME_STYLES}")
        r = self.registry = CollectorRegistry()
        p, labels = ("sglang:", {"model_name": model_name}) if names == "sglang" else \
            ("radixlm:", {})

        def shared(kind, name: str, doc: str, **kw):
            """One of SGLang's metrics, in the chosen naming; returns the labelled series."""
            m = kind(p + name, doc, list(labels), registry=r, **kw)
            return m.labels(**labels) if labels else m

        self.requests = shared(Counter, "num_requests", "Requests received")
        self.prompt_tokens = shared(Counter, "prompt_tokens", "Prompt tokens received")
        self.generation_tokens = shared(Counter, "generation_tokens", "Tokens generated")
        self.ttft = shared(Histogram, "time_to_first_token_seconds", "Time to first token",
                           buckets=_LATENCY_BUCKETS)
        self.itl = shared(Histogram, "inter_token_latency_seconds",
                          "Time between output updates", buckets=_LATENCY_BUCKETS)
        self.e2e = shared(Histogram, "e2e_request_latency_seconds", "End-to-end request latency",
                          buckets=_LATENCY_BUCKETS)
        self.num_running = shared(Gauge, "num_running_reqs", "Requests decoding")
        self.num_queued = shared(Gauge, "num_queue_reqs", "Requests waiting")
        self.token_usage = shared(Gauge, "token_usage", "Fraction of KV slots in use or cached")
        self.cache_hit_rate = shared(Gauge, "cache_hit_rate",
                                     "Cached prompt tokens / prompt tokens")
        self.spec_accept_length = shared(Gauge, "spec_accept_length", "Mean tokens a request "
                                         "appended per verify it drafted in (0: no speculation)")
        # radixlm's own (see the module doc); labelled gauges have no samples until set
        q = "radixlm:"
        self.tier_tokens = Gauge(q + "hicache_cached_tokens", "Tokens whose KV a tier holds "
                                 "(storage: the tree's index of stored tokens)", ["tier"],
                                 registry=r)
        self.tier_capacity = Gauge(q + "hicache_capacity_tokens", "Tokens a tier's pool holds",
                                   ["tier"], registry=r)
        self.tier_hits = Gauge(q + "hicache_hit_tokens", "Prompt tokens served from a tier",
                               ["tier"], registry=r)
        self.tier_bytes = Gauge(q + "hicache_bytes_moved", "KV bytes copied between tiers",
                                ["direction"], registry=r)
        self.spec_verify_steps = Gauge(q + "spec_verify_steps", "Verify forwards run",
                                       registry=r)
        # the scheduler's isolated failures (runtime/scheduler/isolation.py): each is a bug or
        # an overload that one request (or one batch, for an OOM) paid for instead of everyone
        self.request_failures = Gauge(q + "request_failures", "Requests failed alone by an "
                                      "exception in their own handling", registry=r)
        self.oom_steps = Gauge(q + "oom_steps", "Forwards that ran out of GPU memory (their "
                               "batch failed, or a speculative step ran again without drafts; "
                               "the server went on)", registry=r)
        self.spec_draft_failures = Gauge(q + "spec_draft_failures", "Speculative steps whose "
                                         "batched drafting raised (they ran without drafts)",
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
        self.request_failures.set(stats.get("request_failures", 0))
        self.oom_steps.set(stats.get("oom_steps", 0))
        self.spec_draft_failures.set(stats.get("spec_draft_failures", 0))
        return generate_latest(self.registry)
