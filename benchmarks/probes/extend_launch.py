"""What an eager extend forward costs the host, against what it computes (GPU).

    python benchmarks/probes/extend_launch.py --model-path benchmarks/configs/llama-3.1-8b \
        --load-format dummy --dtype bfloat16 --tokenizer-path TOKENIZER [--tokens 64,512,2048]

For each prompt length: one request at a time (max_new_tokens=1: its step is one extend), the
forward's host seconds (the call) and GPU seconds (CUDA events around it), best of `--repeat`;
then a torch.profiler pass over one extend of each length, the host ops with the most self time
(launches, cuBLAS, the caching allocator). The multi-turn run's extends took ~37 ms of the
scheduler's time to launch on an H200 host, about what a small one computes (docs/hicache.md):
this says where those milliseconds go. Prints one JSON line.
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


def _timed_forwards(sched, marks: list) -> None:
    real = sched._forward_or_oom

    def timed(fb, reqs):
        cuda = torch.cuda.is_available()
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)] if cuda else None
        if cuda:
            ev[0].record()
        t0 = time.perf_counter()
        try:
            return real(fb, reqs)
        finally:
            host = time.perf_counter() - t0
            if cuda:
                ev[1].record()
            marks.append((fb.num_tokens, host, ev))

    sched._forward_or_oom = timed


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model-path", required=True)
    p.add_argument("--load-format", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--tokenizer-path", default=None)
    p.add_argument("--tokens", default="16,64,256,1024,4096")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--disable-piecewise-cuda-graph", action="store_true",
                   help="extends launched op by op (the default replays piecewise graphs)")
    args = p.parse_args()
    import radixlm

    eng = radixlm.Engine(model_path=args.model_path, load_format=args.load_format,
                         dtype=args.dtype, tokenizer_path=args.tokenizer_path,
                         disable_radix_cache=True,
                         disable_piecewise_cuda_graph=args.disable_piecewise_cuda_graph)
    rng = random.Random(0)
    vocab = eng.scheduler.vocab_size
    out: dict = {"probe": "extend_launch", "device": (torch.cuda.get_device_name()
                                                      if torch.cuda.is_available() else "cpu"),
                 "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
                 "piecewise": eng.runner.piecewise is not None,
                 "piecewise_capture_s": getattr(eng.runner.piecewise, "capture_s", None),
                 "lengths": {}}
    try:
        marks: list = []
        eng._call_in_loop(lambda: _timed_forwards(eng.scheduler, marks))
        lengths = [int(x) for x in args.tokens.split(",")]
        for n in lengths:
            ids = [rng.randrange(100, vocab) for _ in range(n)]
            eng.generate(input_ids=ids, sampling_params={"max_new_tokens": 1})  # warm-up
            marks.clear()
            for _ in range(args.repeat):
                eng.generate(input_ids=ids, sampling_params={"max_new_tokens": 1})
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            host = min(m[1] for m in marks)
            gpu = (min(m[2][0].elapsed_time(m[2][1]) for m in marks) / 1e3
                   if marks and marks[0][2] else None)
            out["lengths"][n] = {"host_s": round(host, 5),
                                 "gpu_s": None if gpu is None else round(gpu, 5)}
        kinds = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            kinds.append(torch.profiler.ProfilerActivity.CUDA)
        prof = torch.profiler.profile(activities=kinds)
        eng._call_in_loop(prof.start)  # (on the scheduler's thread: its ops are recorded)
        for n in lengths:
            ids = [rng.randrange(100, vocab) for _ in range(n)]
            eng.generate(input_ids=ids, sampling_params={"max_new_tokens": 1})
        eng._call_in_loop(prof.stop)
        rows = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:args.top]
        out["host_ops"] = [{"name": e.key[:80], "calls": e.count,
                            "self_cpu_ms": round(e.self_cpu_time_total / 1e3, 2)} for e in rows]
    finally:
        eng.shutdown()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
