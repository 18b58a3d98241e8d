"""server/loop_stats.py: garbage collections are timed and counted (and logged above
--gc-warning-threshold-secs), loop turns land in their bounds, and the start-up freeze moves
objects into the permanent generation."""

from __future__ import annotations

import gc
import logging

from radixlm.server.loop_stats import LoopStats, freeze_startup_objects


def test_collections_are_timed_counted_and_warned(caplog):
    stats: dict = {}
    loop = LoopStats(stats, gc_warning_s=1e-9)
    try:
        keep = [[i] for i in range(50_000)]  # objects for the collection to walk
        with caplog.at_level(logging.WARNING, logger="radixlm.server.loop_stats"):
            gc.collect()
    finally:
        loop.close()
    assert len(keep) == 50_000
    assert stats["gc_pauses"] >= 1
    assert 0 < stats["gc_pause_s_max"] <= stats["gc_pause_s_total"]
    assert any("garbage collection of generation 2" in r.getMessage() for r in caplog.records)
    n = stats["gc_pauses"]
    gc.collect()  # closed: no longer counted
    assert stats["gc_pauses"] == n


def test_turns_land_in_their_bounds():
    stats: dict = {}
    loop = LoopStats(stats)
    loop.close()
    for seconds in (0.001, 0.015, 0.03, 0.2):  # all of it in the step
        loop.turn([1.0, 1.0, 1.0, 1.0 + seconds, 1.0 + seconds])
    loop.turn([2.0, 2.0, 2.012, 2.013, 2.0135])  # 12 ms in a PD poll
    assert stats["loop_turns_over_s"] == {"0.01": 4, "0.02": 2, "0.05": 1, "0.1": 1}
    assert abs(stats["loop_turn_s_max"] - 0.2) < 1e-9
    assert stats["loop_parts_over_10ms"] == {"messages": 0, "pd_poll": 1, "step": 3, "updates": 0}
    assert abs(stats["loop_part_s_max"]["pd_poll"] - 0.012) < 1e-9


def test_freeze_moves_live_objects_out_of_collections():
    try:
        assert freeze_startup_objects() > 1000
        assert gc.get_freeze_count() > 1000
    finally:
        gc.unfreeze()
