"""Why is a part of the GPU suite slow: attention, the batch-1 GEMVs or the shared-prefix steps?

GPU diagnostics (not a benchmark: prints, no result file).

    python benchmarks/probes/gpu_probe.py attn    # extend attention (Triton) vs torch SDPA
    python benchmarks/probes/gpu_probe.py gemv    # batch-1..8 linear layers vs copy bandwidth
    python benchmarks/probes/gpu_probe.py steps   # shared-prefix workload: profile chosen steps
    python benchmarks/probes/gpu_probe.py dattn   # decode attention configs at serving batches

`steps` runs the suite's shared-prefix workload (32 groups x 16 x (2048 shared + 64 own), 64 out)
with the overlap schedule off and profiles, with torch.profiler, the extend steps and decode steps
whose 1-based numbers are given (--extend-steps / --decode-steps): wall time, GPU-busy time (sum
of kernel times) and the top kernels and CPU ops of each.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

import torch
import torch.nn.functional as F

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)


def cuda_ms(fn, iters: int = 20) -> float:
    """Median-free mean of `iters` runs after 3 warm-ups, timed with CUDA events (ms)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


# ------------------------------------------------------------------------------------------ attn

def probe_attn(args) -> None:
    from radixlm.runtime.attention.triton_extend import extend_attention
    dev, dt, hq, hkv, d = "cuda", torch.bfloat16, 32, 8, 128
    # (name, sequences, new tokens each, cached prefix each, causal); the last is the grouped
    # decode's shared-prefix part: 32 groups x 16 member queries against a 2048-token prefix
    shapes = [("prefill 1x2048", 1, 2048, 0, True), ("chunk 2048 after 2048", 1, 2048, 2048, True),
              ("64 x 64 on 2048 prefix", 64, 64, 2048, True),
              ("cascade 32 x 16 on 2048", 32, 16, 2048, False)]
    configs = [None, (64, 64, 4, 2), (64, 32, 4, 3), (128, 128, 8, 2), (128, 128, 8, 3),
               (128, 64, 4, 3), (64, 128, 4, 2), (64, 64, 4, 4)]
    for name, s, n_new, prefix, causal in shapes:
        kv_total = n_new + prefix
        slots = s * kv_total + 1
        k_buf = torch.randn(slots, hkv, d, device=dev, dtype=dt)
        v_buf = torch.randn(slots, hkv, d, device=dev, dtype=dt)
        r2t = torch.arange(1, slots, device=dev, dtype=torch.int32).view(s, kv_total)
        q = torch.randn(s * n_new, hq, d, device=dev, dtype=dt)
        out = torch.empty_like(q)
        idx = torch.arange(s, device=dev, dtype=torch.int32)
        qo = torch.arange(0, s + 1, device=dev, dtype=torch.int32) * n_new
        kv_start = torch.zeros(s, device=dev, dtype=torch.int32)
        kv_len = torch.full((s,), kv_total, device=dev, dtype=torch.int32)
        # causal FLOPs: each new token sees prefix + its position (x2 for QK and PV, x2 mul-add)
        flops = 4 * hq * d * s * (sum(prefix + i + 1 for i in range(n_new)) if causal
                                  else n_new * kv_total)
        row = {"shape": name}
        for cfg in configs:
            try:
                ms = cuda_ms(lambda: extend_attention(q, k_buf, v_buf, r2t, idx, qo, kv_start,
                                                      kv_len, causal, d ** -0.5, out,
                                                      max_q_len=n_new, config=cfg))
                row[str(cfg)] = f"{ms:.3f} ms {flops / ms / 1e9:.0f} TF/s"
            except Exception as e:  # a config that does not compile (registers / shared memory)
                row[str(cfg)] = f"failed: {type(e).__name__}"
        # reference: SDPA (flash) on contiguous tensors of the same problem, per sequence batch
        qs = q.view(s, n_new, hq, d).transpose(1, 2)
        ks = k_buf[1:].view(s, kv_total, hkv, d).transpose(1, 2)
        vs = v_buf[1:].view(s, kv_total, hkv, d).transpose(1, 2)
        mask = None
        if prefix and causal:
            mask = torch.ones(n_new, kv_total, device=dev, dtype=torch.bool).tril(prefix)
        try:
            ms = cuda_ms(lambda: F.scaled_dot_product_attention(
                qs, ks, vs, attn_mask=mask, is_causal=causal and mask is None,
                enable_gqa=True))
            row["sdpa"] = f"{ms:.3f} ms {flops / ms / 1e9:.0f} TF/s"
        except Exception as e:
            row["sdpa"] = f"failed: {type(e).__name__}: {e}"[:120]
        print(json.dumps(row), flush=True)


# ------------------------------------------------------------------------------------------ gemv

