"""Data parallelism: one replica vs DP=2 round-robin vs DP=2 cache-aware, on a multi-tenant
shared-prefix workload, in one run.

    # 2 GPUs, Llama-3.1-8B shape, dummy bf16 weights (~40 s after start-up on 2 x H200):
    python benchmarks/dp_router.py --result-file benchmarks/results/dp_router-h200x2.jsonl
    # CPU dry run of the same logic with a tiny random model (~1-2 min on 2 cores):
    python benchmarks/dp_router.py --tiny

Workload: `--groups` tenants, each with its own random `--prefix-len`-token system prompt, and
`--per-group` questions of `--question-len` own tokens each; all requests shuffled together (the
tenants arrive interleaved), greedy, `--output-len` tokens each (ignore_eos), sent as token ids to
/generate by a closed-loop client keeping `--max-concurrency` requests in flight (dp_load.py).

Servers, started once and reused by every configuration (caches flushed in between):
  A  launch_server --base-gpu-id 0, KV pool --max-total-tokens C
  B  launch_server --base-gpu-id 1, the same
  S  launch_server --base-gpu-id 0, KV pool C * dp (the single-replica reference; it shares GPU 0
     with A, idle while the other runs: an 8B model's weights twice and small KV pools fit)
Configurations: `single` = S alone; `round_robin` and `cache_aware` = `python -m radixlm.router
--policy P` in front of A and B (a router per configuration: fresh prefix trees).

Why C is capped (the choice that makes the comparison real): with an H200's whole memory as KV
(~800k tokens of this model) every tenant's prefix fits in every replica and routing hardly
matters (round robin computes each prefix twice, once per replica, instead of once). The point of
cache-aware routing is the cache *pressure* of many tenants: C defaults to 0.75 x (all tenants'
prefixes) per replica, so a replica holds half the tenants plus its running requests (cache-aware
gives each replica half of them) but not all of them (round robin sends every tenant everywhere,
and LRU eviction keeps throwing prefixes out). S gets C * dp, the same KV memory as the two
replicas together: its hit rate is what one cache holding the whole working set achieves, the
reference the cache-aware hit rate is compared with.

Cache hit rate = sum(meta_info.cached_tokens) / sum(meta_info.prompt_tokens) over the timed
requests. Prints one JSON line: per configuration req/s, output and prompt tok/s, hit rate,
client latency p50 / p90, requests per worker (and the cache-aware router's decisions), each
server's scheduler state sampled during the run (mean running / waiting requests, KV in use or
cached, forward steps, retractions), and the ratios
cache_aware / round_robin (req/s) and the cache-aware hit rate vs the single replica's.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

import httpx

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
if _ROOT not in sys.path:  # run as a script: the repository's packages
    sys.path.insert(0, _ROOT)

from benchmarks.dp_load import flush, run_load, warm_up  # noqa: E402
from benchmarks.pyspy_stacks import record, summarize  # noqa: E402
from radixlm.net import free_port  # noqa: E402

CONFIGS = ("single", "round_robin", "cache_aware")
# 1024 requests: with 512 a configuration took 3-5 s on 2 x H200, much of it the start when
# every tenant's prefix is still cold
WORKLOAD = {"groups": 32, "per_group": 32, "prefix_len": 1536, "question_len": 64,
            "output_len": 48, "max_concurrency": 128}
TINY_WORKLOAD = {"groups": 8, "per_group": 4, "prefix_len": 192, "question_len": 8,
                 "output_len": 4, "max_concurrency": 16}
TINY_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 2048,
               "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
               "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
               "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 4096,
               "tie_word_embeddings": False}


class Proc:
    """A server or router subprocess in its own process group, logging to a file."""

    def __init__(self, name: str, cmd: list[str], log_dir: str, port: int,
                 env: dict | None = None):
        self.name, self.port = name, port
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = os.path.join(log_dir, f"{name}.log")
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, cwd=_ROOT, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True, env=env)

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited (code {self.proc.returncode}); "
                                   f"log: {self.log_path}\n{self.tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} not ready in {timeout:.0f}s; log: {self.log_path}\n"
                           f"{self.tail()}")

    def tail(self) -> str:
        self._log.flush()
        with open(self.log_path, "rb") as f:
            return f.read()[-3000:].decode("utf-8", "replace")

    def stop(self, timeout: float = 30) -> None:
        """SIGTERM (a server lets running requests and pending page writes finish), then, after
        `timeout` seconds, SIGKILL to whatever is left of its process group."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # whatever is left of its group
        except (ProcessLookupError, PermissionError):
            pass
        self._log.close()


