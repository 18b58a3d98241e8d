"""Where does one replica's time go under dp_router's workload?

py-spy samples every process of a served model (HTTP front, scheduler, detokenizer) while the
multi-tenant load runs against it.

    # device (py-spy travels as a wheel in .whl): writes $OUT/dp_profile.txt (py-spy raw stacks)
    python benchmarks/probes/dp_profile.py --out-dir "$OUT"
    # CPU dry run with the tiny model
    python benchmarks/probes/dp_profile.py --tiny --out-dir /tmp/dp_profile

Prints the load's result line (as dp_router's `single`) and the top own / inclusive frames per
process; the raw stacks stay in the out dir for a closer look.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import tempfile
import threading

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(os.path.dirname(_HERE))  # benchmarks/probes/ -> the repository


def main() -> None:
    from benchmarks import dp_load
    from benchmarks import dp_router as dr
    from benchmarks.pyspy_stacks import record, summarize
    from radixlm.net import free_port

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
    port = free_port()
    server = dr.Proc("S", dr.server_cmd(args, port, 0, kv), log_dir, port)
    raw = os.path.join(out_dir, "dp_profile.txt")
    try:
        server.wait_ready(args.start_timeout)
        dp_load.warm_up([server.url], args, vocab)
        prompts = dr.workload(args, vocab)

        def spy():  # start once the load is under way, sample the server and its children
            record(server.proc.pid, seconds, raw)

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
