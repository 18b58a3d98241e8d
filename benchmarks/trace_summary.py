"""A torch.profiler Chrome trace (.json or .json.gz, e.g. from /start_profile) summed up for a
serving question: where did the GPU spend the window, and what ran when it was slow.

    python benchmarks/trace_summary.py TRACE [--gap-ms 2] [--top 15]

Prints one JSON object: the window, GPU kernel time per stream (busy share of the window),
the longest kernels, the kernels with the most total time, and the idle gaps of the busiest
stream longer than --gap-ms with the kernel each follows (a host that launched late, or a
wait on another stream). Used by pd.py --profile-decode; a CPU-only trace gives the window and
no kernels."""

from __future__ import annotations

import argparse
import collections
import gzip
import json


def load_events(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def summarize(path: str, gap_ms: float = 2.0, top: int = 15) -> dict:
    events = [e for e in load_events(path) if e.get("ph") == "X" and "dur" in e]
    if not events:
        return {"trace": path, "events": 0}
    start = min(e["ts"] for e in events)
    end = max(e["ts"] + e["dur"] for e in events)
    kernels = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    out: dict = {"trace": path, "window_ms": round((end - start) / 1e3, 2),
                 "events": len(events), "kernels": len(kernels)}
    if not kernels:
        return out
    by_stream: dict = collections.defaultdict(list)
    for k in kernels:
        by_stream[k.get("args", {}).get("stream", k.get("tid"))].append(k)
    out["streams"] = {str(s): {"kernels": len(ks),
                               "busy_ms": round(sum(k["dur"] for k in ks) / 1e3, 2),
                               "busy_share": round(sum(k["dur"] for k in ks) / (end - start), 3)}
                      for s, ks in by_stream.items()}
    out["longest"] = [{"name": k["name"][:80], "ms": round(k["dur"] / 1e3, 3),
                       "stream": k.get("args", {}).get("stream"),
                       "at_ms": round((k["ts"] - start) / 1e3, 2)}
                      for k in sorted(kernels, key=lambda k: -k["dur"])[:top]]
    total: collections.Counter = collections.Counter()
    calls: collections.Counter = collections.Counter()
    for k in kernels:
        total[k["name"][:80]] += k["dur"]
        calls[k["name"][:80]] += 1
    out["most_time"] = [{"name": n, "ms": round(t / 1e3, 2), "calls": calls[n]}
                        for n, t in total.most_common(top)]
    busiest = max(by_stream.values(), key=lambda ks: sum(k["dur"] for k in ks))
    busiest.sort(key=lambda k: k["ts"])
    gaps, prev_end, prev_name = [], None, None
    for k in busiest:
        if prev_end is not None and k["ts"] - prev_end > gap_ms * 1e3:
            gaps.append({"ms": round((k["ts"] - prev_end) / 1e3, 2),
                         "at_ms": round((prev_end - start) / 1e3, 2), "after": prev_name[:60],
                         "before": k["name"][:60]})
        if prev_end is None or k["ts"] + k["dur"] > prev_end:
            prev_end, prev_name = k["ts"] + k["dur"], k["name"]
    out["gaps_over_ms"] = {"threshold_ms": gap_ms, "count": len(gaps),
                           "total_ms": round(sum(g["ms"] for g in gaps), 2),
                           "longest": sorted(gaps, key=lambda g: -g["ms"])[:top]}
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("trace")
    p.add_argument("--gap-ms", type=float, default=2.0)
    p.add_argument("--top", type=int, default=15)
    args = p.parse_args(argv)
    res = summarize(args.trace, args.gap_ms, args.top)
    print(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
