"""Draw the committed results files into the docs' figures: one command regenerates them all.

    pip install matplotlib          # not a runtime dependency; the test extra has it
    python benchmarks/plot.py       # writes docs/img/*.png from benchmarks/results/*.jsonl

Which lines each figure takes is plot_data.py's business (the newest lines that have the keys it
needs); this file only draws. Each title names the results file, device, commit and date, so a
figure read without its caption still says where it comes from. Bars are the mean of a run's
rounds, with each round as a dot. PNGs at 100 dpi without matplotlib's version stamp, so
regenerating from unchanged results gives unchanged files (for a given matplotlib).
"""

from __future__ import annotations

import argparse
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
# as in offline_throughput.py: run as a script, benchmarks/ must not shadow installed packages
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import matplotlib  # noqa: E402

matplotlib.use("Agg")  # files only: no display on the CI or the GPU machine
import matplotlib.pyplot as plt  # noqa: E402

from benchmarks import plot_data as data  # noqa: E402

IMG_DIR = os.path.join(_ROOT, "docs", "img")
# one colour per role across the figures: radixlm (or the feature on) blue, the reference it is
# compared with orange, a bound or a baseline grey
ROLE_COLORS = (("radixlm", "#1f77b4"), ("cache-aware", "#1f77b4"), ("cache on", "#1f77b4"),
               ("TP=2", "#1f77b4"), ("vLLM", "#ff7f0e"), ("HF", "#ff7f0e"),
               ("round robin", "#ff7f0e"), ("cache off", "#7f7f7f"), ("TP=1", "#7f7f7f"),
               ("roofline", "#c7c7c7"), ("one replica", "#7f7f7f"))


def color(label: str) -> str:
    return next((c for role, c in ROLE_COLORS if role in label), "#2ca02c")


def _mean(vals: list) -> float:
    return sum(vals) / len(vals)


def _single_bars(ax, s: data.Series) -> None:
    """One group: a labelled bar per series, each with its value (no legend needed)."""
    labels = list(s.bars)
    means = [_mean(v[0]) for v in s.bars.values()]
    ax.bar(range(len(labels)), means, 0.6, color=[color(k) for k in labels])
    for x, m in enumerate(means):
        ax.annotate(f"{m:.0f}" if m >= 100 else f"{m:.3g}", (x, m), ha="center", va="bottom",
                    fontsize=8, xytext=(0, 2), textcoords="offset points")
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels([k.replace(" (", "\n(") for k in labels], fontsize=7)


def _grouped_bars(ax, s: data.Series) -> None:
    """Bars side by side per group (mean of the rounds), each round a dot; labels for a legend."""
    n = len(s.bars)
    width = 0.8 / n
    for i, (label, per_group) in enumerate(s.bars.items()):
        xs = [g + (i - (n - 1) / 2) * width for g in range(len(s.groups))]
        ax.bar(xs, [_mean(v) for v in per_group], width, label=label, color=color(label))
        for x, vals in zip(xs, per_group):
            if len(vals) > 1:
                ax.plot([x] * len(vals), vals, "k.", markersize=3)
    ax.set_xticks(range(len(s.groups)))
    ax.set_xticklabels(s.groups, fontsize=8)


def draw_bars(ax, s: data.Series, ratio: tuple[str, str] | None = None) -> None:
    """One panel; `ratio` = (a, b) writes mean a / mean b above each group's bars."""
    (_single_bars if len(s.groups) == 1 else _grouped_bars)(ax, s)
    if ratio:
        a, b = (s.bars[k] for k in ratio)
        for g in range(len(s.groups)):
            top = max(max(v[g]) for v in s.bars.values())
            x = g if len(s.groups) > 1 else (len(s.bars) - 1) / 2  # over the middle bar
            ax.annotate(f"{_mean(a[g]) / _mean(b[g]):.2f}x", (x, top), ha="center",
                        va="bottom", fontsize=9, fontweight="bold", xytext=(0, 12),
                        textcoords="offset points")
    ax.set_ylabel(s.unit)
    ax.set_title(s.title, fontsize=9)
    ax.margins(y=0.22)


