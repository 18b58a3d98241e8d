"""Where does an offline run's time go, step by step?

The wall time of every extend and decode step (synchronized on CUDA, so the overlap schedule is
off while probing), grouped by kind.

    python benchmarks/probes/step_probe.py --model-path benchmarks/configs/llama-3.1-8b \
        --workload shared_prefix
    # CPU, the bundled SmolLM2 (real weights), a peer workload written by peers/workloads.py:
    python benchmarks/probes/step_probe.py --device cpu --workloads-file W.json --workload short \
        --profile-extend-step 1 --profile-decode-step 10

Prints one JSON line: per kind (extend / decode / decode_grouped) the step count, total seconds,
mean batch size and tokens, and the seconds outside the steps (request handling, tokenization).
A diagnostic, not a benchmark: synchronizing every step costs time. --profile-*-step N profiles
steps N..N+2 of that kind with torch.profiler and prints the top ops to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from collections import defaultdict

import torch

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if _ROOT not in sys.path:  # run as a script: the repository's packages
    sys.path.insert(0, _ROOT)

from benchmarks.gpu_suite_parts import rand_ids, shared_prefix_workload  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-path", default=None,
                    help="default: the bundled SmolLM2 GGUF with its real weights")
    ap.add_argument("--tokenizer-path", default=None,
                    help="default: .carry/smollm2-tokenizer with --model-path, else the model's")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--workload", default="shared_prefix",
                    help="shared_prefix | batch128, or a workload name in --workloads-file")
    ap.add_argument("--workloads-file", default=None, help="from benchmarks/peers/workloads.py")
    ap.add_argument("--round", type=int, default=1, help="with --workloads-file")
    ap.add_argument("--engine-kw", type=json.loads, default={})
    ap.add_argument("--groups", type=int, default=32)
    ap.add_argument("--profile-decode-step", type=int, default=0,
                    help="profile decode steps N..N+2 with torch.profiler, print the top kernels")
    ap.add_argument("--profile-extend-step", type=int, default=0,
                    help="profile extend steps N..N+2 likewise")
    args = ap.parse_args()
    import radixlm

    kw = dict(dtype=args.dtype, context_length=4096, device=args.device,
              disable_overlap_schedule=True)
    if args.model_path:  # a config folder: random weights of that shape
        kw.update(model_path=args.model_path, load_format="dummy",
                  tokenizer_path=args.tokenizer_path or ".carry/smollm2-tokenizer")
    kw.update(args.engine_kw)
    eng = radixlm.Engine(**kw)
    sched = eng.scheduler
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    stats = defaultdict(lambda: {"steps": 0, "s": 0.0, "reqs": 0, "tokens": 0})

    def wrap(name, fn, kind_of):
        def timed(*a, **k):
            sync()
            t0 = time.perf_counter()
            out = fn(*a, **k)
            sync()
            kind, reqs, toks = kind_of(a)
            st = stats[kind]
            st["steps"] += 1
            st["s"] += time.perf_counter() - t0
            st["reqs"] += reqs
            st["tokens"] += toks
            return out
        setattr(sched, name, timed)

    def extend_kind(a):
        reqs = a[0]
        return "extend", len(reqs), sum(r.extend_len for r in reqs)

    def decode_kind(a):
        grouped = sched.prefix_grouper is not None and sched.prefix_grouper._plan is not None \
            and sched.prefix_grouper._key == tuple((r.rid, r.req_pool_idx, id(r.last_node))
                                                   for r in sched.running)
        return ("decode_grouped" if grouped else "decode"), len(sched.running), len(sched.running)

    wrap("_run_extend", sched._run_extend, extend_kind)
    wrap("_run_decode", sched._run_decode, decode_kind)
    for kind, step in (("decode", args.profile_decode_step), ("extend", args.profile_extend_step)):
        if step:
            profile_steps(sched, "_run_" + kind, step, args.device)
    rng = random.Random(0)
    vocab = eng.runner.model_config.vocab_size
    if args.workloads_file:
        from benchmarks.peers import workloads as wl

        w = next(w for w in wl.read_offline(args.workloads_file)
                 if w.name == args.workload and w.round == args.round)
        prompts, outs = w.prompt_ids, w.output_lens
    elif args.workload == "shared_prefix":
        prompts, outs = shared_prefix_workload(rng, vocab, groups=args.groups)
    else:
        prompts, outs = [rand_ids(rng, 512, vocab) for _ in range(128)], [128] * 128
    t0 = time.perf_counter()
    eng.generate(input_ids=prompts, sampling_params=[
        {"max_new_tokens": n, "temperature": 0, "ignore_eos": True} for n in outs])
    total = time.perf_counter() - t0
    in_steps = sum(v["s"] for v in stats.values())
    print(json.dumps({"workload": args.workload, "total_s": round(total, 2),
                      "outside_steps_s": round(total - in_steps, 3),
                      "fp32_gemm": eng.runner.fp32_gemm, "torch_threads": torch.get_num_threads(),
                      "shared_prefix_steps": sched.stats["shared_prefix_steps"],
                      "kinds": {k: {**v, "s": round(v["s"], 3)} for k, v in stats.items()}}))
    eng.shutdown()


def profile_steps(sched, name: str, first: int, device: str) -> None:
    """Profile calls first..first+2 of sched.<name>; print the top ops by self time, then by
    total time (to see the Python-level parents: model forward, sampling, metadata)."""
    inner, seen, prof = getattr(sched, name), [0], {}

    def profiled(*a, **k):
        seen[0] += 1
        if seen[0] == first:
            acts = [torch.profiler.ProfilerActivity.CPU]
            if device == "cuda":
                acts.append(torch.profiler.ProfilerActivity.CUDA)
            prof["p"] = torch.profiler.profile(activities=acts)
            prof["p"].__enter__()
        out = inner(*a, **k)
        if seen[0] == first + 2:
            prof["p"].__exit__(None, None, None)
            avg = prof["p"].key_averages()
            key = "cuda_time_total" if device == "cuda" else "self_cpu_time_total"
            print(f"--- {name} steps {first}..{first + 2}", file=sys.stderr)
            print(avg.table(sort_by=key, row_limit=20), file=sys.stderr)
            print(avg.table(sort_by="cpu_time_total", row_limit=14), file=sys.stderr)
        return out
    setattr(sched, name, profiled)


if __name__ == "__main__":
    main()
