"""Where an offline run's time goes, step by step: wall time of every extend and decode step
(synchronized on CUDA, so the overlap schedule is off while probing), grouped by kind.

    python benchmarks/step_probe.py --model-path benchmarks/configs/llama-3.1-8b --workload shared_prefix

Prints one JSON line: per kind (extend / decode / decode_grouped) the step count, total seconds,
mean batch size and tokens. A diagnostic, not a benchmark: synchronizing every step costs time.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections import defaultdict

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from gpu_suite import rand_ids, shared_prefix_workload  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--tokenizer-path", default=".carry/smollm2-tokenizer")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--workload", default="shared_prefix", choices=("shared_prefix", "batch128"))
    ap.add_argument("--engine-kw", type=json.loads, default={})
    ap.add_argument("--groups", type=int, default=32)
    ap.add_argument("--profile-decode-step", type=int, default=0,
                    help="profile decode steps N..N+2 with torch.profiler, print the top kernels")
    args = ap.parse_args()
    import radixlm

    kw = dict(model_path=args.model_path, load_format="dummy", dtype="bfloat16",
              tokenizer_path=args.tokenizer_path, context_length=4096, device=args.device,
              disable_overlap_schedule=True)
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
    if args.profile_decode_step:
        inner, seen, prof = sched._run_decode, [0], {}

        def profiled(*a, **k):
            seen[0] += 1
            if seen[0] == args.profile_decode_step:
                acts = [torch.profiler.ProfilerActivity.CPU]
                if args.device == "cuda":
                    acts.append(torch.profiler.ProfilerActivity.CUDA)
                prof["p"] = torch.profiler.profile(activities=acts)
                prof["p"].__enter__()
            out = inner(*a, **k)
            if seen[0] == args.profile_decode_step + 2:
                prof["p"].__exit__(None, None, None)
                key = "cuda_time_total" if args.device == "cuda" else "cpu_time_total"
                print(prof["p"].key_averages().table(sort_by=key, row_limit=18), file=sys.stderr)
                print(prof["p"].key_averages().table(sort_by="cpu_time_total", row_limit=12),
                      file=sys.stderr)
            return out
        sched._run_decode = profiled
    rng = random.Random(0)
    vocab = eng.runner.model_config.vocab_size
    if args.workload == "shared_prefix":
        prompts, outs = shared_prefix_workload(rng, vocab, groups=args.groups)
    else:
        prompts, outs = [rand_ids(rng, 512, vocab) for _ in range(128)], [128] * 128
    t0 = time.perf_counter()
    eng.generate(input_ids=prompts, sampling_params=[
        {"max_new_tokens": n, "temperature": 0, "ignore_eos": True} for n in outs])
    total = time.perf_counter() - t0
    print(json.dumps({"workload": args.workload, "total_s": round(total, 2),
                      "shared_prefix_steps": sched.stats["shared_prefix_steps"],
                      "kinds": {k: {**v, "s": round(v["s"], 3)} for k, v in stats.items()}}))
    eng.shutdown()


if __name__ == "__main__":
    main()
