"""Micro-benchmark: CPU attention per layer, torch_native vs the C++ kernels (`cpu` backend).

SmolLM2-135M shapes (9 query heads, 3 KV heads, head_dim 64), bf16 KV pool. Each case runs the
backend exactly as the model does: `init_forward_metadata` once per step, then `forward` (KV write
+ attention) for each of `--layers` pool layers; time per layer = step time / layers. The two
backends alternate within one run and the ratio compares medians from that run (the CPU is
shared: absolute times are noisy, same-run ratios much less so).

Cases: decode at batch 1 / 16 / 64 with 1000 tokens of context; extend of 64 requests x 20 new
tokens over one shared (cached) 1000-token prefix; decode of those 64 requests (1000 shared + 20
own tokens), plain and with the shared prefix read once for the group ("cpu_grouped", what the
scheduler plans on such a batch; torch_native has no grouped path); one 1000-token prefill.

`--engine`: also the end-to-end figure, the peer comparison's `short` workload (32 x (200 random
ids in, 64 out), greedy, `ignore_eos`, SmolLM2, bf16 unless `--engine-dtype`), in this one
process with attention_backend "torch_native" and "cpu" side by side, taking turns on the same
prompts, fresh prompts each round (see run_engine).
Prints one JSON line per part; `--result-file` appends them
(benchmarks/results/cpu_attention-cpu.jsonl).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import shlex
import statistics
import subprocess
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import torch  # noqa: E402

from radixlm.runtime.attention.cpu_backend import CpuAttention  # noqa: E402
from radixlm.runtime.attention.torch_native import TorchNativeAttention  # noqa: E402
from radixlm.runtime.executor.forward_batch import ForwardBatch, ForwardMode  # noqa: E402
from radixlm.runtime.mem_cache.kv_pool import KVPool  # noqa: E402

HQ, HKV, D = 9, 3, 64


def make_batch(mode, prefix_lens, ext_lens, rows, capacity_used, req_to_token, shared_prefix,
               shared_len=None):
    """A ForwardBatch whose requests' histories already sit in the pool (slots assigned in order).
    shared_prefix: every request's first `shared_len` (default: its whole prefix) slots are the
    same slots (a radix-cache prefix)."""
    next_slot = 1 + capacity_used
    out_loc = []
    shared = None
    for r, (p, e) in enumerate(zip(prefix_lens, ext_lens)):
        sh = min(p, p if shared_len is None else shared_len) if shared_prefix else 0
        if sh:
            if shared is None:
                shared = torch.arange(next_slot, next_slot + sh)
                next_slot += sh
            req_to_token[rows[r], :sh] = shared[:sh]
        req_to_token[rows[r], sh:p] = torch.arange(next_slot, next_slot + p - sh)
        next_slot += p - sh
        new = torch.arange(next_slot, next_slot + e)
        next_slot += e
        req_to_token[rows[r], p:p + e] = new
        out_loc.append(new)
    seq_lens = [p + e for p, e in zip(prefix_lens, ext_lens)]
    t = sum(ext_lens)
    fb = ForwardBatch(
        mode=mode, input_ids=torch.zeros(t, dtype=torch.int64),
        positions=torch.cat([torch.arange(p, p + e) for p, e in zip(prefix_lens, ext_lens)]),
        out_cache_loc=torch.cat(out_loc), req_pool_indices=torch.tensor(rows),
        seq_lens=torch.tensor(seq_lens), logits_indices=torch.zeros(len(rows), dtype=torch.int64),
        seq_lens_cpu=seq_lens,
        extend_prefix_lens_cpu=list(prefix_lens) if mode == ForwardMode.EXTEND else [],
        extend_lens_cpu=list(ext_lens) if mode == ForwardMode.EXTEND else [])
    return fb, next_slot


def one_group(fb, shared_len):
    """PrefixGroups putting every row of a decode batch in one group sharing `shared_len` slots
    (what the scheduler's PrefixGrouper plans for such a batch)."""
    from radixlm.runtime.attention.shared_prefix import PrefixGroups

    b = fb.batch_size
    return PrefixGroups(
        rows=torch.arange(b), qo_indptr=torch.tensor([0, b]),
        rep_pool_indices=fb.req_pool_indices[:1].clone(), shared_lens=torch.tensor([shared_len]),
        zeros=torch.zeros(1, dtype=torch.int64), kv_start=torch.full((b,), shared_len),
        max_group=b, shared_lens_cpu=[shared_len], group_sizes_cpu=[b],
        saved_tokens=(b - 1) * shared_len)


def run_case(backends, fb, layers, reps, dtype, groups=None):
    """Median ms per layer of each backend; `groups`: PrefixGroups for an extra "cpu_grouped"
    run of the cpu backend (shared-prefix decode)."""
    t = fb.num_tokens
    q = torch.randn(t, HQ, D).to(dtype)
    kv = torch.randn(t, 2, HKV, D).to(dtype)
    k, v = kv[:, 0], kv[:, 1]
    runs = {name: (be, None) for name, be in backends.items()}
    if groups is not None:
        runs["cpu_grouped"] = (backends["cpu"], groups)
    times = {name: [] for name in runs}

    def step(be, grp):
        fb.attn_metadata = None
        fb.prefix_groups = grp
        be.init_forward_metadata(fb)
        for layer in range(layers):
            be.forward(q, k, v, layer, fb)

    for be, grp in runs.values():  # warm-up
        step(be, grp)
    for _ in range(reps):
        for name, (be, grp) in runs.items():
            t0 = time.perf_counter()
            step(be, grp)
            times[name].append((time.perf_counter() - t0) / layers * 1e3)
    fb.prefix_groups = None
    med = {name: statistics.median(v) for name, v in times.items()}
    res = {f"{name}_ms": round(m, 4) for name, m in med.items()}
    res["speedup"] = round(med["torch_native"] / med["cpu"], 2)
    if groups is not None:
        res["speedup_grouped"] = round(med["torch_native"] / med["cpu_grouped"], 2)
    return res


def run_engine(args) -> dict:
    """The peers' `short` workload through `radixlm.Engine`, attention_backend torch_native vs
    cpu, one process.

    Both engines live side by side (they share the model's weights) and run the same workloads in
    turn, the order flipping every round (AB BA AB ...), so that a load change on a shared machine
    hits both. Round 1 is each engine's first batch (first-shape costs included); each later
    round has fresh prompts. Wall time and the process's CPU time are both reported: on a busy
    machine CPU seconds are the steadier measure of the work each backend does."""
    import radixlm
    from benchmarks.peers import workloads as wl

    sz = wl.sizes("full", short_num=args.engine_num, short_input_len=args.engine_input_len,
                  short_output_len=args.engine_output_len)
    out = {"workload": f"{sz.short_num} x ({sz.short_input_len} in, {sz.short_output_len} out), "
                       "random ids, greedy, ignore_eos", "dtype": args.engine_dtype,
           "weights": "dummy (random)" if args.engine_load_format else "SmolLM2-135M GGUF",
           "runs": []}
    backends = ("torch_native", "cpu")
    engines = {}
    try:
        for backend in backends:
            t0 = time.perf_counter()
            kw = {"dtype": args.engine_dtype, "device": "cpu"}
            if args.engine_model_path:
                kw["model_path"] = args.engine_model_path
            if args.engine_load_format == "dummy":  # random weights: token ids only
                kw.update(load_format="dummy", skip_tokenizer_init=True)
            engines[backend] = eng = radixlm.Engine(attention_backend=backend, **kw)
            assert eng.runner.attention_backend_name == backend, eng.runner.attention_backend_name
            out[f"engine_start_s_{backend}"] = round(time.perf_counter() - t0, 2)
        tok = engines["cpu"].tokenizer
        same = []
        for rnd in range(1, args.engine_rounds + 1):
            if tok is not None:
                w = wl.offline_workload("short", rnd, tok, sz)
            else:  # the same shape of workload from random ids (no tokenizer with dummy weights)
                rng = random.Random(wl.round_seed(0, rnd, "short"))
                vocab = engines["cpu"].runner.model_config.vocab_size
                w = wl.OfflineWorkload("short", rnd, 0, [
                    [rng.randrange(3, vocab) for _ in range(sz.short_input_len)]
                    for _ in range(sz.short_num)], [sz.short_output_len] * sz.short_num)
            params = [{"max_new_tokens": n, "temperature": 0, "ignore_eos": True}
                      for n in w.output_lens]
            ids = {}
            for backend in (backends if rnd % 2 else backends[::-1]):
                t0, c0 = time.perf_counter(), time.process_time()
                res = engines[backend].generate(input_ids=w.prompt_ids, sampling_params=params)
                wall, cpu = time.perf_counter() - t0, time.process_time() - c0
                ids[backend] = [o["output_ids"] for o in res]
                n_out = sum(map(len, ids[backend]))
                run = {"backend": backend, "round": rnd, "wall_s": round(wall, 3),
                       "cpu_s": round(cpu, 3), "output_tokens": n_out,
                       "out_tok_s": round(n_out / wall, 1), "load_avg_1m": os.getloadavg()[0]}
                print(json.dumps(run), file=sys.stderr, flush=True)
                out["runs"].append(run)
            same += [a == b for a, b in zip(ids["torch_native"], ids["cpu"])]
    finally:
        for eng in engines.values():
            eng.shutdown()

    def ratio(key, rounds):
        per = [next(r[key] for r in out["runs"] if r["backend"] == "torch_native" and r["round"] == n)
               / next(r[key] for r in out["runs"] if r["backend"] == "cpu" and r["round"] == n)
               for n in rounds]
        return round(statistics.median(per), 2) if per else None

    later = range(2, args.engine_rounds + 1)
    out["speedup_cpu_vs_torch_native"] = {
        "round1_wall": ratio("wall_s", [1]), "round1_cpu_time": ratio("cpu_s", [1]),
        "later_rounds_median_wall": ratio("wall_s", later),
        "later_rounds_median_cpu_time": ratio("cpu_s", later)}
    # in bf16 the backends round differently (fp32 accumulation vs SDPA's), so greedy may part
    out["identical_outputs"] = f"{sum(same)}/{len(same)}"
    return out


def git_commit() -> str:
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=_ROOT, text=True,
                             capture_output=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=_ROOT,
                               text=True, capture_output=True, timeout=10).stdout.strip()
        return (sha or "unknown") + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--context", type=int, default=1000)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--layers", type=int, default=4, help="pool layers cycled per step")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    p.add_argument("--result-file", default=None)
    p.add_argument("--skip-micro", action="store_true", help="only the --engine comparison")
    p.add_argument("--engine", action="store_true", help="also workload (b) through the Engine")
    p.add_argument("--engine-rounds", type=int, default=4, help="rounds of fresh prompts")
    p.add_argument("--engine-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--engine-model-path", default=None, help="default: the bundled SmolLM2")
    p.add_argument("--engine-load-format", default=None, choices=["dummy"],
                   help="dummy: random weights from --engine-model-path's config.json")
    p.add_argument("--engine-num", type=int, default=32)
    p.add_argument("--engine-input-len", type=int, default=200)
    p.add_argument("--engine-output-len", type=int, default=64)
    args = p.parse_args(argv)
    command = "python " + " ".join(map(shlex.quote, [os.path.relpath(__file__, _ROOT),
                                                     *(sys.argv[1:] if argv is None else argv)]))
    lines = []
    if not args.skip_micro:
        lines.append(run_micro(args))
    if args.engine:
        lines.append({"benchmark": "cpu_attention_engine", **run_engine(args)})
    for doc in lines:
        doc.update(meta(command))
        line = json.dumps(doc)
        print(line)
        if args.result_file:
            with open(args.result_file, "a") as f:
                f.write(line + "\n")


