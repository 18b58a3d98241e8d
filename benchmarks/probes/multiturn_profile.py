"""Where the hierarchical cache's `on` run of benchmarks/multiturn_long.py spends its time (GPU).

    python benchmarks/probes/multiturn_profile.py [multiturn_long.py's arguments] \
        --window-start 8 --window 3      # or --cuda-events: no profiler (GPU)

Runs the `on` arm (host pool only) once, counts the scheduler's steps by kind for the whole run
(decode chained with overlap, decode run synchronously, extend; host seconds in each), and takes
a torch.profiler trace of the scheduler thread and the GPU for `--window` seconds from
`--window-start`. Prints one JSON line: the step counts, and from the trace the compute stream's
busy share, the host -> device copies' time and how much of it ran while the compute stream was
busy, the compute stream's idle gaps, and benchmarks/trace_summary.py's per-stream summary.
The profiler's per-op recording slows the host several times over, which inflates host-bound
gaps; `--cuda-events` skips it and times every forward with CUDA events instead (GPU time of
each step kind, and the compute stream's time between forwards by the kinds on either side).
Either way it splits the server's TTFT in two (waiting to be admitted, then the extend step)
and counts Python's garbage collections (each one stops every thread); `--cprofile` and
`--sync-debug` add the scheduler's top functions and its host <-> device syncs by call site.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import sys
import tempfile
import threading
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import torch  # noqa: E402

from benchmarks import multiturn_long as mt  # noqa: E402
from benchmarks.probes.step_timeline import StepTimeline  # noqa: E402
from benchmarks.trace_summary import load_events, summarize  # noqa: E402


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _overlap(spans: list[tuple[float, float]], busy: list[tuple[float, float]]) -> float:
    """Microseconds of `spans` that fall inside the (sorted, disjoint) `busy` intervals."""
    total, j = 0.0, 0
    for a, b in sorted(spans):
        while j < len(busy) and busy[j][1] <= a:
            j += 1
        k = j
        while k < len(busy) and busy[k][0] < b:
            total += max(0.0, min(b, busy[k][1]) - max(a, busy[k][0]))
            k += 1
    return total


def copy_overlap(path: str) -> dict:
    """The compute stream (the one with the most kernel time) against the host -> device copies."""
    events = [e for e in load_events(path) if e.get("ph") == "X" and "dur" in e]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    copies = [e for e in events if e.get("cat") == "gpu_memcpy"]
    if not kernels:
        return {}
    by_stream = collections.defaultdict(list)
    for k in kernels:
        by_stream[k.get("args", {}).get("stream")].append((k["ts"], k["ts"] + k["dur"]))
    compute = max(by_stream, key=lambda s: sum(b - a for a, b in by_stream[s]))
    busy = _union(by_stream[compute])
    start, end = busy[0][0], busy[-1][1]
    h2d = [(c["ts"], c["ts"] + c["dur"]) for c in copies if "HtoD" in c.get("name", "")]
    d2h = [(c["ts"], c["ts"] + c["dur"]) for c in copies if "DtoH" in c.get("name", "")]
    busy_us = sum(b - a for a, b in busy)
    h2d_us = sum(b - a for a, b in _union(h2d))
    return {"compute_stream": compute, "window_ms": round((end - start) / 1e3, 1),
            "compute_busy_share": round(busy_us / (end - start), 3),
            "compute_idle_ms": round((end - start - busy_us) / 1e3, 1),
            "h2d_ms": round(h2d_us / 1e3, 1),
            "h2d_beside_compute_share": round(_overlap(_union(h2d), busy) / max(h2d_us, 1), 3),
            "h2d_bytes_gb": round(sum(c.get("args", {}).get("bytes", 0) for c in copies
                                      if "HtoD" in c.get("name", "")) / 1e9, 2),
            "d2h_ms": round(sum(b - a for a, b in _union(d2h)) / 1e3, 1),
            "other_streams_busy_ms": {str(s): round(sum(b - a for a, b in _union(v)) / 1e3, 1)
                                      for s, v in by_stream.items() if s != compute}}


def _count_steps(sched) -> dict:
    """Wrap the scheduler's step paths: calls and host seconds of each kind."""
    from radixlm.runtime.scheduler import decode_steps
    from radixlm.runtime.scheduler import scheduler as module

    stats = collections.defaultdict(lambda: [0, 0.0])

    def wrap(obj, name, tag):
        real = getattr(obj, name, None)
        if real is None:  # (a plain RadixCache has no hierarchical-cache paths)
            return

        def wrapped(*a, **k):
            t0 = time.perf_counter()
            try:
                return real(*a, **k)
            finally:
                s = stats[tag]
                s[0] += 1
                s[1] += time.perf_counter() - t0

        setattr(obj, name, wrapped)

    for name in ("_run_extend", "_run_decode", "_launch_decode", "_complete_decode", "_admit",
                 "_forward_or_oom", "_sample", "_process_tokens", "_decode_results",
                 "_sampling_info", "_merge_running", "_record_input_logprobs", "_step"):
        wrap(sched, name, name)
    for name in ("cache_unfinished_req", "cache_finished_req", "preload_back", "match_prefix",
                 "evict", "loading"):
        wrap(sched.tree_cache, name, "tree." + name)
    for name in ("build_extend", "as_decode"):
        wrap(module, name, name)
    wrap(decode_steps, "build_decode", "build_decode")
    return stats


