"""Prefill/decode disaggregation vs data parallelism on the same hardware: DP=2 colocated
(`launch_server --dp-size 2`, cache-aware router) against PD 1+1 (a prefill server on GPU 0, a
decode server on GPU 1, `radixlm router --pd-disaggregation`), on one Poisson arrival trace at
several request rates.

    # 2 GPUs, Llama-3.1-8B shape, dummy bf16 weights:
    python benchmarks/pd.py --result-file benchmarks/results/pd-h100x2.jsonl
    # CPU dry run of the same logic with a tiny random model:
    python benchmarks/pd.py --tiny

Trace: `--num-prompts` requests of random token ids; prompt lengths log-uniform in
[--input-len-min, --input-len-max] (so long prompts mix with many short ones), output lengths
uniform in [--output-len-min, --output-len-max] (ignore_eos, greedy), streamed from /generate;
arrivals Poisson at each of `--request-rates` (req/s), the same trace (one seed) for both arms.
The arms run one after the other, never together. One JSON line per (arm, rate): TTFT and
inter-token latency p50 / p99, request and token throughput (benchmarks/serving.py's metrics),
failures. (cache_hit_rate is ~0 for DP; on the PD decode side meta_info.cached_tokens counts
every prompt token it did not compute, received ones included.) What PD should show: ITL p99 free of the prefill stalls that long prompts put into a
colocated decode batch; what it costs: TTFT (the KV hand-off) and one GPU doing only prefill.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import random
import signal
import sys
import tempfile
import time
from types import SimpleNamespace

import httpx

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
if _ROOT not in sys.path:  # run as a script: the repository's packages
    sys.path.insert(0, _ROOT)

from benchmarks import datasets as ds  # noqa: E402
from benchmarks.dp_router import Proc, prepare_model  # noqa: E402
from benchmarks.offline_throughput import emit_result, git_commit  # noqa: E402
from benchmarks.serving import send_request, summarize  # noqa: E402
from radixlm.net import free_port  # noqa: E402

ARMS = ("dp2", "pd")
TRACE = {"num_prompts": 200, "input_len_min": 2048, "input_len_max": 8192,
         "output_len_min": 128, "output_len_max": 512}
TINY_TRACE = {"num_prompts": 12, "input_len_min": 32, "input_len_max": 256,
              "output_len_min": 4, "output_len_max": 16}


def trace(args, vocab: int) -> list[ds.BenchRequest]:
    rng = random.Random(args.seed)
    lo, hi = math.log(args.input_len_min), math.log(args.input_len_max)
    reqs = []
    for _ in range(args.num_prompts):
        n = int(math.exp(rng.uniform(lo, hi)))
        ids = [rng.randrange(3, vocab) for _ in range(n)]
        reqs.append(ds.BenchRequest("", ids, rng.randint(args.output_len_min,
                                                         args.output_len_max)))
    return reqs


def server_cmd(args, port: int, gpu: int, extra: list[str]) -> list[str]:
    cmd = [sys.executable, "-m", "radixlm.launch_server", "--port", str(port),
           "--model-path", args.model_path, "--load-format", "dummy", "--dtype", args.dtype,
           "--base-gpu-id", str(gpu), "--device", args.device,
           "--context-length", str(args.input_len_max + args.output_len_max + 64)]
    if args.max_total_tokens:
        cmd += ["--max-total-tokens", str(args.max_total_tokens)]
    cmd += (["--tokenizer-path", args.tokenizer_path] if args.tokenizer_path
            else ["--skip-tokenizer-init"])
    return cmd + extra + args.server_args.split()


def start_arm(arm: str, args, log_dir: str) -> tuple[str, list[Proc]]:
    """The arm's processes, ready. Returns (the URL clients use, the processes)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"} if args.device == "cpu" else None
    procs = []
    try:
        if arm == "dp2":
            port = free_port()
            procs.append(Proc("dp2", server_cmd(args, port, 0, ["--dp-size", "2"]), log_dir,
                              port, env))
        else:
            pp, dp, boot, rp = free_port(), free_port(), free_port(), free_port()
            second = 0 if args.device == "cpu" else 1
            procs.append(Proc("prefill", server_cmd(args, pp, 0, [
                "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(boot),
                "--disaggregation-transfer-backend", args.transfer_backend]), log_dir, pp, env))
            # (/start_profile writes only where the server allows)
            extra_decode = ["--profile-allowed-dirs", log_dir] if args.profile_decode else []
            procs.append(Proc("decode", server_cmd(args, dp, second, extra_decode + [
                "--disaggregation-mode", "decode",
                "--disaggregation-transfer-backend", args.transfer_backend]), log_dir, dp, env))
            procs.append(Proc("router", [sys.executable, "-m", "radixlm.router",
                                         "--pd-disaggregation", "--port", str(rp),
                                         "--prefill", procs[0].url, str(boot),
                                         "--decode", procs[1].url], log_dir, rp))
        for p in procs:
            p.wait_ready(args.start_timeout)
    except BaseException:
        for p in procs:
            p.stop()
        raise
    return procs[-1].url, procs


async def run_rate(url: str, reqs: list[ds.BenchRequest], rate: float, seed: int) -> dict:
    client_args = SimpleNamespace(send_text=False, disable_ignore_eos=False, backend="radixlm")
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(None, connect=30.0),
                                 limits=httpx.Limits(max_connections=None)) as client:
        rng = random.Random(seed)
        tasks, start = [], time.perf_counter()
        for i, req in enumerate(reqs):
            tasks.append(asyncio.create_task(send_request(client, client_args, req)))
            if i + 1 < len(reqs):
                await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
        return summarize(results, time.perf_counter() - start)


