"""Soak: steady mixed traffic for a given time; does anything grow that should not?

    python benchmarks/soak.py --minutes 60 --result-file benchmarks/results/soak-cpu.jsonl

Starts its own server on 127.0.0.1 (the bundled model unless --model-path), fills its KV pool
once (distinct long prompts: on the CPU a pool's pages become resident when first written, which
would look like RSS growth during the run), then for --minutes
keeps --concurrency clients busy with a mix: streamed chats, tool calls (forced, so a grammar
runs), JSON-schema answers, n > 1 completions, long and short prompts, requests aborted by rid
and streams the client drops, and a share of bad requests (each must get a 4xx). Every
--sample-s it samples the server's process tree (RSS, open files, threads, from /proc) and its
scheduler (GPU memory, KV slots in use, radix-tree tokens, from /get_server_info). After the
traffic stops and the server drains, it checks that no request leaked and that the KV pool holds
only the tree's evictable tokens (then, after /flush_cache, nothing). Prints one JSON line: per
series the slope after --warmup of the run, the relative change first -> last and the verdict
"flat within 2%" (benchmarks/soak_stats.py), the request counts per kind, the leak check.
Exits 1 when a 5xx, an unexpected answer, a leak or a non-flat resource series was seen.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import random
import shlex
import subprocess
import sys
import tempfile
import time

import httpx

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _ROOT)

from benchmarks.soak_stats import leak_check, proc_tree, proc_tree_usage, trend  # noqa: E402
from benchmarks.soak_traffic import Traffic, words  # noqa: E402
from benchmarks.offline_throughput import emit_result  # noqa: E402
from benchmarks.startup import git_commit  # noqa: E402

# the series whose growth would be a leak; the KV ones follow the traffic and are reported only
RESOURCE_SERIES = ("rss_bytes", "open_files", "threads", "gpu_memory_bytes")
# absolute changes that are noise, not growth: a client connection or a worker thread more
SLACK = {"open_files": 3, "threads": 1}


async def sample(base: str, pid: int, t0: float) -> dict:
    async with httpx.AsyncClient(timeout=30) as c:
        info = (await c.get(base + "/get_server_info")).json()
    st = info["internal_states"][0]
    s = {"t": round(time.monotonic() - t0, 1), **proc_tree_usage(pid),
         "gpu_memory_bytes": st.get("gpu_memory_allocated", 0),
         "kv_used": st["kv_capacity"] - st["kv_free"], "tree_tokens": st["kv_cached"],
         "open_requests": info.get("open_requests")}
    return s


async def drain_and_check(base: str, timeout: float = 120.0) -> dict:
    async with httpx.AsyncClient(timeout=30) as c:
        deadline = time.monotonic() + timeout
        while True:
            info = (await c.get(base + "/get_server_info")).json()
            st = info["internal_states"][0]
            idle = not st["num_running"] and not st["num_waiting"] and not info["open_requests"]
            if idle or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.5)
        integrity = (await c.get(base + "/debug/kv_integrity")).status_code == 200
        flushed = (await c.post(base + "/flush_cache")).status_code == 200
        after = (await c.get(base + "/get_server_info")).json()["internal_states"][0]
    check = leak_check(st, info["open_requests"], integrity,
                       after["kv_free"] if flushed else None)
    check["request_failures"] = st.get("request_failures")
    check["oom_steps"] = st.get("oom_steps")
    return check


async def fill_pool(base: str, concurrency: int, seed: int, limit_s: float) -> float:
    """Write every KV slot once before the clock starts: on the CPU the pool's pages become
    resident when first written, and a pool filling during the run looks like RSS growth. The
    allocator hands slots out first-in first-out, so computing `capacity` prompt tokens (distinct
    long prompts, one output token each) has touched them all. With the hierarchical cache the
    host pool's slots count too (written through as the device pool's are evicted; lazily
    committed on the CPU, so a host pool filling during the run read as 24 MB/min of RSS
    growth). Returns seconds."""
    rnd, t0 = random.Random(seed + 1), time.monotonic()
    async with httpx.AsyncClient(timeout=300) as c:
        async def computed() -> tuple[int, int]:
            st = (await c.get(base + "/get_server_info")).json()["internal_states"][0]
            host = ((st.get("hicache") or {}).get("host") or {}).get("capacity", 0)
            return st["prompt_tokens"] - st["cached_tokens"], st["kv_capacity"] + host

        async def one() -> None:
            await c.post(base + "/generate", json={"text": words(rnd, 700), "sampling_params":
                                                   {"max_new_tokens": 1, "temperature": 0}})
        start, cap = await computed()
        while time.monotonic() - t0 < limit_s:
            done, _ = await computed()
            if done - start >= cap * 1.05:
                break
            await asyncio.gather(*(one() for _ in range(concurrency)))
    return round(time.monotonic() - t0, 1)


async def soak(args, base: str, pid: int) -> dict:
    traffic, stop, samples = Traffic(base, args.seed), asyncio.Event(), []
    async with httpx.AsyncClient(timeout=30) as c:
        device = (await c.get(base + "/get_server_info")).json()["device"]
    fill_s = await fill_pool(base, args.concurrency, args.seed, args.fill_limit_s)
    t0 = time.monotonic()
    limits = httpx.Limits(max_connections=args.concurrency * 2)
    async with httpx.AsyncClient(timeout=args.request_timeout, limits=limits) as client:
        workers = [asyncio.create_task(traffic.worker(client, stop))
                   for _ in range(args.concurrency)]
        end = t0 + args.minutes * 60
        while time.monotonic() < end:
            samples.append(await sample(base, pid, t0))
            await asyncio.sleep(max(0.0, min(args.sample_s, end - time.monotonic())))
        samples.append(await sample(base, pid, t0))  # the last point of the loaded run
        stop.set()
        await asyncio.gather(*workers)
    leaks = await drain_and_check(base)
    ts = [s["t"] for s in samples]
    series = {k: [s[k] for s in samples] for k in
              RESOURCE_SERIES + ("kv_used", "tree_tokens", "processes")}
    slopes = {k: trend(ts, v, args.warmup, slack=SLACK.get(k, 0)) for k, v in series.items()}
    counts = {k: dict(v) for k, v in sorted(traffic.counts.items())}
    bad_answers = sum(n for v in counts.values() for o, n in v.items() if o != "ok" and o != "4xx")
    flat = all(slopes[k]["flat"] for k in RESOURCE_SERIES)
    return {"benchmark": "soak", "server_device": device, "minutes": args.minutes, "concurrency": args.concurrency,
            "sample_s": args.sample_s, "warmup": args.warmup, "pool_fill_s": fill_s,
            "max_total_tokens": args.max_total_tokens, "requests": traffic.n,
            "answers": counts, "bad_answers": bad_answers, "slopes": slopes,
            "acceptance": {"flat_within_2pct": flat, "series": list(RESOURCE_SERIES),
                           "no_leak": leaks["ok"], "no_bad_answers": bad_answers == 0},
            "leak_check": leaks, "samples": {"t": ts, **series}}


def _not_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _device_name(server_device) -> str:
    """The machine in words: the GPU's name when the server ran on CUDA, else the CPU."""
    cpu = f"cpu: {platform.processor() or platform.machine()}, {os.cpu_count()} cores"
    if not str(server_device or "").startswith("cuda"):
        return cpu
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout.split("\n")[0]
    except (OSError, subprocess.SubprocessError):
        out = ""
    return f"{out.strip() or 'cuda'} ({cpu})"


