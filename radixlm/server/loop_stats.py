"""Where a scheduler process's loop loses time between forwards: Python's garbage collector and
long loop turns, counted into the scheduler's stats (get_stats, /get_server_info's
internal_states).

A collection of the oldest generation walks every object the process tracks (torch's modules,
the tokenizer, the radix tree's nodes, requests): in a serving process that can take tens of
milliseconds, and every running request waits that long for its next token. `gc.callbacks`
time every collection (any thread's: they all hold the scheduler's GIL while it runs);
`--gc-warning-threshold-secs` (SGLang's flag; 0 = off) logs each pause above it.
`--enable-gc-freeze` moves everything alive once start-up is done (weights, graphs, tokenizer,
imported modules) into the permanent generation (`gc.freeze()`), so later collections walk only
what serving allocates.

Loop turns: the wall time of each turn of the serve loop that did work, as counts over fixed
bounds (`loop_turns_over_s` {"0.01": n, ...}), and of its parts (`loop_part_s_max` and
`loop_parts_over_10ms`, each {part: ...}): `messages` (requests in), `pd_poll` (a PD role's
arrived pages and handshakes), `step` (the scheduler step: on a GPU it includes waiting for the
step it completes) and `updates` (tokens out).
"""

from __future__ import annotations

import gc
import logging
import time
from typing import Optional

logger = logging.getLogger(__name__)

TURN_BOUNDS_S = (0.01, 0.02, 0.05, 0.1)
PARTS = ("messages", "pd_poll", "step", "updates")  # a turn's parts, in order


class LoopStats:
    def __init__(self, stats: dict, gc_warning_s: float = 0.0):
        self.stats, self.gc_warning_s = stats, gc_warning_s
        stats.update(gc_pauses=0, gc_pause_s_total=0.0, gc_pause_s_max=0.0,
                     loop_turn_s_max=0.0, loop_turns_over_s={str(b): 0 for b in TURN_BOUNDS_S},
                     loop_part_s_max=dict.fromkeys(PARTS, 0.0),
                     loop_parts_over_10ms=dict.fromkeys(PARTS, 0))
        self._gc_start: Optional[float] = None
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_start = time.perf_counter()
            return
        if self._gc_start is None:
            return
        dt, self._gc_start = time.perf_counter() - self._gc_start, None
        s = self.stats
        s["gc_pauses"] += 1
        s["gc_pause_s_total"] += dt
        s["gc_pause_s_max"] = max(s["gc_pause_s_max"], dt)
        if self.gc_warning_s and dt > self.gc_warning_s:
            logger.warning("garbage collection of generation %d took %.3f s (%d objects freed); "
                           "--enable-gc-freeze keeps start-up objects out of collections",
                           info.get("generation", -1), dt, info.get("collected", 0))

    def turn(self, marks: list[float]) -> None:
        """marks: perf_counter() at the turn's start and after each of PARTS."""
        s = self.stats
        seconds = marks[-1] - marks[0]
        s["loop_turn_s_max"] = max(s["loop_turn_s_max"], seconds)
        for b in TURN_BOUNDS_S:
            if seconds > b:
                s["loop_turns_over_s"][str(b)] += 1
        for part, t0, t1 in zip(PARTS, marks, marks[1:]):
            s["loop_part_s_max"][part] = max(s["loop_part_s_max"][part], t1 - t0)
            s["loop_parts_over_10ms"][part] += t1 - t0 > 0.01

    def close(self) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)


def freeze_startup_objects() -> int:
    """--enable-gc-freeze: collect once, then freeze what is left. Returns the frozen count."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