def server_cmd(args, port: int, gpu: int, kv: int) -> list[str]:
    cmd = [sys.executable, "-m", "radixlm.launch_server", "--port", str(port),
           "--model-path", args.model_path, "--load-format", "dummy", "--dtype", args.dtype,
           "--max-total-tokens", str(kv), "--base-gpu-id", str(gpu),
           "--context-length", str(args.prefix_len + args.question_len + args.output_len + 64),
           "--max-running-requests", str(args.max_concurrency), "--device", args.device]
    cmd += (["--tokenizer-path", args.tokenizer_path] if args.tokenizer_path
            else ["--skip-tokenizer-init"])
    return cmd + args.server_args.split()


def workload(args, vocab: int) -> list[list[int]]:
    rng = random.Random(args.seed)
    ids = lambda n: [rng.randrange(3, vocab) for _ in range(n)]  # noqa: E731
    prompts = []
    for _ in range(args.groups):
        prefix = ids(args.prefix_len)
        prompts += [prefix + ids(args.question_len) for _ in range(args.per_group)]
    rng.shuffle(prompts)  # tenants interleaved
    return prompts


def _spy(args, name: str, procs: dict) -> list[threading.Thread]:
    """--spy-dir: py-spy (raw stacks) over each of `procs` ({tag: Proc}, children included) for
    --spy-seconds, starting 2 s into the load; summaries are written when the threads end."""
    if not args.spy_dir:
        return []
    os.makedirs(args.spy_dir, exist_ok=True)

    def one(tag, proc):
        time.sleep(2.0)
        raw = os.path.join(args.spy_dir, f"{name}-{tag}.raw")
        record(proc.proc.pid, args.spy_seconds, raw)
        if os.path.exists(raw):
            with open(os.path.join(args.spy_dir, f"{name}-{tag}.txt"), "w") as f:
                f.write(summarize(raw) + "\n")

    threads = [threading.Thread(target=one, args=(t, p), daemon=True) for t, p in procs.items()]
    for t in threads:
        t.start()
    return threads


def run_config(name: str, args, prompts, servers: dict, log_dir: str) -> dict:
    if name == "single":
        flush([servers["S"].url])
        spies = _spy(args, name, {"S": servers["S"]})
        res = asyncio.run(run_load(servers["S"].url, prompts, args, (servers["S"].url,)))
        for t in spies:
            t.join()
        return res
    workers = [servers["A"].url, servers["B"].url]
    flush(workers)
    port = free_port()
    router = Proc(f"router-{name}", [sys.executable, "-m", "radixlm.router", "--port", str(port),
                                     "--worker-urls", *workers, "--policy", name], log_dir, port)
    try:
        router.wait_ready(120)
        spies = _spy(args, name, {"router": router, "A": servers["A"]})
        res = asyncio.run(run_load(router.url, prompts, args, tuple(workers)))
        for t in spies:
            t.join()
        listed = httpx.get(router.url + "/list_workers", timeout=30).json()
        res["routed"] = [w["routed"] for w in listed["workers"]]
        if "decisions" in listed:
            res["decisions"] = listed["decisions"]
    finally:
        router.stop()
    return res


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-path", default=os.path.join(_ROOT, "benchmarks/configs/llama-3.1-8b"))
    p.add_argument("--tokenizer-path", default=None,
                   help="default: none (--skip-tokenizer-init: requests are token ids)")
    p.add_argument("--tiny", action="store_true",
                   help="CPU dry run: a tiny random Llama and small sizes")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="bfloat16")
    for k in WORKLOAD:
        p.add_argument("--" + k.replace("_", "-"), type=int, default=None,
                       help=f"default {WORKLOAD[k]} (--tiny: {TINY_WORKLOAD[k]})")
    p.add_argument("--max-total-tokens", type=int, default=None,
                   help="KV tokens per DP replica (default: 0.75 x groups x prefix-len)")
    p.add_argument("--single-kv-factor", type=float, default=2.0,
                   help="the single replica's KV = this x the DP replica's")
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--one-gpu", action="store_true",
                   help="both DP replicas on GPU 0 (when only one GPU is lent: they then share "
                        "its compute, so this is not the 2-GPU measurement; the line says so)")
    p.add_argument("--server-args", default="", help="extra flags for every server")
    p.add_argument("--start-timeout", type=float, default=600)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--result-file", default=None)
    p.add_argument("--note", default=None)
    p.add_argument("--keep-logs", default=None, help="copy the servers' and routers' logs here")
    p.add_argument("--spy-dir", default=None,
                   help="py-spy the router and replica A (or S) during each configuration; raw "
                        "stacks and per-process summaries go here (needs py-spy)")
    p.add_argument("--spy-seconds", type=float, default=6.0)
    args = p.parse_args(argv)
    if args.tiny:
        args.device, args.dtype = "cpu", "float32"
    for k, v in (TINY_WORKLOAD if args.tiny else WORKLOAD).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.max_total_tokens is None:
        args.max_total_tokens = int(0.75 * args.groups * args.prefix_len)
    return args


