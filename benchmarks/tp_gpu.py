"""Tensor parallelism on the lent 2-GPU machine: TP=2 against TP=1, Llama-3.1-8B shape, dummy bf16.

    python benchmarks/tp_gpu.py --result-file benchmarks/results/tp_gpu.jsonl

Each TP size runs in a fresh subprocess (its own CUDA context and process group), the same
workloads as benchmarks/gpu_suite.py:
  bs1        1 request, 128 in / 256 out: output tokens / wall time, and the prefill alone;
             rank 0's wait for each step's samples (near 0: the host, not the GPU, is the bound),
             and each worker's host ms a step by kind (waiting for the batch, launching it)
  batch128   128 x (512 in, 128 out) offline: output tokens / wall time
A size written "2c" is TP=2 with the symmetric-memory all-reduce on (--no-disable-custom-all-reduce;
off by default), so `--sizes 1,2,2c` compares it with NCCL in one run; "2t" is TP=2 with
--enable-two-batch-overlap (extends of >= 2048 tokens overlap their all-reduces).
Prints one JSON line: each size's figures and the ratios tp2 / tp1. Both sizes use CUDA graphs
for decode (every rank replays the same bucket; the NCCL all-reduces are inside the graphs).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import signal
import subprocess
import sys
import time
import traceback

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)


def run_one(args) -> dict:
    """One TP size in this process: engine start-up, bs1, batch128."""
    import torch

    import radixlm
    from benchmarks.gpu_suite_parts import host_waits, rand_ids, timed_generate

    res: dict = {"tp_size": args.tp, "custom_all_reduce": args.custom_ar,
                 "two_batch_overlap": args.tbo}
    # the workers' host time a step (runtime/distributed/tp_worker.py), read after shutdown
    timing = os.path.join(args.log_dir, f"tp_worker.tp{args.one}")
    os.environ["RADIXLM_TP_WORKER_TIMING"] = timing
    t0 = time.perf_counter()
    eng = radixlm.Engine(model_path=args.model_path, load_format="dummy", dtype="bfloat16",
                         tokenizer_path=args.tokenizer_path, context_length=4096,
                         tp_size=args.tp, disable_cuda_graph=args.disable_cuda_graph,
                         disable_custom_all_reduce=not args.custom_ar,
                         enable_two_batch_overlap=args.tbo)
    res["engine_ready_s"] = round(time.perf_counter() - t0, 1)
    print(f"PROGRESS tp{args.tp} engine ready in {res['engine_ready_s']}s", flush=True)
    try:
        vocab = eng.runner.model_config.vocab_size
        rng = random.Random(1)
        timed_generate(eng, [rand_ids(rng, 32, vocab) for _ in range(4)], [8] * 4)  # warm-up
        prompt = rand_ids(rng, 128, vocab)
        timed_generate(eng, [prompt], [16])
        eng.flush_cache()
        ttft, _ = timed_generate(eng, [prompt], [1])
        eng.flush_cache()
        with host_waits() as waits:
            dt, n = timed_generate(eng, [prompt], [256])
        res.update(bs1_tok_s=round(n / dt, 1), bs1_prefill_s=round(ttft, 4),
                   bs1_decode_tok_s=round((n - 1) / max(dt - ttft, 1e-9), 1),
                   bs1_host_wait_ms_per_step=round(1e3 * waits[1] / max(waits[0], 1), 3),
                   bs1_waited_steps=waits[0])
        print(f"PROGRESS tp{args.tp} bs1 done at {time.perf_counter() - t0:.1f}s", flush=True)
        if args.profile:
            try:
                eng.flush_cache()
                timed_generate(eng, [prompt], [8])
                res["bs1_profile"] = _profile(eng, [prompt], 64, args.log_dir, f"tp{args.one}")
            except Exception as e:  # a measurement aid: never the run's end
                res["bs1_profile"] = f"failed: {e!r}"
        eng.flush_cache()
        dt, n = timed_generate(eng, [rand_ids(rng, 512, vocab) for _ in range(128)], [128] * 128)
        res["batch128_out_tok_s"] = round(n / dt, 1)
        print(f"PROGRESS tp{args.tp} batch128 done at {time.perf_counter() - t0:.1f}s", flush=True)
        if args.profile_batch:  # the same run again, under the profiler (slower: not timed)
            try:
                eng.flush_cache()
                res["batch128_profile"] = _profile(
                    eng, [rand_ids(rng, 512, vocab) for _ in range(128)], 128, args.log_dir,
                    f"tp{args.one}.batch128", trace=False)
            except Exception as e:  # a measurement aid: never the run's end
                res["batch128_profile"] = f"failed: {e!r}"
        res["peak_gpu0_mem_GB"] = round(torch.cuda.max_memory_allocated() / 1e9, 1)
        eng.check_integrity()
    except BaseException:
        traceback.print_exc()  # now: a hang in the shutdown below would hide it
        raise
    finally:
        eng.shutdown()
        print(f"PROGRESS tp{args.tp} shut down at {time.perf_counter() - t0:.1f}s", flush=True)
    res["workers"] = _worker_timing(timing, args.tp)
    return res


def _worker_timing(prefix: str, tp: int) -> dict:
    """Per worker rank and kind of step: ms a step in recv_batch and in the forward call."""
    out = {}
    for rank in range(1, tp):
        try:
            with open(f"{prefix}.rank{rank}.json") as f:
                kinds = json.load(f)["kinds"]
        except (OSError, ValueError, KeyError):
            continue
        out[f"rank{rank}"] = {kind: {"steps": k["steps"],
                                     "recv_ms": round(1e3 * k["recv_s"] / max(k["steps"], 1), 3),
                                     "forward_call_ms": round(1e3 * k["forward_call_s"]
                                                              / max(k["steps"], 1), 3)}
                              for kind, k in kinds.items()}
    return out


def _profile(eng, prompts, out_len: int, log_dir: str, name: str, trace: bool = True) -> dict:
    """torch.profiler over generating `out_len` tokens for each prompt in this process (rank 0):
    the kernels' share of the wall time (1 - idle: where a rank waits for its peer or for its
    host), the kernels with the most device time; the table (and a Chrome trace) go to log_dir."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.gpu_suite_parts import timed_generate

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        timed_generate(eng, prompts, [out_len] * len(prompts))
        torch.cuda.synchronize()
        wall = time.perf_counter() - t
    kernels = sorted((e for e in prof.events() if e.device_type.name == "CUDA"),
                     key=lambda e: e.time_range.start)
    busy_us = sum(e.time_range.elapsed_us() for e in kernels)
    # idle: the gaps between the union of kernel intervals; which kernel each big gap follows
    gaps, end, after = [], None, {}
    for e in kernels:
        if end is not None and e.time_range.start > end:
            gaps.append(e.time_range.start - end)
            if gaps[-1] > 20:
                key = prev_name[:40]
                after[key] = after.get(key, 0) + gaps[-1]
        if end is None or e.time_range.end > end:
            end, prev_name = e.time_range.end, e.name
    span = (end - kernels[0].time_range.start) if kernels else 0
    averages = prof.key_averages()
    table = averages.table(sort_by="device_time_total", row_limit=30)
    with open(os.path.join(log_dir, f"tp_gpu.{name}.profile.txt"), "w") as f:
        f.write(table)
    if trace:
        prof.export_chrome_trace(os.path.join(log_dir, f"tp_gpu.{name}.trace.json"))
    top_after = sorted(after.items(), key=lambda kv: -kv[1])[:6]
    by_kernel: dict = {}
    for e in kernels:
        by_kernel[e.name[:60]] = by_kernel.get(e.name[:60], 0) + e.time_range.elapsed_us()
    return {"wall_s": round(wall, 4), "kernel_s": round(busy_us / 1e6, 4),
            "kernel_share": round(busy_us / 1e6 / wall, 3), "kernels": len(kernels),
            "span_s": round(span / 1e6, 4), "idle_s": round(sum(gaps) / 1e6, 4),
            "idle_gaps_over_20us": sum(g > 20 for g in gaps),
            "idle_us_after": {k: round(v) for k, v in top_after},
            "top_kernels_ms": {k: round(v / 1e3, 1) for k, v in
                               sorted(by_kernel.items(), key=lambda kv: -kv[1])[:10]}}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-path", default=os.path.join(_ROOT, "benchmarks/configs/llama-3.1-8b"))
    p.add_argument("--tokenizer-path", default=".carry/smollm2-tokenizer")
    p.add_argument("--sizes", default="1,2", help="comma list of TP sizes")
    p.add_argument("--disable-cuda-graph", action="store_true")
    p.add_argument("--result-file", default=None)
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # child mode: a size
    p.add_argument("--timeout-s", type=float, default=240.0, help="per TP size")
    p.add_argument("--profile", action="store_true",
                   help="also profile 64 batch-1 steps on rank 0 (tables and traces in --log-dir)")
    p.add_argument("--profile-batch", action="store_true",
                   help="also profile a second batch128 run on rank 0 (its table in --log-dir)")
    p.add_argument("--log-dir", default=os.environ.get("OUT", "."),
                   help="each TP size's output (default $OUT or .)")
    args = p.parse_args(argv)
    if args.one is not None:
        import faulthandler

        args.tp = int(args.one.rstrip("ct"))
        args.custom_ar, args.tbo = "c" in args.one, "t" in args.one
        # a hang shows where it is: every thread's stack shortly before the parent's timeout
        faulthandler.dump_traceback_later(max(5.0, args.timeout_s - 10), exit=False)
        print("RESULT " + json.dumps(run_one(args)), flush=True)
        return {}
    import torch

    res: dict = {"bench": "tp_gpu", "date": datetime.datetime.now(datetime.timezone.utc)
                 .isoformat(timespec="seconds"),
                 "device": f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}",
                 "model": os.path.basename(args.model_path), "dtype": "bfloat16 (dummy weights)",
                 "cuda_graph": not args.disable_cuda_graph, "torch": torch.__version__}
    from benchmarks.offline_throughput import git_commit

    res["commit"] = git_commit()
    for tp in [x.strip() for x in args.sizes.split(",") if x.strip()]:
        t_size = time.perf_counter()
        cmd = [sys.executable, os.path.abspath(__file__), "--one", str(tp), "--timeout-s",
               str(args.timeout_s), "--model-path", args.model_path,
               "--tokenizer-path", args.tokenizer_path]
        cmd += ["--log-dir", args.log_dir] + (["--profile"] if args.profile else []) \
            + (["--profile-batch"] if args.profile_batch else [])
        if args.disable_cuda_graph:
            cmd.append("--disable-cuda-graph")
        log_path = os.path.join(args.log_dir, f"tp_gpu.tp{tp}.log")
        with open(log_path, "w") as log:  # the child and its TP worker ranks write here
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            try:
                proc.wait(timeout=args.timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)  # the worker ranks too
                proc.wait()
        text = open(log_path, errors="replace").read()
        lines = [ln for ln in text.splitlines() if ln.startswith("RESULT ")]
        if lines:
            res[f"tp{tp}"] = json.loads(lines[-1][7:])
        else:
            why = f"exit {proc.returncode}" if proc.returncode >= 0 else "timed out / killed"
            res.setdefault("errors", {})[f"tp{tp}"] = (
                f"{why} after {time.perf_counter() - t_size:.0f}s; log {log_path}, tail: "
                + text[-3000:])
        print("PARTIAL " + json.dumps(res), flush=True)
    keys = ("bs1_tok_s", "bs1_decode_tok_s", "batch128_out_tok_s")
    pairs = (("tp2", "tp1"), ("tp2c", "tp1"), ("tp2c", "tp2"), ("tp2t", "tp1"), ("tp2t", "tp2"))
    for a, b in pairs:
        if res.get(a) and res.get(b):
            res[f"ratio_{a}_{b}"] = {k: round(res[a][k] / res[b][k], 3) for k in keys}
    print(json.dumps(res), flush=True)
    if args.result_file:
        with open(args.result_file, "a") as f:
            f.write(json.dumps(res) + "\n")
    return res


if __name__ == "__main__":
    main()
