"""Where does a scoring round's time go when radixlm serves it over HTTP: which process burns the CPU?

    python benchmarks/probes/scoring_cpu_split.py --workload hellaswag-style --rounds 1,2

Starts radixlm's server (peers/serve_and_run.py's command, its defaults), runs the peer
benchmark's scoring workload rounds (peers/run_scoring.py: echo + logprobs=1 + max_tokens=0,
token-id prompts, 16 in flight), and for each round prints one JSON line: the wall time and the
CPU seconds (user + system) each process spent in it: the HTTP server (FastAPI +
TokenizerManager), the scheduler (model forward + prompt logprobs), the detokenizer, and this
client (httpx, JSON decoding). On 2 cores the sum over processes is what competes with the model.

2026-11-27, 2-core AMD EPYC (AVX-512 BF16), bf16, d7271be, hellaswag-style full size (128 requests,
193.5k prompt tokens, 6.04k not in the tree): wall 11.4-13.0 s; CPU seconds scheduler 18.9-21.1,
HTTP server 2.2-2.4, detokenizer 0.5-0.7, client 0.5-0.9. So the scheduler is the time. Inside it
(an in-process Engine, the same requests, cProfile around the scheduler's steps: 8.5 s of 9.2 s
in 5 extend steps of 1507 / 2048 / 2048 / 372 / 64 tokens; the first is the one request that
computes the shared prefix, its 15 peers in flight wait for it and then match it):
  5.7 s  the C++ llama body over the 6.04k computed tokens (each attends to ~1.5k cached ones;
         split by module hooks: attention layers 3.5 s, MLP 2.3 s)
  0.9 s  lm_head (gemm_bf16) over every computed row: under echo each one is a scored row
  0.8 s  log-softmax + top-1 of those rows (logsumexp 0.31, float 0.28, topk 0.19)
  0.5 s  tolist: the served cached logprobs and the computed ones into Python lists
  0.1 s  sampling the last row of each request although max_new_tokens is 0 (exponential_)
vLLM 0.32 on the same round: 255-296 s; it reads no prefix cache for a request with prompt
logprobs (SamplingParams.skip_reading_prefix_cache), so it prefills all 193.5k tokens.
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