def prepare_model(args, log_dir: str) -> int:
    """--tiny: writes the tiny config under log_dir (args.model_path points there). Returns the
    vocabulary the prompts draw ids from."""
    if args.tiny:
        args.model_path = os.path.join(log_dir, "tiny-llama")
        os.makedirs(args.model_path)
        with open(os.path.join(args.model_path, "config.json"), "w") as f:
            json.dump(TINY_CONFIG, f)
    with open(os.path.join(args.model_path, "config.json")) as f:
        return min(json.load(f)["vocab_size"], 49152)  # ids valid for the SmolLM2 tokenizer too


def main(argv=None) -> dict:
    args = parse_args(argv)
    log_dir = tempfile.mkdtemp(prefix="dp_router-")
    vocab = prepare_model(args, log_dir)
    configs = [c for c in args.configs.split(",") if c]
    kv, kv_single = args.max_total_tokens, int(args.max_total_tokens * args.single_kv_factor)
    plan = {}
    if "single" in configs:
        plan["S"] = (0, kv_single)
    if set(configs) - {"single"}:
        plan["A"], plan["B"] = (0, kv), (1 if not (args.tiny or args.one_gpu) else 0, kv)
    servers: dict[str, Proc] = {}
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally below
    t_start = time.perf_counter()
    try:
        for name, (gpu, cap) in plan.items():
            port = free_port()
            # CPU dry run: one thread per server (three of them share the cores)
            env = {**os.environ, "OMP_NUM_THREADS": "1"} if args.tiny else None
            servers[name] = Proc(name, server_cmd(args, port, gpu, cap), log_dir, port, env)
        for s in servers.values():
            s.wait_ready(args.start_timeout)
        startup_s = time.perf_counter() - t_start
        warm_up([s.url for s in servers.values()], args, vocab)
        prompts = workload(args, vocab)
        results = {}
        for c in configs:
            results[c] = run_config(c, args, prompts, servers, log_dir)
            print(f"{c}: {json.dumps(results[c])}", file=sys.stderr, flush=True)
        info = httpx.get(next(iter(servers.values())).url + "/get_server_info", timeout=30).json()
    finally:
        for s in servers.values():
            s.stop()
        if args.keep_logs:
            os.makedirs(args.keep_logs, exist_ok=True)
            for f in os.listdir(log_dir):
                if f.endswith(".log"):
                    shutil.copy(os.path.join(log_dir, f), args.keep_logs)
    res = {"bench": "dp_router", "device": info.get("device"), "dtype": info.get("dtype"),
           "model": os.path.basename(args.model_path.rstrip("/")), "load_format": "dummy",
           "results": results,
           "workload": {k: getattr(args, k) for k in ("groups", "per_group", "prefix_len",
                                                      "question_len", "output_len",
                                                      "max_concurrency", "seed")},
           "kv_tokens_per_replica": kv, "kv_tokens_single": kv_single,
           "startup_s": round(startup_s, 1), "total_s": round(time.perf_counter() - t_start, 1),
           "replica_gpus": "one shared" if (args.one_gpu or args.tiny) else "one each"}
    ca, rr, single = (results.get(k) for k in ("cache_aware", "round_robin", "single"))
    if ca and rr:
        res["cache_aware_vs_round_robin_req_s"] = round(ca["req_s"] / rr["req_s"], 3)
        res["cache_aware_vs_round_robin_out_tok_s"] = round(ca["out_tok_s"] / rr["out_tok_s"], 3)
    if ca and single:
        res["cache_aware_vs_single_req_s"] = round(ca["req_s"] / single["req_s"], 3)
        res["hit_rate_cache_aware_minus_single"] = round(
            ca["cache_hit_rate"] - single["cache_hit_rate"], 4)
        res["hit_rate_cache_aware_over_single"] = round(
            ca["cache_hit_rate"] / max(single["cache_hit_rate"], 1e-9), 3)
    from benchmarks.offline_throughput import git_commit

    res.update({"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "git_commit": git_commit(),
                "command": "python " + " ".join([os.path.relpath(__file__, _ROOT)] + sys.argv[1:])})
    if args.note:
        res["note"] = args.note
    line = json.dumps(res)
    print(line, flush=True)
    if args.result_file:
        with open(args.result_file, "a") as f:
            f.write(line + "\n")
    return res


if __name__ == "__main__":
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
    if _ROOT not in sys.path:
        sys.path.insert(0, _ROOT)
    main()