def _time_forwards(sched) -> list:
    """Wrap the scheduler's forward (CUDA): CUDA events on the compute stream right before and
    after each, the step's kind and the host's seconds in the call. Far lighter than the
    profiler's per-op recording, which slows the host several times over."""
    marks: list = []
    real = sched._forward_or_oom

    def timed(fb, reqs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        try:
            return real(fb, reqs)
        finally:
            host = time.perf_counter() - t0
            end.record()
            marks.append((fb.mode.name.lower(), len(reqs), start, end, host, t0,
                          sum(fb.extend_lens_cpu), sum(fb.extend_prefix_lens_cpu)))

    sched._forward_or_oom = timed
    return marks


def _ttft_parts(sched) -> dict:
    """Wrap admission and token processing: per request, when it was submitted, first admitted
    (the extend that prefills it is built next) and given its first token, all on the scheduler's
    clock. Splits the server's TTFT into the wait before admission and the extend step itself."""
    seen: dict = {}
    real_admit, real_tokens = sched._admit, sched._process_tokens

    def admit(*a, **k):
        admitted = real_admit(*a, **k)
        now = time.perf_counter()
        for req in admitted:
            seen.setdefault(id(req), [req.created_at, now, None])
        return admitted

    def tokens(reqs, *a, **k):
        keep = real_tokens(reqs, *a, **k)
        now = time.perf_counter()
        for req in reqs:
            rec = seen.get(id(req))
            if rec is not None and rec[2] is None:
                rec[2] = now
        return keep

    sched._admit, sched._process_tokens = admit, tokens
    return seen


def _record_syncs() -> collections.Counter:
    """torch.cuda's sync debug mode (warn): every host <-> device synchronization the run makes,
    counted by its call site (the innermost radixlm frames), to find the ones that stall a step
    launched beside a forward in flight."""
    import traceback
    import warnings

    sites: collections.Counter = collections.Counter()
    real_show = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" not in str(message):
            return real_show(message, category, filename, lineno, file, line)
        frames = [f for f in traceback.extract_stack()[:-1] if "radixlm" in f.filename]
        sites[" < ".join(f"{os.path.basename(f.filename)}:{f.lineno}:{f.name}"
                         for f in reversed(frames[-4:]))] += 1

    warnings.showwarning = show
    warnings.simplefilter("always")
    torch.cuda.set_sync_debug_mode("warn")
    return sites


def _gc_pauses() -> dict:
    """Python's collections during the run (any thread's: a collection stops them all): count,
    seconds and the longest, by generation."""
    import gc

    out: dict = collections.defaultdict(lambda: {"count": 0, "s": 0.0, "max_s": 0.0})
    start = [0.0]

    def on_gc(phase, info):
        if phase == "start":
            start[0] = time.perf_counter()
            return
        dt = time.perf_counter() - start[0]
        g = out[str(info.get("generation"))]
        g["count"] += 1
        g["s"] += dt
        g["max_s"] = max(g["max_s"], dt)

    gc.callbacks.append(on_gc)
    return out


def _top_functions(prof, n: int = 40) -> dict:
    """The scheduler thread's functions with the most own time and the most cumulative time."""
    import pstats

    stats = pstats.Stats(prof).stats  # (file, line, name) -> (cc, calls, tottime, cumtime, _)

    def rows(key):
        top = sorted(stats.items(), key=lambda kv: -kv[1][key])[:n]
        return [f"{v[key]:.3f}s {v[1]}x {os.path.basename(f)}:{line}:{name}"
                for (f, line, name), v in top]

    return {"tottime": rows(2), "cumtime": rows(3)}


def ttft_summary(seen: dict) -> dict:
    recs = [r for r in seen.values() if r[2] is not None]
    out = {"requests": len(recs)}
    for name, i, j in (("wait_before_admission", 0, 1), ("admission_to_first_token", 1, 2),
                       ("server_ttft", 0, 2)):
        xs = sorted(r[j] - r[i] for r in recs)
        if xs:
            out[name] = {"p50_s": round(mt._pct(xs, 50), 4), "p90_s": round(mt._pct(xs, 90), 4),
                         "mean_s": round(sum(xs) / len(xs), 4)}
    return out


def gaps_by_kind(marks: list) -> dict:
    """GPU time of each step kind (first to last kernel of its forward, sampling excluded) and
    the compute stream's time between forwards, by the kinds on either side (idle, or the
    sampling and copies between them)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    kinds: dict = collections.defaultdict(lambda: {"steps": 0, "gpu_s": 0.0, "host_call_s": 0.0})
    between: dict = collections.defaultdict(float)
    for i, (kind, _, start, end, host, *_) in enumerate(marks):
        k = kinds[kind]
        k["steps"] += 1
        k["gpu_s"] += start.elapsed_time(end) / 1e3
        k["host_call_s"] += host
        if i + 1 < len(marks):
            between[f"{kind}->{marks[i + 1][0]}"] += end.elapsed_time(marks[i + 1][2]) / 1e3
    span = marks[0][2].elapsed_time(marks[-1][3]) / 1e3 if marks else 0.0
    return {"span_s": round(span, 2),
            "kinds": {k: {n: round(x, 3) if isinstance(x, float) else x for n, x in v.items()}
                      for k, v in kinds.items()},
            "between_s": {k: round(v, 3) for k, v in between.items()}}


def main() -> None:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--window-start", type=float, default=8.0)
    p.add_argument("--window", type=float, default=3.0)
    p.add_argument("--cprofile", action="store_true",
                   help="cProfile the scheduler's thread for the whole run (top functions)")
    p.add_argument("--sync-debug", action="store_true",
                   help="count the host <-> device syncs by call site (torch.cuda sync debug)")
    p.add_argument("--cuda-events", action="store_true",
                   help="no profiler window: CUDA events around every forward instead (GPU)")
    p.add_argument("--timeline", default=None,
                   help="with --cuda-events: every forward, KV move and request to this file "
                        "(JSON lines; probes/step_timeline.py)")
    own, rest = p.parse_known_args()
    args = mt.parse_args(rest)
    args.model_path = args.model_path or mt.default_model_path()
    import radixlm

    convs = mt._conversations(args)
    per_conv = (args.first_turn_len + (args.turns - 1) * args.question_len
                + args.turns * args.output_len)
    working_set = per_conv * len(convs)
    device_pool = int(working_set * args.device_fraction)
    eng = radixlm.Engine(model_path=args.model_path, load_format=args.load_format,
                         dtype=args.dtype, device=args.device, max_total_tokens=device_pool,
                         context_length=per_conv + 64, tokenizer_path=args.tokenizer_path,
                         enable_hierarchical_cache=True,
                         hicache_ratio=args.hicache_ratio or 1.25 / args.device_fraction,
                         hicache_write_policy=args.hicache_write_policy)
    trace = os.path.join(tempfile.mkdtemp(), "trace.json")
    out: dict = {"probe": "multiturn_profile", "git_commit": mt.git_commit(),
                 "device": (torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"), "window_start_s": own.window_start,
                 "window_s": own.window}
    try:
        eng.generate(input_ids=list(range(1000, 1016)), sampling_params={"max_new_tokens": 4})
        eng.flush_cache()
        stats = eng._call_in_loop(lambda: _count_steps(eng.scheduler))
        seen = eng._call_in_loop(lambda: _ttft_parts(eng.scheduler))
        syncs = _record_syncs() if own.sync_debug and torch.cuda.is_available() else None
        gc_pauses = _gc_pauses()
        cprof = None
        if own.cprofile:  # (a profiler is per thread: enabled on the scheduler's)
            import cProfile
            cprof = cProfile.Profile()
            eng._call_in_loop(cprof.enable)
        marks = (eng._call_in_loop(lambda: _time_forwards(eng.scheduler))
                 if own.cuda_events and torch.cuda.is_available() else None)
        timeline = None
        if marks is not None and own.timeline:
            timeline = StepTimeline()
            eng._call_in_loop(lambda: timeline.wrap_mover(eng.scheduler.tree_cache.mover))
            eng._call_in_loop(timeline.wrap_builds)
        kinds = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            kinds.append(torch.profiler.ProfilerActivity.CUDA)
        prof = torch.profiler.profile(activities=kinds)

        def profile_window():
            if own.cuda_events:
                return
            time.sleep(own.window_start)
            eng._call_in_loop(prof.start)
            time.sleep(own.window)
            eng._call_in_loop(prof.stop)

        t = threading.Thread(target=profile_window)
        t.start()
        t0 = time.perf_counter()
        hist = [[] for _ in convs]
        records = asyncio.run(mt._turns(eng, convs, hist, range(args.turns - 1), args,
                                        args.concurrency))
        out["duration_s"] = round(time.perf_counter() - t0, 2)
        t.join()
        if marks is not None:
            out["forwards"] = gaps_by_kind(marks)
            if timeline is not None and marks:
                timeline.write(own.timeline, marks, seen)
        if not own.cuda_events:
            prof.export_chrome_trace(trace)
        if cprof is not None:
            eng._call_in_loop(cprof.disable)
            out["cprofile"] = _top_functions(cprof)
        out["gc"] = {g: {k: round(v, 4) for k, v in x.items()} for g, x in gc_pauses.items()}
        out["ttft_parts"] = ttft_summary(seen)
        if syncs is not None:
            torch.cuda.set_sync_debug_mode(0)
            out["syncs"] = dict(syncs.most_common(25))
        ttfts = sorted(r["ttft"] for r in records)
        out["ttft_p50_s"] = round(mt._pct(ttfts, 50), 4)
        out["steps"] = {k: {"calls": v[0], "host_s": round(v[1], 2)} for k, v in stats.items()}
        st = eng.get_stats()
        out["forward_steps"], out["extend_steps"] = st["forward_steps"], st["extend_steps"]
        out["busy_s"] = round(st["busy_s"], 2)
    finally:
        eng.shutdown()
    if own.cuda_events:
        print(json.dumps(out))
        return
    out["copies"] = copy_overlap(trace)
    summary = summarize(trace, gap_ms=1.0, top=8)
    out["streams"] = summary.get("streams")
    out["most_time"] = summary.get("most_time")
    out["gaps_over_1ms"] = summary.get("gaps_over_ms")
    print(json.dumps(out))
    keep = os.environ.get("OUT")
    if keep:  # the trace itself, gzipped, for a closer look
        import gzip
        import shutil
        with open(trace, "rb") as src, gzip.open(os.path.join(keep, "trace.json.gz"), "wb") as dst:
            shutil.copyfileobj(src, dst)


if __name__ == "__main__":
    main()
