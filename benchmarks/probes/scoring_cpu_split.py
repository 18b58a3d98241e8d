"""Where does a scoring round's time go when radixlm serves it over HTTP: which process burns the CPU?

    python benchmarks/probes/scoring_cpu_split.py --workload hellaswag-style --rounds 1,2

Starts radixlm's server (peers/serve_and_run.py's command, its defaults), runs the peer
benchmark's scoring workload rounds (peers/run_scoring.py: echo + logprobs=1 + max_tokens=0,
token-id prompts, 16 in flight), and for each round prints one JSON line: the wall time and the
CPU seconds (user + system) each process spent in it: the HTTP server (FastAPI +
TokenizerManager), the scheduler (model forward + prompt logprobs), the detokenizer, and this
client (httpx, JSON decoding). On 2 cores the sum over processes is what competes with the model.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from benchmarks.peers import run_scoring as rs  # noqa: E402
from benchmarks.peers import scoring_workloads as sw  # noqa: E402
from benchmarks.peers import serve_and_run as sr  # noqa: E402
from benchmarks.peers import workloads as wl  # noqa: E402


def _cpu_by_role(root_pid: int) -> dict:
    """CPU seconds so far per process: the server forks the scheduler first, the detokenizer
    second (launch.py), so its children in creation order are named so."""
    import psutil

    root = psutil.Process(root_pid)
    kids = [c for c in root.children(recursive=True)
            if "resource_tracker" not in " ".join(c.cmdline())]
    kids.sort(key=lambda c: c.create_time())
    names = ["scheduler", "detokenizer"] + [f"child{i}" for i in range(2, len(kids))]
    out: dict = {}
    for role, p in [("http_server", root)] + list(zip(names, kids)):
        try:
            t = p.cpu_times()
        except psutil.Error:
            continue
        out[role] = t.user + t.system
    me = psutil.Process().cpu_times()
    out["client"] = me.user + me.system
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workload", default="hellaswag-style", choices=list(wl.SCORING))
    p.add_argument("--rounds", default="1,2")
    p.add_argument("--size", default="full", choices=["full", "small"])
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--port", type=int, default=30150)
    p.add_argument("--extra-args", default="", help="more server flags, space-separated")
    args = p.parse_args(argv)

    from benchmarks import datasets as ds

    rounds = [int(r) for r in args.rounds.split(",")]
    ws = sw.scoring_workloads([args.workload], rounds, sw.TextPool(ds.load_tokenizer(wl.default_gguf())),
                              wl.sizes(args.size))
    cmd = sr.server_command("radixlm", args.port, "") + args.extra_args.split()
    base = f"http://127.0.0.1:{args.port}"
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, cwd=_ROOT,
                            start_new_session=True)
    try:
        sr.wait_healthy(base, proc, 600)
        for w in ws:
            before, t0 = _cpu_by_role(proc.pid), time.perf_counter()
            res = rs.score_round(base, w, args.concurrency)
            wall, after = time.perf_counter() - t0, _cpu_by_role(proc.pid)
            cpu = {k: round(after[k] - before.get(k, 0.0), 2) for k in after}
            print(json.dumps({"workload": w.name, "round": w.round, "wall_s": round(wall, 3),
                              "cpu_s": cpu, "cpu_total_s": round(sum(cpu.values()), 2),
                              **w.summary()}), flush=True)
    finally:
        sr.stop(proc)


if __name__ == "__main__":
    main()
