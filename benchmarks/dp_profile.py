"""Where one replica's time goes under dp_router's workload: py-spy samples every process of a
served model (HTTP front, scheduler, detokenizer) while the multi-tenant load runs against it.

    # device (py-spy travels as a wheel in .whl): writes $OUT/dp_profile.txt (py-spy raw stacks)
    python benchmarks/dp_profile.py --out-dir "$OUT"
    # CPU dry run with the tiny model
    python benchmarks/dp_profile.py --tiny --out-dir /tmp/dp_profile

Prints the load's result line (as dp_router's `single`) and the top own / inclusive frames per
process; the raw stacks stay in the out dir for a closer look.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)


def summarize(raw_path: str, top: int = 25) -> str:
    """py-spy raw lines ('frame;frame;... count') -> top own and inclusive frames per process."""
    own: dict = collections.defaultdict(collections.Counter)
    incl: dict = collections.defaultdict(collections.Counter)
    totals: collections.Counter = collections.Counter()
    with open(raw_path) as f:
        for line in f:
            stack, _, n = line.rstrip().rpartition(" ")
            if not n.isdigit():
                continue
            frames = stack.split(";")
            # a child's stack starts with its parent's frames: the innermost "process" frame
            at = max((i for i, fr in enumerate(frames) if fr.startswith("process")), default=-1)
            proc = frames[at] if at >= 0 else "?"
            totals[proc] += int(n)
            own[proc][frames[-1]] += int(n)
            for fr in set(frames[at + 1:]):
                incl[proc][fr] += int(n)
    out = []
    for proc, tot in totals.most_common():
        out.append(f"== {proc[:160]}: {tot} samples")
        out += [f"own  {100 * v / tot:5.1f}% {k[:150]}" for k, v in own[proc].most_common(top)]
        out += [f"incl {100 * v / tot:5.1f}% {k[:150]}" for k, v in incl[proc].most_common(top)]
    return "\n".join(out)


def main() -> None:
    from benchmarks import dp_load
    from benchmarks import dp_router as dr

    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--out-dir", default=".")
    p.add_argument("--seconds", type=float, default=8.0, help="how long py-spy samples")
    own, rest = p.parse_known_args()
    out_dir, seconds = own.out_dir, own.seconds
    args = dr.parse_args(rest + ["--configs", "single"])  # dp_router's flags for the rest
    os.makedirs(out_dir, exist_ok=True)
    log_dir = tempfile.mkdtemp(prefix="dp_profile-")
    vocab = dr.prepare_model(args, log_dir)
    kv = int(args.max_total_tokens * args.single_kv_factor)
    port = dr._free_port()
    server = dr.Proc("S", dr.server_cmd(args, port, 0, kv), log_dir, port)
    raw = os.path.join(out_dir, "dp_profile.txt")
    try:
        server.wait_ready(args.start_timeout)
        dp_load.warm_up([server.url], args, vocab)
        prompts = dr.workload(args, vocab)

        def spy():  # start once the load is under way, sample the server and its children
            subprocess.run(["py-spy", "record", "--pid", str(server.proc.pid), "--subprocesses",
                            "--duration", str(int(seconds)), "--rate", "100", "--format", "raw",
                            "--output", raw], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)

        timer = threading.Timer(2.0, spy)
        timer.start()
        res = asyncio.run(dp_load.run_load(server.url, prompts, args, (server.url,)))
        timer.join()
        print(json.dumps(res), flush=True)
    finally:
        server.stop()
        shutil.copy(server.log_path, os.path.join(out_dir, "dp_profile_server.log"))
    if os.path.exists(raw):
        print(summarize(raw), flush=True)


if __name__ == "__main__":
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
    if _ROOT not in sys.path:
        sys.path.insert(0, _ROOT)
    main()
