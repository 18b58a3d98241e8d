"""The measurements of the GPU benchmark suite (benchmarks/gpu_suite.py, which runs them as guarded
parts and assembles the JSON line): device copy bandwidth, timed greedy generation of token ids,
the shared-prefix workload, the torch.profiler decode tables, and HF transformers' baselines."""

from __future__ import annotations

import contextlib
import json
import os
import random
import time

import torch


def copy_bandwidth_tbps(nbytes: int = 4 << 30, iters: int = 20) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        dst.copy_(src)
    torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / iters
    del src, dst
    return 2 * nbytes / dt / 1e12


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def rand_ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(n)]


def timed_generate(engine, prompts: list[list[int]], out_lens: list[int]) -> tuple[float, int]:
    params = [{"max_new_tokens": n, "temperature": 0, "ignore_eos": True} for n in out_lens]
    sync()
    t0 = time.perf_counter()
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    dt = time.perf_counter() - t0
    return dt, sum(len(o["output_ids"]) for o in outs)


@contextlib.contextmanager
def host_waits():
    """[steps, seconds] rank 0's scheduler spent waiting for each overlapped step's samples
    (InFlightDecode.wait): near 0 a step, the host launches slower than the GPU runs (the GPU
    idles between steps); near the step's time less the host's own work, the GPU is the bound."""
    from radixlm.runtime.scheduler import overlap

    real, waits = overlap.InFlightDecode.wait, [0, 0.0]

    def wait(self):
        t0 = time.perf_counter()
        try:
            return real(self)
        finally:
            waits[0] += 1
            waits[1] += time.perf_counter() - t0

    overlap.InFlightDecode.wait = wait
    try:
        yield waits
    finally:
        overlap.InFlightDecode.wait = real


def shared_prefix_workload(rng: random.Random, vocab: int, groups=32, per_group=16, shared=2048,
                           own=64, out=64):
    prompts = []
    for _ in range(groups):
        prefix = rand_ids(rng, shared, vocab)
        prompts += [prefix + rand_ids(rng, own, vocab) for _ in range(per_group)]
    rng.shuffle(prompts)  # groups arrive interleaved, as in SGLang's generated-shared-prefix bench
    return prompts, [out] * len(prompts)


def profile_decode(eng, rng, vocab: int, out_dir: str, res: dict,
                   batch_sizes=(1, 64)) -> None:
    """Profile a batch-1 and a batch-64 generation (256 in, 64 out: mostly decode steps); write
    the top kernels / ops tables and put the GPU-busy vs wall time per decode step in res."""
    from torch.profiler import ProfilerActivity, profile

    os.makedirs(out_dir, exist_ok=True)
    cuda = torch.cuda.is_available()
    for bs in batch_sizes:
        prompts = [rand_ids(rng, 256, vocab) for _ in range(bs)]
        timed_generate(eng, prompts, [2] * bs)  # same prefill shapes once, outside the profile
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=acts) as prof:
            wall, n = timed_generate(eng, prompts, [64] * bs)
        avg = prof.key_averages()
        key = "self_device_time_total" if cuda else "self_cpu_time_total"
        # kernels only (device-side events), us -> ms
        kern = [e for e in avg if cuda and getattr(e, "device_type", None) is not None
                and str(e.device_type).endswith("CUDA") and e.self_device_time_total > 0]
        busy_ms = sum(e.self_device_time_total for e in kern) / 1e3
        steps = n / bs
        top = sorted(kern, key=lambda e: -e.self_device_time_total)[:8]
        summary = {"wall_ms_per_step": round(wall * 1e3 / steps, 3),
                   "gpu_busy_ms_per_step": round(busy_ms / steps, 3),
                   "top_kernels_ms_per_step": {e.key[:80]: round(e.self_device_time_total / 1e3
                                                                 / steps, 3) for e in top}}
        res[f"profile_bs{bs}"] = summary
        with open(os.path.join(out_dir, f"profile_bs{bs}.txt"), "w") as f:
            f.write(json.dumps(summary, indent=1) + "\n\n")
            f.write(avg.table(sort_by=key, row_limit=45, max_name_column_width=90))
            f.write("\n\n")
            f.write(avg.table(sort_by="self_cpu_time_total", row_limit=30,
                              max_name_column_width=90))


def hf_model(args, h: dict):
    if "model" not in h:
        from transformers import AutoConfig, AutoModelForCausalLM

        cfg = AutoConfig.from_pretrained(args.model_path)
        with torch.device("cuda"):
            h["model"] = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    return h["model"]


def hf_batch128(args, res: dict, vocab: int, h: dict) -> None:
    model = hf_model(args, h)
    rng = random.Random(args.seed + 1)
    ids = torch.tensor([rand_ids(rng, 512, vocab) for _ in range(128)], device="cuda")
    with torch.inference_mode():
        model.generate(ids[:2, :16], attention_mask=torch.ones_like(ids[:2, :16]),
                       max_new_tokens=4, do_sample=False, pad_token_id=0)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=128,
                             min_new_tokens=128, do_sample=False, pad_token_id=0)
        torch.cuda.synchronize()
    res["hf_batch128_out_tok_s"] = round((out.shape[1] - 512) * 128 / (time.perf_counter() - t0), 1)


def hf_bs1(args, res: dict, vocab: int, h: dict) -> None:
    model = hf_model(args, h)
    rng = random.Random(args.seed + 2)
    ids = torch.tensor([rand_ids(rng, 128, vocab)], device="cuda")
    # HF's own path: with a static cache `generate` compiles the decode step itself
    # (GenerationConfig.compile_config: torch.compile, mode "reduce-overhead" = CUDA graphs). A
    # hand-wrapped `torch.compile(model.forward, mode="reduce-overhead")` fails in transformers
    # 5.17 ("accessing tensor output of CUDAGraphs that has been overwritten"; first H100 run).
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=256, min_new_tokens=256,
              do_sample=False, pad_token_id=0, cache_implementation="static")
    with torch.inference_mode():
        for _ in range(2):  # compile and CUDA-graph warm-up
            model.generate(ids, **kw)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = model.generate(ids, **kw)
        torch.cuda.synchronize()
    res["hf_static_compile_bs1_tok_s"] = round((out.shape[1] - 128) / (time.perf_counter() - t0), 1)