def probe_gemv(args) -> None:
    dev, dt = "cuda", torch.bfloat16
    src = torch.empty(1 << 30, device=dev, dtype=torch.uint8)
    dst = torch.empty_like(src)
    copy_tbps = 2 * src.numel() / cuda_ms(lambda: dst.copy_(src)) / 1e9
    print(json.dumps({"copy_TBps": round(copy_tbps, 3)}), flush=True)
    shapes = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
              "down": (4096, 14336), "lm_head": (128256, 4096)}
    from radixlm.runtime.layers.triton_gemv import gemv
    configs = [None] + [(bn, bk, wp, st) for bn in (2, 4, 8) for bk in (256, 512, 1024)
                        for wp in (2, 4, 8) for st in (2, 3, 4) if bn * bk <= 8192]
    for name, (n, k) in shapes.items():
        # enough copies (>= 400 MB) that a weight is never still in the 50 MB L2 when reused,
        # as in a real forward (436 MB of weights per layer); timed per call over the cycle
        copies = max(1, (400 << 20) // (n * k * 2))
        ws = [torch.randn(n, k, device=dev, dtype=dt) for _ in range(copies)]
        w, it = ws[0], [0]
        x = torch.randn(1, k, device=dev, dtype=dt)

        def nxt():
            it[0] = (it[0] + 1) % len(ws)
            return ws[it[0]]
        ms = cuda_ms(lambda: F.linear(x, nxt()), iters=50)
        row = {"layer": name, "cublas_us": round(ms * 1e3, 1),
               "cublas_TBps": round(w.numel() * 2 / ms / 1e9, 3)}
        ref = F.linear(x, w).float()
        timings = {}
        for cfg in configs:
            try:
                err = float((gemv(x, w, config=cfg).float() - ref).abs().max())
                ms = cuda_ms(lambda: gemv(x, nxt(), config=cfg), iters=50)
                timings[str(cfg)] = (round(ms * 1e3, 1), round(err, 4))
            except Exception as e:
                timings[str(cfg)] = f"failed: {type(e).__name__}"
        ok = {c: t for c, t in timings.items() if isinstance(t, tuple)}
        best = min(ok, key=lambda c: ok[c][0])
        row.update(default=timings["None"], best=best, best_us=ok[best][0],
                   best_TBps=round(w.numel() * 2 / ok[best][0] / 1e6, 3), all=timings)
        print(json.dumps(row), flush=True)


def probe_decode_attn(args) -> None:
    """Decode attention at serving batch sizes: (B rows x L keys, Hq 32 / Hkv 8 / D 128, bf16,
    slots a random permutation of the pool) per stage-1 config and split count, against the
    K/V bytes read at copy bandwidth."""
    from radixlm.runtime.attention.triton_decode import decode_attention, scratch_numel
    dev, dt, hq, hkv, d = "cuda", torch.bfloat16, 32, 8, 128
    src = torch.empty(1 << 30, device=dev, dtype=torch.uint8)
    dst = torch.empty_like(src)
    copy_tbps = 2 * src.numel() / cuda_ms(lambda: dst.copy_(src)) / 1e9
    src = dst = None
    configs = [(64, 4, 2), (32, 4, 2), (128, 4, 2), (64, 2, 2), (64, 8, 2), (64, 4, 3),
               (64, 4, 1), (128, 8, 2), (32, 2, 3), (128, 8, 3)]
    for bsz, length in ((32, 600), (128, 600), (128, 2048), (256, 600)):
        slots = bsz * length + 1
        k_buf = torch.randn(slots, hkv, d, device=dev, dtype=dt)
        v_buf = torch.randn(slots, hkv, d, device=dev, dtype=dt)
        r2t = (torch.randperm(slots - 1, device=dev)[: bsz * length] + 1).view(bsz, length)
        idx = torch.arange(bsz, device=dev)
        lens = torch.full((bsz,), length, device=dev, dtype=torch.int64)
        q = torch.randn(bsz, hq, d, device=dev, dtype=dt)
        out = torch.empty_like(q)
        ideal_us = 2 * bsz * length * hkv * d * 2 / (copy_tbps * 1e6)
        row = {"B": bsz, "L": length, "ideal_us": round(ideal_us, 1)}
        ref = None
        for bn, wp, st in configs:
            for splits in (1, 2, 4):
                scratch = torch.empty(max(1, scratch_numel(bsz, hq, d, splits)), device=dev)

                def call():
                    return decode_attention(q, k_buf, v_buf, r2t, idx, None, lens, d ** -0.5, out,
                                            scratch=scratch, num_splits=splits, block_n=bn,
                                            num_warps=wp, num_stages=st)
                try:
                    o = call().float()
                    ref = o.clone() if ref is None else ref
                    err = float((o - ref).abs().max())
                    us = cuda_ms(call, iters=20) * 1e3
                    row[f"{bn},{wp},{st},s{splits}"] = (round(us, 1), round(err, 4))
                except Exception as e:  # noqa: BLE001 - a config that does not compile
                    row[f"{bn},{wp},{st},s{splits}"] = f"failed: {type(e).__name__}"
        ok = {c: v for c, v in row.items() if isinstance(v, tuple)}
        best = min(ok, key=lambda c: ok[c][0])
        row.update(default=row.get("64,4,2,s1"), best=best, best_us=ok[best][0])
        print(json.dumps(row), flush=True)


# ----------------------------------------------------------------------------------------- steps

def _profile_call(fn, label: str):
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    avg = prof.key_averages()
    kernels = [e for e in avg if e.self_device_time_total > 0]
    busy_ms = sum(e.self_device_time_total for e in kernels) / 1e3
    print(f"=== {label}: wall {wall * 1e3:.1f} ms (under the profiler), GPU busy {busy_ms:.1f} ms",
          file=sys.stderr)
    print(avg.table(sort_by="self_device_time_total", row_limit=16), file=sys.stderr)
    print(avg.table(sort_by="self_cpu_time_total", row_limit=14), file=sys.stderr)
    return out


def probe_steps(args) -> None:
    import radixlm
    kw = dict(model_path=args.model_path, load_format="dummy", dtype="bfloat16",
              tokenizer_path=args.tokenizer_path, context_length=4096, device="cuda",
              disable_overlap_schedule=True)
    kw.update(args.engine_kw)
    eng = radixlm.Engine(**kw)
    sched = eng.scheduler
    want_ext = {int(x) for x in args.extend_steps.split(",") if x}
    want_dec = {int(x) for x in args.decode_steps.split(",") if x}
    seen = {"extend": 0, "decode": 0}
    run_extend, run_decode = sched._run_extend, sched._run_decode

    def extend(reqs, mixed=False):
        seen["extend"] += 1
        if seen["extend"] not in want_ext:
            return run_extend(reqs, mixed)
        toks = sum(r.extend_len for r in reqs)
        label = (f"extend step {seen['extend']}: {len(reqs)} new reqs, {toks} new tokens, "
                 f"mixed={mixed} with {len(sched.running) if mixed else 0} decoding")
        return _profile_call(lambda: run_extend(reqs, mixed), label)

    def decode():
        seen["decode"] += 1
        if seen["decode"] not in want_dec:
            return run_decode()
        label = f"decode step {seen['decode']}: {len(sched.running)} reqs"
        return _profile_call(run_decode, label)

    sched._run_extend, sched._run_decode = extend, decode
    rng = random.Random(0)
    vocab, prompts = eng.runner.model_config.vocab_size, []
    for _ in range(args.groups):  # the suite's workload: 16 per group, 2048 shared + 64 own
        prefix = [rng.randrange(vocab) for _ in range(2048)]
        prompts += [prefix + [rng.randrange(vocab) for _ in range(64)] for _ in range(16)]
    rng.shuffle(prompts)
    outs = [64] * len(prompts)
    sp = [{"max_new_tokens": n, "temperature": 0, "ignore_eos": True} for n in outs]
    t0 = time.perf_counter()
    if args.cprofile:  # host-side time by Python function over the whole run
        import cProfile
        import pstats
        prof = cProfile.Profile()
        prof.runcall(eng.generate, input_ids=prompts, sampling_params=sp)
        st = pstats.Stats(prof, stream=sys.stderr)
        st.sort_stats("tottime").print_stats(30)
        st.sort_stats("cumulative").print_stats("radixlm", 45)
    else:
        eng.generate(input_ids=prompts, sampling_params=sp)
    print(json.dumps({"total_s": round(time.perf_counter() - t0, 2), **seen,
                      "shared_prefix_steps": sched.stats["shared_prefix_steps"]}), flush=True)
    eng.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=("attn", "gemv", "steps", "dattn"))
    ap.add_argument("--model-path", default=os.path.join(_ROOT, "benchmarks/configs/llama-3.1-8b"))
    ap.add_argument("--tokenizer-path", default=".carry/smollm2-tokenizer")
    ap.add_argument("--engine-kw", type=json.loads, default={})
    ap.add_argument("--groups", type=int, default=32)
    ap.add_argument("--extend-steps", default="3,40")
    ap.add_argument("--decode-steps", default="5,30")
    ap.add_argument("--cprofile", action="store_true", help="steps: cProfile the whole run")
    args = ap.parse_args()
    {"attn": probe_attn, "gemv": probe_gemv, "steps": probe_steps,
     "dattn": probe_decode_attn}[args.what](args)


if __name__ == "__main__":
    main()
