"""What the plots show, picked from the committed results files (no matplotlib here).

Each results file is history: lines of several runs, older ones with other keys. Every picker
keeps the lines that have all the keys it needs and takes the newest of those (by the line's ISO
`date`), so a new run appended with the same keys moves the plot forward by itself. When no line
has the keys, it raises MissingKeys naming the file and the keys: a renamed field in a benchmark
must show up as a failing plot test, not as a silently stale picture.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


class MissingKeys(ValueError):
    """No line of a results file has every key a plot needs."""


@dataclass
class Source:
    """Where a plot's numbers come from, for its title and the docs' caption."""
    file: str
    device: str
    commit: str
    date: str  # YYYY-MM-DD (two, "a / b", where the panels come from two runs)

    def caption(self) -> str:
        return f"{self.file}, {self.device}, {self.commit}, {self.date}"


@dataclass
class Series:
    """One figure panel: for each bar label, per x group, the values of the run's rounds."""
    title: str
    unit: str
    groups: list = field(default_factory=list)  # x labels, in order
    bars: dict = field(default_factory=dict)  # label -> list (per group) of lists (rounds)


def read_lines(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def get(row: dict, path: str):
    """row["a"]["b"] for "a.b"; KeyError where any part is missing."""
    for part in path.split("."):
        if not isinstance(row, dict) or part not in row:
            raise KeyError(path)
        row = row[part]
    return row


def lines_with(rows: list[dict], keys: list[str], name: str) -> list[dict]:
    """The lines that have every key, oldest first; MissingKeys when there is none."""
    def has(row):
        try:
            return all(get(row, k) is not None for k in keys)
        except KeyError:
            return False

    out = sorted((r for r in rows if has(r)), key=lambda r: str(r["date"]))
    if not out:
        raise MissingKeys(f"{name}: no line has all of {keys}")
    return out


def short_gpu(device: str) -> str:
    """'2 x NVIDIA H100 80GB HBM3' -> '2 x H100' (for axis labels and titles)."""
    return device.replace("NVIDIA ", "").replace(" 80GB HBM3", "")


def _commit(row: dict) -> str:
    return str(row.get("git_commit") or row.get("commit") or "?").split(" ")[0]


def _source(name: str, row: dict, device: str | None = None) -> Source:
    return Source(name, device or str(row.get("device")), _commit(row), str(row["date"])[:10])


def _load(results_dir: str, name: str) -> list[dict]:
    return read_lines(os.path.join(results_dir, name))


# ------------------------------------------------------------------------------------ pickers

PEER_KEYS = ["started", "workload", "radixlm_s", "vllm_s", "date", "commit"]


def peers_cpu(results_dir: str = RESULTS_DIR) -> tuple[Source, Series]:
    """radixlm vs vLLM seconds per workload, every round of the newest full comparison run."""
    name = "peers-cpu.jsonl"
    rows = lines_with(_load(results_dir, name), PEER_KEYS, name)
    # the offline and program workloads; scoring runs (echo + prompt logprobs, kind "scoring",
    # minutes of vLLM time a round) are measured apart and would crowd the figure's scale
    rows = [r for r in rows if r.get("kind") != "scoring"] or rows
    started = max(r["started"] for r in rows)
    run = [r for r in rows if r["started"] == started]
    cpu = ", ".join(x for x in (run[-1].get("cpu_model"), run[-1].get("device")) if x)
    s = Series("wall time per workload (lower is better)", "s")
    for r in run:
        if r["workload"] not in s.groups:
            s.groups.append(r["workload"])
    for label, key in (("radixlm", "radixlm_s"), (f"vLLM {run[-1].get('vllm', '')}".strip(),
                                                   "vllm_s")):
        s.bars[label] = [[r[key] for r in run if r["workload"] == w] for w in s.groups]
    return _source(name, run[-1], cpu), s


GPU_KEYS = ["roofline_bs1_tok_s", "bs1_tok_s", "hf_static_compile_bs1_tok_s",
            "batch128_out_tok_s", "hf_batch128_out_tok_s", "device", "date"]


def gpu_suite(results_dir: str = RESULTS_DIR) -> tuple[Source, list[Series]]:
    """Batch-1 decode against the roofline and HF; batch 128 against HF generate (newest line)."""
    name = "gpu_suite.jsonl"
    r = lines_with(_load(results_dir, name), GPU_KEYS, name)[-1]
    bs1 = Series("batch-1 decode, 128 in / 256 out", "tok/s", ["bs1"], {
        "roofline (weights / copy bandwidth)": [[r["roofline_bs1_tok_s"]]],
        "radixlm": [[r["bs1_tok_s"]]],
        "HF transformers (static cache + compile)": [[r["hf_static_compile_bs1_tok_s"]]]})
    b128 = Series("128 x (512 in, 128 out)", "output tok/s", ["batch128"], {
        "radixlm": [[r["batch128_out_tok_s"]]],
        "HF transformers (generate)": [[r["hf_batch128_out_tok_s"]]]})
    return _source(name, r, str(r["device"]).split(" (")[0]), [bs1, b128]


DP_CONFIGS = {"single": "one replica", "round_robin": "DP=2 round robin",
              "cache_aware": "DP=2 cache-aware"}
DP_KEYS = ([f"results.{c}.req_s" for c in DP_CONFIGS]
           + [f"results.{c}.cache_hit_rate" for c in DP_CONFIGS]
           + ["workload.prefix_len", "workload.output_len", "git_commit", "date"])
DP_FILES = ("dp_router-h200x2.jsonl", "dp_router.jsonl", "dp_router-h100.jsonl")


def dp_router(results_dir: str = RESULTS_DIR) -> tuple[Source, list[Series]]:
    """Requests/s and hit rate per configuration: every line of the newest commit's DP runs."""
    rows = []
    for name in DP_FILES:
        rows += [dict(r, _file=name) for r in _load(results_dir, name)]
    rows = lines_with(rows, DP_KEYS, "dp_router*.jsonl")
    commit = rows[-1]["git_commit"]
    run = [r for r in rows if r["git_commit"] == commit and r["_file"] == rows[-1]["_file"]]

    def wl(r):
        return f"{r['workload']['prefix_len']}-token prompts, {r['workload']['output_len']} out"

    req = Series("throughput", "requests/s")
    hit = Series("radix cache hit rate", "hit rate")
    for r in run:
        if wl(r) not in req.groups:
            req.groups.append(wl(r))
    hit.groups = req.groups
    for c, label in DP_CONFIGS.items():
        for s, key in ((req, "req_s"), (hit, "cache_hit_rate")):
            s.bars[label] = [[r["results"][c][key] for r in run if wl(r) == g] for g in s.groups]
    last = rows[-1]
    device = str(last.get("machine") or last.get("gpu") or last.get("device")).split(" (")[0]
    return _source(last["_file"], last, device), [req, hit]


TP_KEYS = ["tp1.bs1_decode_tok_s", "tp2.bs1_decode_tok_s", "tp1.batch128_out_tok_s",
           "tp2.batch128_out_tok_s", "device", "date"]


def tp_gpu(results_dir: str = RESULTS_DIR) -> tuple[Source, list[Series]]:
    """TP=1 vs TP=2 per device (the newest line with both sizes on each device)."""
    name = "tp_gpu.jsonl"
    rows = lines_with(_load(results_dir, name), TP_KEYS, name)
    newest = {short_gpu(r["device"]): r for r in rows}  # oldest first: the last per device wins
    devices = sorted(newest)
    panels = []
    for key, title, unit in (("bs1_decode_tok_s", "batch-1 decode", "tok/s"),
                             ("batch128_out_tok_s", "128 x (512 in, 128 out)", "output tok/s")):
        panels.append(Series(title, unit, devices, {
            f"TP={n}": [[newest[d][f"tp{n}"][key]] for d in devices] for n in (1, 2)}))
    commits = " / ".join(f"{_commit(newest[d])} ({d.split(' x ')[-1]})" for d in devices)
    dates = sorted(str(newest[d]["date"])[:10] for d in devices)
    return Source(name, " and ".join(devices), commits, f"{dates[0]} / {dates[-1]}"), panels


def shared_prefix(results_dir: str = RESULTS_DIR) -> list[tuple[Source, Series]]:
    """Radix cache on vs off on shared-prefix workloads: the CPU offline run and the GPU suite."""
    cpu_name, gpu_name = "offline_throughput-cpu.jsonl", "gpu_suite.jsonl"
    c = lines_with(_load(results_dir, cpu_name),
                   ["elapsed_s", "no_cache_elapsed_s", "num_prompts", "device", "date"],
                   cpu_name)[-1]
    g = lines_with(_load(results_dir, gpu_name),
                   ["shared_prefix_on_s", "shared_prefix_off_s", "device", "date"], gpu_name)[-1]
    cpu = Series(f"CPU: {c['num_prompts']} prompts sharing system prompts", "s",
                 ["CPU"], {"radix cache on": [[c["elapsed_s"]]],
                           "radix cache off": [[c["no_cache_elapsed_s"]]]})
    gpu = Series("GPU: 32 x 16 prompts, 2048 shared + 64 own", "s", ["GPU"],
                 {"radix cache on": [[g["shared_prefix_on_s"]]],
                  "radix cache off": [[g["shared_prefix_off_s"]]]})
    return [(_source(cpu_name, c), cpu),
            (_source(gpu_name, g, str(g["device"]).split(" (")[0]), gpu)]
