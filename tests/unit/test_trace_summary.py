"""benchmarks/trace_summary.py on a synthetic Chrome trace: per-stream busy time, the longest
kernels, and the busiest stream's idle gaps with the kernel each follows."""

from __future__ import annotations

import gzip
import json

from benchmarks.trace_summary import summarize


def _kernel(name, ts, dur, stream):
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "pid": 0,
            "tid": stream, "args": {"stream": stream}}


def test_streams_longest_and_gaps(tmp_path):
    events = [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 10},
              _kernel("gemv", 100, 1000, 7), _kernel("attn", 1100, 500, 7),
              _kernel("gemv", 6600, 1000, 7),  # 5 ms idle before it
              _kernel("nccl_recv", 200, 3000, 20)]
    path = tmp_path / "t.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    res = summarize(str(path), gap_ms=2.0, top=3)
    assert res["window_ms"] == 7.6 and res["kernels"] == 4
    assert res["streams"]["7"]["busy_ms"] == 2.5 and res["streams"]["20"]["busy_ms"] == 3.0
    assert [k["name"] for k in res["longest"]] == ["nccl_recv", "gemv", "gemv"]
    assert res["most_time"][0] == {"name": "nccl_recv", "ms": 3.0, "calls": 1}
    assert res["most_time"][1] == {"name": "gemv", "ms": 2.0, "calls": 2}
    # the busiest stream by kernel time is 20 (3.0 ms) with no gap; stream 7 is not checked
    assert res["gaps_over_ms"]["count"] == 0


def test_gap_on_the_busiest_stream(tmp_path):
    events = [_kernel("gemv", 0, 1000, 7), _kernel("attn", 1000, 500, 7),
              _kernel("gemv", 6500, 1000, 7), _kernel("copy", 0, 100, 9)]
    path = tmp_path / "t.json"
    path.write_text(json.dumps(events))
    gaps = summarize(str(path), gap_ms=2.0)["gaps_over_ms"]
    assert gaps["count"] == 1 and gaps["longest"][0] == {"ms": 5.0, "at_ms": 1.5,
                                                         "after": "attn", "before": "gemv"}


def test_cpu_only_trace(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "x",
                                                 "ts": 5, "dur": 20}]}))
    assert summarize(str(path)) == {"trace": str(path), "window_ms": 0.02, "events": 1,
                                    "kernels": 0}