def start_server(args, port: int, log) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "radixlm.launch_server", "--host", "127.0.0.1",
           "--port", str(port), "--context-length", str(args.context_length), "--enable-metrics",
           "--max-total-tokens", str(args.max_total_tokens)]
    if args.model_path:
        cmd += ["--model-path", args.model_path]
    cmd += shlex.split(args.server_args)
    return subprocess.Popen(cmd, cwd=_ROOT, stdout=log, stderr=subprocess.STDOUT)


def wait_ready(base: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} while starting")
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"no 200 from /health within {timeout:.0f} s")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=float, default=60.0, help="how long the traffic runs")
    ap.add_argument("--sample-s", type=float, default=60.0, help="seconds between samples")
    ap.add_argument("--warmup", type=float, default=0.25,
                    help="fraction of the run left out of the slopes")
    ap.add_argument("--concurrency", type=int, default=4, help="clients sending at once")
    ap.add_argument("--model-path", default=None, help="default: the bundled SmolLM2")
    ap.add_argument("--context-length", type=int, default=4096)
    # the pool is filled before the clock starts (fill_pool); a small one fills quickly, and
    # evictions and retractions then run all along
    ap.add_argument("--max-total-tokens", type=int, default=16384, help="the server's KV pool")
    ap.add_argument("--fill-limit-s", type=float, default=600.0,
                    help="at most this long filling the pool before the run")
    ap.add_argument("--server-args", default="", help="more launch_server flags, one string")
    ap.add_argument("--request-timeout", type=float, default=300.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--result-file", default=None, help="append the JSON line to this file")
    args = ap.parse_args(argv)
    from radixlm.net import free_port

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = tempfile.NamedTemporaryFile("w+", prefix="radixlm-soak-", suffix=".log", delete=False)
    proc = start_server(args, port, log)
    load_start = [round(x, 2) for x in os.getloadavg()]
    try:
        wait_ready(base, proc, 600)
        result = asyncio.run(soak(args, base, proc.pid))
    except BaseException:
        log.flush()
        log.seek(0)
        sys.stderr.write(log.read()[-4000:])
        raise
    finally:
        tree = proc_tree(proc.pid)
        proc.terminate()
        try:
            code = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait()
        time.sleep(2)  # the children follow their parent within ~1 s (child_process.watch_parent)
        left = [p for p in tree if os.path.exists(f"/proc/{p}") and _not_zombie(p)]
    result.update({
        "server_exit_code": code, "processes_left": left, "server_log": log.name,
        "load_avg_start": load_start, "load_avg_end": [round(x, 2) for x in os.getloadavg()],
        "model": args.model_path or "bundled SmolLM2-135M-Instruct Q4_1 GGUF",
        "device": _device_name(result.get("server_device")),
        "git_commit": git_commit(),
    })
    emit_result(result, args.result_file, __file__)  # + date and command; one JSON line
    acc = result["acceptance"]
    ok = acc["flat_within_2pct"] and acc["no_leak"] and acc["no_bad_answers"] and not left
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