def loop_costs(st: dict) -> dict:
    """A scheduler's garbage-collection pauses and long loop turns (server/loop_stats.py),
    cumulative since its start."""
    return {k: st.get(k) for k in ("gc_pauses", "gc_pause_s_max", "gc_pause_s_total",
                                   "loop_turn_s_max", "loop_turns_over_s", "loop_part_s_max",
                                   "loop_parts_over_10ms")}


def start_profile(procs: list[Proc], arm: str, rate: float, steps: int, log_dir: str):
    """--profile-decode: start the decode server's profiler for its next `steps` steps; returns
    the trace's path (None when off or not the PD arm)."""
    if not steps or arm != "pd":
        return None
    decode = next(p for p in procs if p.name == "decode")
    r = httpx.post(decode.url + "/start_profile", timeout=30, json={
        "output_dir": log_dir, "profile_id": f"decode-rate{rate:g}", "num_steps": steps})
    r.raise_for_status()
    return r.text.rsplit("written to ", 1)[-1].strip()  # (the route answers in plain text)


def profile_summary(procs: list[Proc], trace: str) -> dict:
    """The trace's sums once written (the profiler stops itself after its steps; a run shorter
    than that is stopped here)."""
    from benchmarks.trace_summary import summarize

    decode = next(p for p in procs if p.name == "decode")
    if not os.path.exists(trace):
        httpx.post(decode.url + "/stop_profile", timeout=120)
    return summarize(trace, gap_ms=2.0, top=10)


def flush(servers: list[Proc]) -> None:
    """Empty the servers' radix caches between rates (the same trace runs again): a server
    answers 400 while requests still hold KV, so wait for it to drain."""
    for srv in servers:
        deadline = time.monotonic() + 120
        while httpx.post(srv.url + "/flush_cache", timeout=30).status_code != 200:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{srv.name}: /flush_cache refused for 120 s")
            time.sleep(0.2)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-path", default=os.path.join(_ROOT, "benchmarks/configs/llama-3.1-8b"))
    p.add_argument("--tokenizer-path", default=None,
                   help="default: none (--skip-tokenizer-init: requests are token ids)")
    p.add_argument("--tiny", action="store_true", help="CPU dry run: a tiny random Llama")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="bfloat16")
    for k, v in TRACE.items():
        p.add_argument("--" + k.replace("_", "-"), type=int, default=None,
                       help=f"default {v} (--tiny: {TINY_TRACE[k]})")
    p.add_argument("--request-rates", default=None, help="req/s, comma-separated "
                                                         "(default 0.5,1,2,4; --tiny: 2,8)")
    p.add_argument("--arms", default=",".join(ARMS))
    p.add_argument("--transfer-backend", default="gloo", choices=("gloo", "nccl"))
    p.add_argument("--max-total-tokens", type=int, default=None, help="KV pool per server")
    p.add_argument("--server-args", default="", help="extra flags for every server")
    p.add_argument("--start-timeout", type=float, default=600)
    p.add_argument("--warmup", type=int, default=2, help="requests before each arm's timings")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--result-file", default=None)
    p.add_argument("--note", default=None)
    p.add_argument("--log-dir", default=None,
                   help="servers' logs and profiles (default: a new temporary folder)")
    p.add_argument("--profile-decode", type=int, default=0, metavar="STEPS",
                   help="PD arm: torch.profiler on the decode server for its first STEPS steps "
                        "of each rate (/start_profile); the line gets trace_summary.py's sums")
    args = p.parse_args(argv)
    if args.tiny:
        args.device, args.dtype = "cpu", "float32"
    for k, v in (TINY_TRACE if args.tiny else TRACE).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.request_rates = [float(r) for r in (args.request_rates
                                             or ("2,8" if args.tiny else "0.5,1,2,4")).split(",")]
    return args


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="pd_bench-")
    os.makedirs(log_dir, exist_ok=True)
    vocab = prepare_model(args, log_dir)
    reqs = trace(args, vocab)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally below
    lines = []
    for arm in [a for a in args.arms.split(",") if a]:
        t0 = time.perf_counter()
        url, procs = start_arm(arm, args, log_dir)
        try:
            startup_s = time.perf_counter() - t0
            warm = trace(SimpleNamespace(**{**vars(args), "num_prompts": args.warmup,
                                            "seed": args.seed + 1000}), vocab)
            asyncio.run(run_rate(url, warm, 100.0, args.seed))
            servers = [p for p in procs if p.name != "router"]  # (dp2: its router broadcasts)
            for rate in args.request_rates:
                flush(servers)
                trace_path = start_profile(procs, arm, rate, args.profile_decode, log_dir)
                res = asyncio.run(run_rate(url, reqs, rate, args.seed))
                if trace_path:
                    res["decode_profile"] = profile_summary(procs, trace_path)
                info = httpx.get(procs[0].url + "/get_server_info", timeout=30).json()
                loop = {srv.name: [loop_costs(st) for st in httpx.get(
                    srv.url + "/get_server_info", timeout=30).json().get("internal_states", [])]
                    for srv in servers}
                res = {"bench": "pd", "arm": arm, "request_rate": rate, **res,
                       "device": info.get("device"), "dtype": info.get("dtype"),
                       "model": os.path.basename(args.model_path.rstrip("/")),
                       "trace": {k: getattr(args, k) for k in (*TRACE, "seed")},
                       "transfer_backend": args.transfer_backend if arm == "pd" else None,
                       "startup_s": round(startup_s, 1), "commit": git_commit(),
                       "loop": loop,
                       "note": args.note}
                lines.append(emit_result(res, args.result_file, __file__))
        finally:
            for p in reversed(procs):
                p.stop()
    print(f"logs: {log_dir}", file=sys.stderr)
    return lines


if __name__ == "__main__":
    main()
