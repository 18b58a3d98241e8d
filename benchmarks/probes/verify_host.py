"""Host cost of a speculative verify step against a plain decode step, at batch 1.

    # GPU, the 8B shape on dummy weights (CUDA graphs, overlap on for the plain steps):
    python benchmarks/probes/verify_host.py --model-path benchmarks/configs/llama-3.1-8b \
        --load-format dummy --tokenizer-path DIR --verify-tokens 5,9
    # CPU, the bundled SmolLM2 (--as-decode: the verify as a decode batch, a GPU's path):
    python benchmarks/probes/verify_host.py --device cpu --verify-tokens 5 [--as-decode]

One engine (NGRAM, adaptive off). Drafts are random token ids (benchmarks/speculative.py's
stand-in, never accepted), so every verify of N tokens appends one token, like a plain step.
Per arm (off: the plain decode; on N: a fixed verify of N tokens) one request decodes
--steps tokens --runs times (the best run counts), then once under cProfile and once under a
TorchDispatchMode counting torch ops, both in the scheduler thread. One JSON line per arm:
  tok_s            tokens / wall time of the best run (no profiler); tok_s_ratio_off_on: off's
                   over this arm's (a verify step's cost in plain steps)
  profile_s        the scheduler thread's profiled time per step, the forward left out
  sync_wait_s      per step, time inside the device waits (`.tolist()`, `.item()`,
                   Event/stream synchronize): the GPU's share, not host work
  forward_s        per step, wall time inside ModelRunner.forward (not profiled; on the CPU the
                   model's compute, on a GPU the host's launch or graph replay)
  host_s           per step: profile - sync wait, + forward on a GPU (the Python and op-launch
                   time, which a verify cannot overlap with the GPU)
  gpu_s            (CUDA) per step, the device's busy time (kernels and copies, torch.profiler
                   in a fourth run); gpu_s_ratio_on_off: this arm's over off's
  ops / ops_outside_forward   torch ops dispatched per step (all / outside the forward)
  top              the largest self times (--top of them), seconds per step
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import json
import os
import pstats
import sys
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if _ROOT not in sys.path:  # run as a script: the repository's packages
    sys.path.insert(0, _ROOT)

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from benchmarks.offline_throughput import default_model_path  # noqa: E402
from benchmarks.speculative import _random_drafts  # noqa: E402

# functions whose time is the device's, not the host's (their cumulative time)
_WAITS = ("tolist", "item", "synchronize", "cpu")


class _OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.total = self.outside = 0
        self.inside = False
        self.names = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.total += 1
        if not self.inside:
            self.outside += 1
            self.names[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


def _arm(eng, make_spec, prompt, steps: int, runs: int, top: int, dump=None) -> dict:
    sched = eng.scheduler
    params = {"temperature": 0, "max_new_tokens": steps, "ignore_eos": True}

    def run():
        eng._call_in_loop(sched.flush_cache)
        eng._call_in_loop(lambda: setattr(sched, "spec", make_spec()))
        t0 = time.perf_counter()
        out = eng.generate(input_ids=[prompt], sampling_params=[params])[0]
        return out["meta_info"]["completion_tokens"] / (time.perf_counter() - t0), out

    best = max(run()[0] for _ in range(runs))
    prof, ops = cProfile.Profile(), _OpCounter()
    runner = sched.runner
    plain_forward = runner.forward

    fwd_s = [0.0]
    profiling = [True]

    def forward(*a, **k):  # outside the profile (torch.compile'd frames confuse it), timed here
        if profiling[0]:
            prof.disable()
        ops.inside = True
        t0 = time.perf_counter()
        try:
            return plain_forward(*a, **k)
        finally:
            fwd_s[0] += time.perf_counter() - t0
            ops.inside = False
            if profiling[0]:
                prof.enable()

    def measured(start, stop):  # one run with start() / stop() called in the scheduler thread
        eng._call_in_loop(sched.flush_cache)
        eng._call_in_loop(lambda: setattr(sched, "spec", make_spec()))
        eng._call_in_loop(start)
        try:
            return eng.generate(input_ids=[prompt], sampling_params=[params])[0]
        finally:
            eng._call_in_loop(stop)

    runner.forward = forward
    try:  # the profile and the op count in separate runs (the counter's own cost is large)
        out = measured(prof.enable, prof.disable)
        profiling[0] = False
        measured(ops.__enter__, lambda: ops.__exit__(None, None, None))
    finally:
        runner.forward = plain_forward
    n = out["meta_info"]["completion_tokens"]
    gpu_s = None
    if runner.device.type == "cuda":  # a fourth run: the device's own time (kernels, copies)
        import torch

        kp = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
        measured(kp.__enter__, lambda: kp.__exit__(None, None, None))
        dev = [e for e in kp.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        gpu_s = sum(e.time_range.end - e.time_range.start for e in dev) / 1e6 / n
    st = pstats.Stats(prof)
    if dump:
        st.dump_stats(dump)
    total = st.total_tt
    wait = sum(ct for (_, _, name), (_, _, _, ct, _) in st.stats.items()
               if any(f"method '{w}'" in name for w in _WAITS))
    fwd = fwd_s[0] / 2  # both runs
    host = total - wait + (fwd if runner.device.type == "cuda" else 0.0)
    tops = sorted(st.stats.items(), key=lambda kv: -kv[1][2])[:top]
    return {"tok_s": round(best, 2), "steps": n, "profile_s": total / n,
            "sync_wait_s": wait / n, "forward_s": fwd / n, "host_s": host / n,
            "gpu_s": gpu_s,
            "ops": ops.total / n, "ops_outside_forward": ops.outside / n,
            "op_names": {k: round(v / n, 2) for k, v in ops.names.most_common(25)},
            "top": [[f"{os.path.basename(f)}:{ln} {name}", round(tt / n, 6)]
                    for (f, ln, name), (_, _, tt, _, _) in tops]}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-path", default=None, help="default: the bundled SmolLM2")
    ap.add_argument("--tokenizer-path", default=None)
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--verify-tokens", default="5", help="comma list: tokens per verify (k + 1)")
    ap.add_argument("--steps", type=int, default=128, help="tokens per run")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--as-decode", action="store_true",
                    help="CPU: run the verify as a decode batch, the path a GPU's graphs take")
    ap.add_argument("--dump", default=None, help="a folder: each arm's pstats file (ARM.prof)")
    args = ap.parse_args(argv)
    import dataclasses

    import radixlm
    from radixlm.runtime import speculative
    from radixlm.runtime.speculative import ngram_drafter

    kw = dict(model_path=args.model_path or default_model_path(), dtype=args.dtype,
              max_running_requests=1, speculative_algorithm="NGRAM", speculative_adaptive=False)
    for name in ("load_format", "tokenizer_path", "device"):
        if getattr(args, name) not in (None, "auto"):
            kw[name] = getattr(args, name)
    eng = radixlm.Engine(**kw)
    if args.as_decode:  # (what tests/unit/test_speculative.py does for the same path)
        eng.runner.replays_decode_graph = lambda rows: True
    try:
        ngram_drafter.propose = _random_drafts(eng.scheduler.vocab_size, 1)
        prompt = list(range(100, 164))
        arms = [("off", lambda: None)]
        for n in [int(x) for x in args.verify_tokens.split(",")]:
            a = dataclasses.replace(eng.server_args, speculative_num_draft_tokens=n,
                                    speculative_adaptive=False)
            arms.append((f"on{n}", lambda a=a: speculative.create(a, eng.scheduler)))
        for _, make in arms:  # warm-up: graphs, allocator, first-call costs
            _arm(eng, make, prompt, 16, 1, 1)
        off = None
        for name, make in arms:
            dump = os.path.join(args.dump, f"{name}.prof") if args.dump else None
            if dump:
                os.makedirs(args.dump, exist_ok=True)
            res = _arm(eng, make, prompt, args.steps, args.runs, args.top, dump)
            res = {"arm": name, "device": eng.runner.device.type, **res}
            if off is None:
                off = res
            else:
                res["tok_s_ratio_off_on"] = round(off["tok_s"] / res["tok_s"], 3)
                if res["gpu_s"]:  # the verify's device time (its forward in CUDA graphs, the
                    # acceptance kernels) against a plain step's: what no host work changes
                    res["gpu_s_ratio_on_off"] = round(res["gpu_s"] / off["gpu_s"], 3)
            print(json.dumps(res), flush=True)
    finally:
        eng.shutdown()


if __name__ == "__main__":
    main()
