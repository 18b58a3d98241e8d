"""Where an offline batch's wall time goes on one GPU: 128 x (512 in, 128 out), tp_gpu.py's
batch128, Llama-3.1-8B shape with dummy weights (or --model-path, e.g. one TP=2 rank's share
from probes/tp_rank_proxy.sh).

One Engine; the workload once to warm up, once plain (output tok/s), once instrumented: CUDA
events around every forward (GPU time of each step kind, the compute stream's time between
forwards by the kinds on either side: idle, or sampling and copies), the scheduler's host
seconds by step path (multiturn_profile's wrappers), and with --cprofile the scheduler thread's
top functions. One JSON line on stdout.

    python benchmarks/probes/batch_timeline.py [--model-path DIR] [--cprofile]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import torch  # noqa: E402

from benchmarks.gpu_suite_parts import rand_ids, timed_generate  # noqa: E402
from benchmarks.probes.multiturn_profile import (_count_steps, _time_forwards,  # noqa: E402
                                                 _top_functions, gaps_by_kind)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-path", default=os.path.join(_ROOT, "benchmarks/configs/llama-3.1-8b"))
    p.add_argument("--tokenizer-path", default=".carry/smollm2-tokenizer")
    p.add_argument("--requests", type=int, default=128)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--cprofile", action="store_true")
    args = p.parse_args()
    import radixlm
    from benchmarks.offline_throughput import git_commit

    eng = radixlm.Engine(model_path=args.model_path, load_format="dummy", dtype="bfloat16",
                         tokenizer_path=args.tokenizer_path, context_length=4096)
    out: dict = {"probe": "batch_timeline", "commit": git_commit(),
                 "device": torch.cuda.get_device_name(), "model": args.model_path,
                 "workload": [args.requests, args.input_len, args.output_len]}
    try:
        vocab = eng.runner.model_config.vocab_size
        rng = random.Random(1)

        def batch():
            prompts = [rand_ids(rng, args.input_len, vocab) for _ in range(args.requests)]
            eng.flush_cache()
            return timed_generate(eng, prompts, [args.output_len] * args.requests)

        batch()  # warm-up
        dt, n = batch()
        out["plain_out_tok_s"] = round(n / dt, 1)
        stats = eng._call_in_loop(lambda: _count_steps(eng.scheduler))
        marks = eng._call_in_loop(lambda: _time_forwards(eng.scheduler))
        cprof = None
        if args.cprofile:  # (a profiler is per thread: enabled on the scheduler's)
            import cProfile
            cprof = cProfile.Profile()
            eng._call_in_loop(cprof.enable)
        t0 = time.perf_counter()
        dt, n = batch()
        out["instrumented_s"] = round(time.perf_counter() - t0, 3)
        out["instrumented_out_tok_s"] = round(n / dt, 1)
        if cprof is not None:
            eng._call_in_loop(cprof.disable)
            out["cprofile"] = _top_functions(cprof, 30)
        out["forwards"] = gaps_by_kind(marks)
        out["steps"] = {k: {"calls": v[0], "host_s": round(v[1], 3)} for k, v in stats.items()}
        eng.check_integrity()
    finally:
        eng.shutdown()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