def meta(command: str) -> dict:
    from radixlm.runtime.attention import cpu_kernels
    try:
        isa = cpu_kernels.load().isa()
    except cpu_kernels.CpuKernelsUnavailable as e:
        isa = f"unavailable: {e}"
    model = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            model = next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"threads": torch.get_num_threads(), "isa": isa,
            "machine": f"{model}, {os.cpu_count()} cores, {platform.machine()}",
            "load_avg_1m_end": os.getloadavg()[0], "torch": torch.__version__,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "git_commit": git_commit(), "command": command}


def run_micro(args) -> dict:
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)

    ctx, max_b = args.context, max(64, *args.batch_sizes)
    capacity = max_b * (ctx + 20) + ctx + 64
    pool = KVPool(capacity, args.layers, HKV, D, dtype, "cpu")
    for buf in pool.k_buffers + pool.v_buffers:  # the histories' K/V (contents do not matter)
        buf.copy_(torch.randn(buf.shape).to(dtype))
    r2t = torch.zeros(max_b + 1, ctx + 64, dtype=torch.int64)
    kw = dict(max_batch_size=max_b + 1, max_context_len=ctx + 64)
    backends = {"torch_native": TorchNativeAttention(pool, r2t, D ** -0.5, **kw),
                "cpu": CpuAttention(pool, r2t, D ** -0.5, **kw)}

    results = {}
    for b in args.batch_sizes:
        fb, _ = make_batch(ForwardMode.DECODE, [ctx - 1] * b, [1] * b, list(range(b)), 0, r2t,
                           shared_prefix=False)
        results[f"decode_b{b}"] = run_case(backends, fb, args.layers, args.reps, dtype)
    fb, _ = make_batch(ForwardMode.EXTEND, [ctx] * 64, [20] * 64, list(range(64)), 0, r2t,
                       shared_prefix=True)
    results["extend_64x20_prefix"] = run_case(backends, fb, args.layers, args.reps, dtype)
    # workload (a)'s decode steps: 64 requests on one cached 1000-token prefix + 20 own tokens
    fb, _ = make_batch(ForwardMode.DECODE, [ctx + 19] * 64, [1] * 64, list(range(64)), 0, r2t,
                       shared_prefix=True, shared_len=ctx)
    results["decode_b64_shared_prefix"] = run_case(backends, fb, args.layers, args.reps, dtype,
                                                   groups=one_group(fb, ctx))
    fb, _ = make_batch(ForwardMode.EXTEND, [0], [ctx], [0], 0, r2t, shared_prefix=False)
    results[f"prefill_{ctx}"] = run_case(backends, fb, args.layers, args.reps, dtype)

    return {"benchmark": "cpu_attention", "shape": {"hq": HQ, "hkv": HKV, "head_dim": D},
            "dtype": args.dtype, "context": ctx, "unit": "ms per layer (KV write + attention)",
            "results": results}


if __name__ == "__main__":
    with torch.inference_mode():
        main()
