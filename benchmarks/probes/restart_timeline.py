"""Where a restart's TTFT goes: the timeline of each request of benchmarks/multiturn_long.py's
warm restart (one request at a time: --restart-concurrency 1), with the head split
(mem_cache/head_split.py) on or off.

    python benchmarks/probes/restart_timeline.py [--no-split] [--staging-mb N] \
        [--read-chunk-kb N] [--read-ahead N] [multiturn_long.py's arguments]

Runs multiturn_long.py as given (use --skip-off) with the tree cache's and the scheduler's
methods wrapped to record host times: the prefetch's start (the request queued), its lookup's
result (pages found, the split's head end, the rates the split used), each admission (the head's
and the final one), the park, the head forward's GPU seconds, the read's end (its own seconds,
bytes and pages), and the first token. Prints one JSON line per warm-restart request (ms from
the request's start), then the benchmark's own line. `--staging-mb`: the loads' device staging
ring (kv_mover.STAGING_BYTES; by default kv_mover.staging_bytes(): 1/64 of the device's memory
within [512 MiB, 2 GiB]), which decides how much of a split's tail can cross while its head
computes (docs/hicache.md). `--read-chunk-kb`: the file store's read(2) size
(storage/file_backend.READ_CHUNK); `--read-ahead`: the reader's fetcher threads and pages in
flight (page_reader.READ_AHEAD, half the cores by default).
"""

from __future__ import annotations

import json
import os
import sys
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from radixlm.runtime.mem_cache import kv_mover, page_reader  # noqa: E402
from radixlm.runtime.mem_cache.storage import file_backend  # noqa: E402
from radixlm.runtime.mem_cache.tier_prefetch import TierPrefetch  # noqa: E402
from radixlm.runtime.mem_cache.tier_transfers import TierTransfers  # noqa: E402
from radixlm.runtime.scheduler.prefill import AddResult, PrefillAdder  # noqa: E402
from radixlm.runtime.scheduler.split_heads import SplitHeads  # noqa: E402

EVENTS: list = []  # (host time, what, details)


def _record(cls, name, details) -> None:
    """Record `details(self, args, result)` after each call of cls.name (None: not recorded)."""
    real = getattr(cls, name)

    def wrapped(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        rec = details(self, args, out)
        if rec is not None and (name != "add" or out == AddResult.ADDED):
            EVENTS.append((time.perf_counter(), name, rec))
        return out

    setattr(cls, name, wrapped)


def _rates(cache) -> dict:
    """The rates the split used: this run's, else the store's priors (tier_transfers._rate)."""
    read, head, prefill = (cache._rate(n) for n in ("read_bps", "head_tps", "prefill_tps"))
    return {"head_tps": head and round(head), "prefill_tps": prefill and round(prefill),
            "read_tps": read and round(read / cache.host.token_bytes),
            "priors": sorted(cache._rate_priors)}


def _install(split: bool) -> None:
    _record(TierPrefetch, "start_prefetch", lambda s, a, op: op and {"tokens": len(op.tokens)})
    _record(TierPrefetch, "_on_found", lambda s, a, out: dict(
        _rates(s), found=a[1], idle=a[2] if len(a) > 2 else None, head_end=a[0].head_end,
        first=a[0].first, page=a[0].page))
    _record(TierPrefetch, "_on_read_end", lambda s, a, out: {
        "read_s": round(a[1], 4), "bytes": a[2], "landed": a[0].landed})
    _record(TierTransfers, "observe_head", lambda s, a, out: {"tokens": a[0],
                                                             "gpu_s": round(a[1], 4)})
    _record(SplitHeads, "_park", lambda s, a, out: {})
    _record(PrefillAdder, "add", lambda s, a, out: {
        "head": a[0].computing_head, "prefix": len(a[0].prefix_indices)})
    if not split:
        real_init = TierPrefetch._init_prefetch

        def init(self, *a, **k):
            real_init(self, *a, **k)
            self.split_heads = False

        TierPrefetch._init_prefetch = init


# the probe's flags -> (module, value, bits the flag's number is shifted by)
KNOBS = {"--staging-mb": (kv_mover, "STAGING_BYTES", 20),
         "--read-chunk-kb": (file_backend, "READ_CHUNK", 10),
         "--read-ahead": (page_reader, "READ_AHEAD", 0)}


def main() -> None:
    argv = sys.argv[1:]
    split = "--no-split" not in argv
    argv = [a for a in argv if a != "--no-split"]
    for flag, (module, name, shift) in KNOBS.items():  # the probe's own flags: module values
        if flag in argv:
            i = argv.index(flag)
            setattr(module, name, int(argv[i + 1]) << shift)
            del argv[i:i + 2]
    _install(split)
    import benchmarks.multiturn_long as mt

    calls, requests = [], []
    real_run, real_one = mt._run, mt._one

    def run(*a, **k):  # called for on, then the warm restart, then the cold one
        calls.append(time.perf_counter())
        return real_run(*a, **k)

    async def one(eng, prompt, sp):
        t0 = time.perf_counter()
        out = await real_one(eng, prompt, sp)
        requests.append((len(calls), t0, t0 + out["ttft"], len(prompt), out["details"]))
        return out

    mt._run, mt._one = run, one
    result = mt.main(argv)
    for phase, t0, t_first, n, details in requests:
        if phase != 2:  # the warm restart's
            continue
        line = {"split": split, "prompt": n, "ttft_ms": round((t_first - t0) * 1e3, 1),
                "details": details, "events": []}
        for t, what, rec in EVENTS:
            if t0 <= t <= t_first:
                line["events"].append(dict(rec, at_ms=round((t - t0) * 1e3, 1), what=what))
        print(json.dumps(line))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
