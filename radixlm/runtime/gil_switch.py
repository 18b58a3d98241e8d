"""A shorter thread switch interval for the processes that run the scheduler beside other Python
threads (the Engine's caller and its event loop; the hierarchical cache's reader and writers).

Every torch op called from Python releases the GIL while it dispatches and takes it back after.
When another thread is running Python at that moment, taking it back waits until CPython makes
that thread drop it: after the switch interval, 5 ms by default. A scheduler step is a few
hundred such ops (an eager extend of an 8B model ~400 launches), so a client thread busy for a
few milliseconds (32 streams' tokens to hand out) stalled the step, and with it the GPU, for
that long. `benchmarks/probes/gil_switch.py` (this 2-core EPYC, 2026-11-28, two runs): 1,000
small ops beside a thread running Python took 1.4-5.5 s at 5 ms, 0.28-0.54 s at 0.5 ms, 0.22 s
at 0.2 ms (3-5 ms alone). The multi-turn benchmark with its client in the Engine's process ran
6.5% faster at 0.5 ms than at 5 (13.2-13.3 -> 12.4-12.5 s, alternated; with server processes
no change beyond the drift between runs); the whole benchmark (on, off, restart) once each: on
16.3 -> 12.6 s, the restart's store read 51k -> 64k tokens/s (`gil_switch-cpu.jsonl`).
Interleaving finer costs the other thread little: what it computes is the same.

RADIXLM_SWITCH_INTERVAL_MS sets the interval (default 0.5); 0 leaves Python's. Only ever lowers
it: a process that set a shorter one keeps it.
"""

from __future__ import annotations

import os
import sys

DEFAULT_MS = 0.5


def lower_switch_interval() -> float:
    """Apply the interval (see the module docstring); returns the interval now in force (s)."""
    raw = os.environ.get("RADIXLM_SWITCH_INTERVAL_MS", "")
    try:
        ms = float(raw) if raw else DEFAULT_MS
    except ValueError:
        raise ValueError(f"RADIXLM_SWITCH_INTERVAL_MS: not a number of milliseconds: {raw!r}") \
            from None
    if ms > 0 and ms / 1e3 < sys.getswitchinterval():
        sys.setswitchinterval(ms / 1e3)
    return sys.getswitchinterval()
