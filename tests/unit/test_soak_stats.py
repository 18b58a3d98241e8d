"""benchmarks/soak_stats.py: the soak benchmark's slopes, flatness verdict and leak check (the
soak itself needs a server and minutes; these are its judgements on known series)."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from benchmarks.soak_stats import leak_check, lstsq_slope, proc_tree_usage, trend  # noqa: E402

TS = [60.0 * i for i in range(11)]  # 10 minutes, one sample a minute


def test_slope_of_a_line():
    assert lstsq_slope([0, 1, 2, 3], [1, 3, 5, 7]) == 2
    assert lstsq_slope([5], [1]) == 0.0
    assert lstsq_slope([1, 1], [1, 9]) == 0.0


def test_noise_around_a_level_is_flat():
    ys = [1000 + (5 if i % 2 else -5) for i in range(11)]  # +-0.5% noise
    t = trend(TS, ys, warmup=0.25)
    assert t["flat"] and abs(t["rel_change"]) <= 0.02 and t["drift"] < 0.02


def test_steady_growth_is_not_flat_and_warmup_is_left_out():
    grow = [1000 + 10 * i for i in range(11)]  # +1% a minute
    t = trend(TS, grow, warmup=0.25)
    assert not t["flat"]
    assert t["slope_per_min"] == 10.0
    assert t["points"] == 8  # minutes 3..10: the first quarter is warm-up
    # a jump during warm-up (a cache filling), level afterwards: flat
    warm = [100, 500, 900] + [1000] * 8
    assert trend(TS, warm, warmup=0.25)["flat"]
    assert not trend(TS, warm, warmup=0.0)["flat"]


def test_slack_for_small_counts():
    fds = [75] * 6 + [73] * 5  # two connections fewer: -2.7%, and no leak
    assert not trend(TS, fds, warmup=0.0)["flat"]
    assert trend(TS, fds, warmup=0.0, slack=3)["flat"]
    assert not trend(TS, [75 + i for i in range(11)], warmup=0.0, slack=3)["flat"]


def test_zero_series_is_flat():  # e.g. GPU memory on a CPU server
    t = trend(TS, [0] * 11)
    assert t["flat"] and t["rel_change"] == 0.0 and t["slope_per_min"] == 0.0


STATS = {"num_running": 0, "num_waiting": 0, "kv_capacity": 100, "kv_free": 60, "kv_cached": 40,
         "kv_locked": 0, "req_slots_free": 8, "req_slots": 8}


def test_leak_check_clean_and_each_leak_named():
    assert leak_check(STATS, 0, True, free_after_flush=100)["ok"]
    cases = [({"kv_free": 59}, "KV"), ({"kv_locked": 3}, "locked"), ({"num_running": 1}, "running"),
             ({"req_slots_free": 7}, "request rows")]
    for change, word in cases:
        r = leak_check({**STATS, **change}, 0, True)
        assert not r["ok"] and word in " ".join(r["problems"])
    assert "HTTP" in leak_check(STATS, 2, True)["problems"][0]
    assert "integrity" in leak_check(STATS, 0, False)["problems"][0]
    assert "flush" in leak_check(STATS, 0, True, free_after_flush=90)["problems"][0]


def test_process_tree_usage_of_this_process():
    u = proc_tree_usage(os.getpid())
    assert u["processes"] >= 1 and u["rss_bytes"] > 0 and u["threads"] >= 1
    assert u["open_files"] >= 3
