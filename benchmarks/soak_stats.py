"""The soak benchmark's measurements and verdicts (benchmarks/soak.py), kept free of the server
and the traffic so they can be tested on their own.

- `proc_tree_usage`: RSS, open files and threads of a process and all its descendants, from
  /proc (the server's scheduler and detokenizer are children of the launcher).
- `trend`: after a warm-up fraction of the run, the least-squares slope of a sampled series
  (per minute), its relative change first -> last, and whether it is flat within a tolerance:
  the fitted line moves by at most `tol` of the series' mean over the window, and so does the
  first -> last change. A leak shows as a steady slope; noise around a level does not.
- `leak_check`: after the drain, the server holds no request and its KV pool only what the
  radix tree caches, none of it locked.
"""

from __future__ import annotations

import os
from typing import Optional

FLAT_TOL = 0.02  # the acceptance: flat within 2%


def _children_map() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
        except OSError:
            continue  # gone since listdir
        # the command name (field 2) may hold spaces and parentheses: split after the last ')'
        ppid = int(stat[stat.rindex(")") + 2:].split()[1])
        kids.setdefault(ppid, []).append(int(name))
    return kids


def proc_tree(pid: int) -> list[int]:
    """`pid` and its descendants that are alive now."""
    kids, out, todo = _children_map(), [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(kids.get(p, []))
    return out


def proc_usage(pid: int) -> Optional[dict]:
    """{"rss_bytes", "threads", "open_files"} of one process, None when it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None
    rss_kb = int(fields.get("VmRSS", "0 kB").split()[0])
    return {"rss_bytes": rss_kb * 1024, "threads": int(fields["Threads"]), "open_files": fds}


def proc_tree_usage(pid: int) -> dict:
    """Sums over `pid` and its descendants, and their count."""
    total = {"rss_bytes": 0, "threads": 0, "open_files": 0, "processes": 0}
    for p in proc_tree(pid):
        u = proc_usage(p)
        if u is None:
            continue
        for k, v in u.items():
            total[k] += v
        total["processes"] += 1
    return total


def lstsq_slope(ts: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys over ts (units of y per unit of t); 0 for < 2 points."""
    n = len(ts)
    if n < 2:
        return 0.0
    mt, my = sum(ts) / n, sum(ys) / n
    var = sum((t - mt) ** 2 for t in ts)
    if var == 0:
        return 0.0
    return sum((t - mt) * (y - my) for t, y in zip(ts, ys)) / var


def trend(ts: list[float], ys: list[float], warmup: float = 0.25,
          tol: float = FLAT_TOL, slack: float = 0.0) -> dict:
    """The series' trend after dropping the first `warmup` fraction of the run's time.

    `ts` in seconds since the start. Returns slope_per_min, rel_change (first -> last after
    warm-up; 0 when both are 0), drift (the fitted line's change over the window / the mean)
    and flat: both within `tol`, or the absolute changes within `slack` (small counts such as
    open files, where one client connection more or less is 1.3% of 75 and no leak)."""
    if not ts:
        return {"points": 0, "slope_per_min": 0.0, "rel_change": 0.0, "drift": 0.0, "flat": True}
    cut = ts[0] + warmup * (ts[-1] - ts[0])
    pts = [(t, y) for t, y in zip(ts, ys) if t >= cut]
    if len(pts) < 2:  # too short a run: judge on what there is
        pts = list(zip(ts, ys))
    t2, y2 = [p[0] for p in pts], [p[1] for p in pts]
    slope = lstsq_slope(t2, y2)
    mean = sum(y2) / len(y2)
    first, last = y2[0], y2[-1]
    rel = 0.0 if first == last else (last - first) / abs(first) if first else float("inf")
    drift = 0.0 if slope == 0 else abs(slope * (t2[-1] - t2[0])) / abs(mean) if mean else float("inf")
    line_change = abs(slope * (t2[-1] - t2[0]))
    flat = ((abs(rel) <= tol or abs(last - first) <= slack)
            and (drift <= tol or line_change <= slack))
    return {"points": len(y2), "slope_per_min": round(slope * 60, 6),
            "rel_change": round(rel, 6), "drift": round(drift, 6), "flat": flat}


def leak_check(stats: dict, open_requests: Optional[int], integrity_ok: bool,
               free_after_flush: Optional[int] = None) -> dict:
    """After the drain: no request left anywhere, the KV pool = free + the tree's evictable
    tokens (nothing locked, no request row held), the KV integrity check passed, and (when the
    cache was flushed) every slot free. Returns {"ok", "problems": [...], ...the numbers}."""
    cap, free, cached = stats["kv_capacity"], stats["kv_free"], stats["kv_cached"]
    problems = []
    if stats.get("num_running") or stats.get("num_waiting"):
        problems.append(f"requests left: {stats.get('num_running')} running, "
                        f"{stats.get('num_waiting')} waiting")
    if open_requests:
        problems.append(f"{open_requests} requests still tracked by the HTTP side")
    if stats.get("kv_locked"):
        problems.append(f"{stats['kv_locked']} tree tokens still locked")
    if free + cached != cap:
        problems.append(f"KV: free {free} + cached {cached} != capacity {cap}")
    if stats.get("req_slots_free") != stats.get("req_slots"):
        problems.append(f"request rows: {stats.get('req_slots_free')} free of "
                        f"{stats.get('req_slots')}")
    if not integrity_ok:
        problems.append("the KV integrity check failed")
    if free_after_flush is not None and free_after_flush != cap:
        problems.append(f"after /flush_cache {free_after_flush} of {cap} slots free")
    return {"ok": not problems, "problems": problems, "kv_capacity": cap, "kv_free": free,
            "kv_cached": cached, "kv_locked": stats.get("kv_locked"),
            "open_requests": open_requests, "free_after_flush": free_after_flush}
