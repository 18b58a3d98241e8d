"""What another Python thread costs a thread that runs small torch ops, by switch interval.

    python benchmarks/probes/gil_switch.py [--intervals-ms 5,1,0.5,0.2] [--ops 2000]

Every torch op called from Python releases the GIL while it dispatches and takes it back after;
when another thread is running Python then, taking it back waits until CPython makes that
thread drop it: after the switch interval (sys.setswitchinterval, 5 ms by default). The
scheduler's forward is a few hundred such ops (an eager extend: ~400 launches on an 8B model),
and beside it run the Engine's caller (an asyncio client streaming tokens) and the hierarchical
cache's threads. For each interval: `--ops` small ops alone, beside a thread that runs Python
without pause, and beside one that runs Python in bursts (`--burst-ms` busy, then as long
asleep). Prints one JSON line: milliseconds for the ops in each case.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time

import torch


def _ops(x: torch.Tensor, n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        x.add(1)  # a small op: its dispatch releases the GIL
    return (time.perf_counter() - t0) * 1e3


def _beside(fn, busy_ms: float, idle_ms: float) -> float:
    """fn() while another thread runs Python for busy_ms, then sleeps idle_ms, in turn."""
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            end = time.perf_counter() + busy_ms / 1e3
            while time.perf_counter() < end and not stop.is_set():
                pass
            if idle_ms:
                time.sleep(idle_ms / 1e3)

    th = threading.Thread(target=spin, daemon=True)
    th.start()
    time.sleep(0.02)
    try:
        return fn()
    finally:
        stop.set()
        th.join()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--intervals-ms", default="5,1,0.5,0.2")
    p.add_argument("--ops", type=int, default=2000)
    p.add_argument("--burst-ms", type=float, default=2.0)
    args = p.parse_args()
    torch.set_num_threads(1)
    x = torch.zeros(64, 64)
    before = sys.getswitchinterval()
    rows = {}
    try:
        for ms in (float(v) for v in args.intervals_ms.split(",")):
            sys.setswitchinterval(ms / 1e3)
            rows[ms] = {"alone_ms": round(_ops(x, args.ops), 1),
                        "busy_thread_ms": round(_beside(lambda: _ops(x, args.ops), 1e9, 0), 1),
                        "bursty_thread_ms": round(_beside(lambda: _ops(x, args.ops),
                                                          args.burst_ms, args.burst_ms), 1)}
    finally:
        sys.setswitchinterval(before)
    print(json.dumps({"probe": "gil_switch", "ops": args.ops, "burst_ms": args.burst_ms,
                      "python": sys.version.split()[0], "torch": torch.__version__,
                      "by_interval_ms": rows}))


if __name__ == "__main__":
    main()
