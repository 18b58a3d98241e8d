"""benchmarks/plot.py: every figure draws from the committed results files, the docs show each
one, and a results file that no longer has the keys a figure needs fails loudly (MissingKeys)
instead of leaving a stale picture."""

import json
import os
import shutil
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)  # benchmarks/ is a folder at the repo root, not an installed package

from benchmarks import plot, plot_data  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def drawn(tmp_path_factory):
    out = tmp_path_factory.mktemp("img")
    return plot.main(["--out-dir", str(out)])


def test_every_figure_is_drawn(drawn):
    assert len(drawn) == len(plot.PLOTS) >= 4
    for path in drawn:
        with open(path, "rb") as f:
            head = f.read(8)
        assert head == PNG_MAGIC and os.path.getsize(path) > 5_000, path


def test_docs_show_every_committed_figure(drawn):
    docs = os.path.join(ROOT, "docs")
    text = "".join(open(os.path.join(docs, f)).read() for f in os.listdir(docs)
                   if f.endswith(".md"))
    for path in drawn:
        name = os.path.basename(path)
        committed = os.path.join(docs, "img", name)
        assert os.path.exists(committed), f"run python benchmarks/plot.py: {name} missing"
        assert os.path.getsize(committed) < 150_000, name
        assert f"(img/{name})" in text, f"no docs page shows img/{name}"


def _results_copy(tmp_path) -> str:
    dst = tmp_path / "results"
    shutil.copytree(os.path.join(ROOT, "benchmarks", "results"), dst)
    return str(dst)


def _drop(results_dir: str, name: str, key: str) -> None:
    """Remove the (dotted) key from every line of one results file."""
    path = os.path.join(results_dir, name)
    rows = plot_data.read_lines(path)
    for row in rows:
        *parents, last = key.split(".")
        for p in parents:
            row = row.get(p, {})
        row.pop(last, None)
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


@pytest.mark.parametrize("files,key,draw", [
    (["peers-cpu.jsonl"], "vllm_s", plot.plot_peers_cpu),
    (["gpu_suite.jsonl"], "hf_batch128_out_tok_s", plot.plot_gpu_suite),
    (["gpu_suite.jsonl"], "shared_prefix_off_s", plot.plot_shared_prefix),
    (["offline_throughput-cpu.jsonl"], "no_cache_elapsed_s", plot.plot_shared_prefix),
    (list(plot_data.DP_FILES), "results.cache_aware.req_s", plot.plot_dp_router),
    (["tp_gpu.jsonl"], "tp2", plot.plot_tp_gpu),
])
def test_a_missing_key_fails(tmp_path, files, key, draw):
    results = _results_copy(tmp_path)
    for name in files:
        _drop(results, name, key)
    with pytest.raises(plot_data.MissingKeys, match=key.split(".")[-1]):
        draw(results, str(tmp_path))


def test_the_newest_complete_run_is_taken(tmp_path):
    """A newer run appended with the same keys moves the figure; a newer line without them (an
    older format, a failed run) is passed over."""
    results = _results_copy(tmp_path)
    path = os.path.join(results, "peers-cpu.jsonl")
    last = plot_data.read_lines(path)[-1]
    newer = dict(last, started="2099-01-01T00:00:00+00:00", date="2099-01-01T00:10:00+00:00",
                 commit="fffffff", workload="only-this-one", kind="offline")
    broken = {k: v for k, v in newer.items() if k != "vllm_s"}
    broken["date"] = broken["started"] = "2100-01-01T00:00:00+00:00"
    with open(path, "a") as f:
        f.write(json.dumps(newer) + "\n" + json.dumps(broken) + "\n")
    src, series = plot_data.peers_cpu(results)
    assert (src.commit, src.date, series.groups) == ("fffffff", "2099-01-01", ["only-this-one"])
