"""Start-up time: fresh processes, launch to ready.

    python benchmarks/startup.py --runs 3 --result-file benchmarks/results/startup-cpu.jsonl

Two measurements, each from the moment the process is launched (interpreter start and imports
included) until it can serve:
  engine  `python -c "import radixlm; radixlm.Engine()"` (bundled SmolLM2 GGUF, default args)
          until that process prints that Engine() returned;
  serve   `python -m radixlm.launch_server` (what `make serve` runs) until GET /health is 200.

Each runs once on an empty cache directory first (cold: what the first launch after install
pays, GGUF parsing and tokenizer building included), then `--runs` times on the now-warm cache.
Medians are of the warm runs. The cache directory is a temporary one, so the user's cache is
neither used nor touched. Prints one JSON line with device, date, commit, command and the load
average (the CPU machines are shared: read the figures next to it).
"""

from __future__ import annotations

import argparse
import datetime
import http.client
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)

_ENGINE_CHILD = """
import time
t0 = time.perf_counter()
import radixlm
engine = radixlm.Engine()
print("READY %.4f" % (time.perf_counter() - t0), flush=True)
engine.shutdown()
"""


def git_commit() -> str:
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=_ROOT, capture_output=True,
                             text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=_ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return (sha or "unknown") + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def time_engine(env: dict, timeout: float) -> dict:
    """Seconds from launch to `Engine()` returned, and the part spent in the child's Python."""
    t0 = time.perf_counter()
    p = subprocess.Popen([sys.executable, "-c", _ENGINE_CHILD], cwd=_ROOT, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for line in p.stdout:
            if line.startswith("READY "):
                wall = time.perf_counter() - t0
                return {"wall_s": wall, "in_process_s": float(line.split()[1])}
        raise RuntimeError(f"the engine process exited without READY:\n{p.stderr.read()[-3000:]}")
    finally:
        try:
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _health(port: int) -> int | None:
    try:
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
        c.request("GET", "/health")
        status = c.getresponse().status
        c.close()
        return status
    except OSError:
        return None


def time_serve(env: dict, timeout: float) -> float:
    """Seconds from launch to the first 200 from GET /health."""
    from radixlm.net import free_port

    port = free_port()
    log = tempfile.TemporaryFile(mode="w+")
    t0 = time.perf_counter()
    p = subprocess.Popen([sys.executable, "-m", "radixlm.launch_server", "--port", str(port)],
                         cwd=_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
    try:
        while time.perf_counter() - t0 < timeout:
            if _health(port) == 200:
                return time.perf_counter() - t0
            if p.poll() is not None:
                log.seek(0)
                raise RuntimeError(f"the server exited with {p.returncode}:\n{log.read()[-3000:]}")
            time.sleep(0.02)
        raise RuntimeError(f"no 200 from /health within {timeout:.0f}s")
    finally:
        p.terminate()
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        log.close()


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=3, help="warm launches of each kind")
    ap.add_argument("--skip-engine", action="store_true")
    ap.add_argument("--skip-serve", action="store_true")
    ap.add_argument("--timeout", type=float, default=300.0, help="per launch, seconds")
    ap.add_argument("--result-file", default=None, help="append the JSON line to this file")
    args = ap.parse_args(argv)

    result: dict = {"load_avg_start": [round(x, 2) for x in os.getloadavg()]}
    def fresh_cache_env(cache_dir: str) -> dict:
        env = dict(os.environ, RADIXLM_CACHE_DIR=cache_dir)
        env.pop("RADIXLM_DISABLE_CACHE", None)
        return env

    if not args.skip_engine:
        with tempfile.TemporaryDirectory(prefix="radixlm-startup-cache-") as cache_dir:
            env = fresh_cache_env(cache_dir)
            cold = time_engine(env, args.timeout)  # fills the cache
            warm = [time_engine(env, args.timeout) for _ in range(args.runs)]
        result.update({
            "engine_ready_s_median": round(statistics.median(w["wall_s"] for w in warm), 3),
            "engine_ready_s_runs": [round(w["wall_s"], 3) for w in warm],
            "engine_in_process_s_median": round(statistics.median(w["in_process_s"] for w in warm), 3),
            "engine_ready_s_cold": round(cold["wall_s"], 3),
        })
    if not args.skip_serve:
        with tempfile.TemporaryDirectory(prefix="radixlm-startup-cache-") as cache_dir:
            env = fresh_cache_env(cache_dir)
            cold_serve = time_serve(env, args.timeout)
            warm = [time_serve(env, args.timeout) for _ in range(args.runs)]
        result.update({
            "serve_health_s_median": round(statistics.median(warm), 3),
            "serve_health_s_runs": [round(w, 3) for w in warm],
            "serve_health_s_cold": round(cold_serve, 3),
        })

    result.update({
        "load_avg_end": [round(x, 2) for x in os.getloadavg()],
        "model": "bundled SmolLM2-135M-Instruct Q4_1 GGUF, default Engine/server args",
        "device": f"cpu: {platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": git_commit(),
        "command": "python " + " ".join(map(shlex.quote, sys.argv if argv is None else [__file__, *argv])),
    })
    line = json.dumps(result)
    print(line)
    if args.result_file:
        os.makedirs(os.path.dirname(os.path.abspath(args.result_file)), exist_ok=True)
        with open(args.result_file, "a") as f:
            f.write(line + "\n")
    return result


if __name__ == "__main__":
    main()