def _save(fig, title: str, src: data.Source | None, out_dir: str, name: str,
          legend_from=None) -> str:
    """Title (and source) on top, the legend of `legend_from`'s bars under the panels, where it
    cannot hide a bar or a ratio."""
    fig.suptitle(title if src is None else f"{title}\n{src.caption()}", fontsize=9)
    bottom = 0.0
    if legend_from is not None:
        handles, labels = legend_from.get_legend_handles_labels()
        fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=8,
                   frameon=False)
        bottom = 0.07
    fig.tight_layout(rect=(0, bottom, 1, 1))
    path = os.path.join(out_dir, name)
    fig.savefig(path, dpi=100, metadata={"Software": None})
    plt.close(fig)
    return path


def plot_peers_cpu(results_dir: str, out_dir: str) -> str:
    src, s = data.peers_cpu(results_dir)
    fig, ax = plt.subplots(figsize=(8, 3.6))
    labels = list(s.bars)
    draw_bars(ax, s, ratio=(labels[1], labels[0]))
    return _save(fig, "radixlm vs vLLM's CPU build, SmolLM2-135M bf16 "
                 "(ratio: vLLM time / radixlm time)", src, out_dir, "peers_cpu.png", ax)


def plot_gpu_suite(results_dir: str, out_dir: str) -> str:
    src, (bs1, b128) = data.gpu_suite(results_dir)
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.6))
    draw_bars(axes[0], bs1, ratio=tuple(list(bs1.bars)[1:]))
    draw_bars(axes[1], b128, ratio=tuple(b128.bars))
    return _save(fig, "GPU suite, Llama-3.1-8B shape (dummy bf16 weights)", src, out_dir,
                 "gpu_suite.png")


def plot_dp_router(results_dir: str, out_dir: str) -> str:
    src, (req, hit) = data.dp_router(results_dir)
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    labels = list(req.bars)
    draw_bars(axes[0], req, ratio=(labels[2], labels[1]))
    draw_bars(axes[1], hit)
    axes[1].set_ylim(0, 1.1)
    return _save(fig, "DP=2: cache-aware vs round-robin routing vs one replica "
                 "(ratio: cache-aware / round robin)", src, out_dir, "dp_router.png", axes[0])


def plot_tp_gpu(results_dir: str, out_dir: str) -> str:
    src, panels = data.tp_gpu(results_dir)
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.6))
    for ax, s in zip(axes, panels):
        draw_bars(ax, s, ratio=("TP=2", "TP=1"))
    return _save(fig, "TP=2 vs TP=1, Llama-3.1-8B shape (dummy bf16 weights)", src, out_dir,
                 "tp_gpu.png", axes[0])


def plot_shared_prefix(results_dir: str, out_dir: str) -> str:
    (cpu_src, cpu), (gpu_src, gpu) = data.shared_prefix(results_dir)
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.6))
    for ax, s, src in ((axes[0], cpu, cpu_src), (axes[1], gpu, gpu_src)):
        draw_bars(ax, s, ratio=("radix cache off", "radix cache on"))
        ax.set_xlabel(src.caption(), fontsize=7)
    # the two panels have their own sources, written under each
    return _save(fig, "The radix cache on shared-prefix workloads (wall time, lower is better)",
                 None, out_dir, "shared_prefix.png")


PLOTS = [plot_peers_cpu, plot_gpu_suite, plot_dp_router, plot_tp_gpu, plot_shared_prefix]


def main(argv=None) -> list[str]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--results-dir", default=data.RESULTS_DIR)
    p.add_argument("--out-dir", default=IMG_DIR)
    args = p.parse_args(argv)
    os.makedirs(args.out_dir, exist_ok=True)
    paths = [plot(args.results_dir, args.out_dir) for plot in PLOTS]
    for path in paths:
        print(f"{os.path.relpath(path, _ROOT)}: {os.path.getsize(path) // 1024} KB")
    return paths


if __name__ == "__main__":
    main()
