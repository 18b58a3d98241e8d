"""Where does batch-1 decode lose time against the bandwidth roofline?

A diagnostic (prints, no result file). Three probes, each one JSON line on stdout (tables on
stderr):

  chain     the decode step's weight GEMVs alone (qkv, o, gate_up, down per layer x 32, lm_head)
            captured in one CUDA graph, per GEMV routing (cuBLAS, layers/triton_gemv), against
            weight bytes / copy bandwidth: what the GEMVs cost when nothing else runs
  timeline  the engine's bs1 decode under torch.profiler: kernels per step by name, GPU busy vs
            wall, and the idle gaps between consecutive kernels grouped by the kernel pair
  ttft      the 128-token prefill of an empty cache: wall of generate(max_new_tokens=1) against
            the GPU busy time of its kernels

    python benchmarks/probes/gpu_probe_bs1.py chain timeline ttft
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import statistics
import sys
import time

import torch
import torch.nn.functional as F

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from benchmarks.gpu_suite_parts import copy_bandwidth_tbps, rand_ids, timed_generate  # noqa: E402
from benchmarks.kernel_bench import replay_ms  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def _gemv(x, w, cfg) -> None:
    """One projection the way `cfg` routes it: "cublas" (F.linear), "default" (triton_gemv's own
    choice of config, as the model runs it) or an explicit Triton GEMV config tuple."""
    from radixlm.runtime.layers import triton_gemv
    if cfg == "cublas":
        F.linear(x, w)
    elif cfg == "default":
        triton_gemv.linear(x, w)
    else:
        triton_gemv.gemv(x, w, config=cfg)


def probe_chain(args, out: dict) -> None:
    """The 32 layers' GEMVs in one graph, weights as in the model (15 GB: nothing stays in L2)."""
    from radixlm.runtime.layers import triton_gemv
    dev, dt = "cuda", torch.bfloat16
    layers = [{n: torch.randn(s, device=dev, dtype=dt) * 0.02 for n, s in SHAPES.items()}
              for _ in range(32)]
    head = torch.randn(128256, 4096, device=dev, dtype=dt) * 0.02
    xs = {4096: torch.randn(1, 4096, device=dev, dtype=dt), 14336: torch.randn(1, 14336, device=dev, dtype=dt)}
    nbytes = sum(w.numel() * 2 for ly in layers for w in ly.values()) + head.numel() * 2
    bw = copy_bandwidth_tbps()
    out.update(copy_TBps=round(bw, 3), chain_ideal_ms=round(nbytes / bw / 1e9, 3))

    def routed(route: dict):
        def run():
            for ly in layers:
                for name, w in ly.items():
                    _gemv(xs[w.shape[1]], w, route.get(name, "default"))
            triton_gemv.linear(xs[4096], head)
        return run

    variants = {"engine": {}, "all_cublas": {n: "cublas" for n in SHAPES}}
    for cfg in [(8, 256, 2, 4), (4, 512, 2, 4), (4, 256, 2, 4), (2, 512, 2, 4), (16, 128, 2, 4),
                (8, 512, 4, 3), (4, 1024, 4, 3), (8, 256, 4, 5), (2, 1024, 2, 4), (1, 1024, 1, 4),
                (4, 256, 1, 6), (8, 128, 1, 6)]:
        variants[f"o+qkv {cfg}"] = {"o": cfg, "qkv": cfg}
    for name, route in variants.items():
        fn = routed(route)
        fn()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        out[f"chain_ms[{name}]"] = round(replay_ms(g), 3)
        del g
    # per-GEMV time inside a graph of 32 copies (the layer's share), for each routing of o and qkv
    for name in ("qkv", "o"):
        for label, cfg in [("cublas", "cublas"), ("default", "default"), ("8,256,2,4", (8, 256, 2, 4)),
                           ("4,512,2,4", (4, 512, 2, 4)), ("2,1024,2,4", (2, 1024, 2, 4))]:
            ws = [ly[name] for ly in layers]
            x = xs[4096]

            def run(ws=ws, cfg=cfg):
                for w in ws:
                    _gemv(x, w, cfg)
            run()
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                run()
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            g.replay()
            s.record()
            for _ in range(5):
                g.replay()
            e.record()
            torch.cuda.synchronize()
            us = s.elapsed_time(e) / 5 / 32 * 1e3
            out[f"in_graph_us[{name} {label}]"] = round(us, 1)
            del g


def _kernels(prof):
    """Device kernel events sorted by start: (name, start_us, end_us)."""
    evs = []
    for e in prof.events():
        if getattr(e, "device_type", None) is not None and str(e.device_type).endswith("CUDA"):
            evs.append((e.name, e.time_range.start, e.time_range.end))
    return sorted(evs, key=lambda k: k[1])


def probe_timeline(eng, args, out: dict) -> None:
    from torch.profiler import ProfilerActivity, profile
    rng = random.Random(3)
    prompt = rand_ids(rng, 128, 49152)
    timed_generate(eng, [prompt], [8])
    eng.flush_cache()
    n_out = 64
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        wall, n = timed_generate(eng, [prompt], [n_out])
    ks = _kernels(prof)
    # the decode region: after the prefill, i.e. the last (n_out - 4) steps' worth of kernels;
    # steps end with the argmax, so count lm_head-sized gaps by the argmax kernels
    ends = [i for i, k in enumerate(ks) if "argmax" in k[0].lower()]
    first = ends[4] + 1 if len(ends) > 8 else len(ks) // 4
    last = ends[-1] if ends else len(ks) - 1
    dec = ks[first : last + 1]
    steps = max(1, sum(1 for i in ends if first <= i <= last))
    span = dec[-1][2] - dec[0][1]
    busy = sum(k[2] - k[1] for k in dec)
    by_name = collections.defaultdict(lambda: [0, 0.0])
    for name, s, e in dec:
        by_name[name][0] += 1
        by_name[name][1] += e - s
    gaps = collections.defaultdict(lambda: [0, 0.0])
    for a, b in zip(dec, dec[1:]):
        gap = b[1] - a[2]
        if gap > 0:
            key = f"{a[0][:40]} -> {b[0][:40]}"
            gaps[key][0] += 1
            gaps[key][1] += gap
    total_gap = sum(v[1] for v in gaps.values())
    out.update(timeline_wall_ms_per_tok=round(wall * 1e3 / n, 3),
               decode_span_ms_per_step=round(span / steps / 1e3, 3),
               decode_busy_ms_per_step=round(busy / steps / 1e3, 3),
               decode_gap_ms_per_step=round(total_gap / steps / 1e3, 3),
               kernels_per_step=round(len(dec) / steps, 1), steps_seen=steps)
    print("=== kernels per decode step (count, us)", file=sys.stderr)
    for name, (c, t) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:25]:
        print(f"{c / steps:7.1f} {t / steps:9.1f}  {name[:110]}", file=sys.stderr)
    print("=== idle gaps per decode step by kernel pair (count, us)", file=sys.stderr)
    for key, (c, t) in sorted(gaps.items(), key=lambda kv: -kv[1][1])[:25]:
        print(f"{c / steps:7.1f} {t / steps:9.1f}  {key}", file=sys.stderr)
    big = sorted(((b[1] - a[2], a[0][:50], b[0][:50]) for a, b in zip(dec, dec[1:])), reverse=True)[:8]
    print("=== largest single gaps (us)", big, file=sys.stderr)


def probe_ttft(eng, args, out: dict) -> None:
    from torch.profiler import ProfilerActivity, profile
    rng = random.Random(4)
    walls = []
    for _ in range(5):
        eng.flush_cache()
        walls.append(timed_generate(eng, [rand_ids(rng, 128, 49152)], [1])[0])
    eng.flush_cache()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        wall, _ = timed_generate(eng, [rand_ids(rng, 128, 49152)], [1])
    ks = _kernels(prof)
    busy = sum(k[2] - k[1] for k in ks)
    out.update(ttft_ms_median=round(statistics.median(walls) * 1e3, 2),
               ttft_profiled_wall_ms=round(wall * 1e3, 2), ttft_gpu_busy_ms=round(busy / 1e3, 2),
               ttft_kernels=len(ks),
               ttft_gpu_span_ms=round((ks[-1][2] - ks[0][1]) / 1e3, 2) if ks else None)
    avg = prof.key_averages()
    print("=== ttft: CPU ops by self time", file=sys.stderr)
    print(avg.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=70),
          file=sys.stderr)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", nargs="+", choices=("chain", "timeline", "ttft"))
    ap.add_argument("--model-path", default=os.path.join(_ROOT, "benchmarks/configs/llama-3.1-8b"))
    ap.add_argument("--tokenizer-path", default=".carry/smollm2-tokenizer")
    ap.add_argument("--engine-kw", type=json.loads, default={})
    args = ap.parse_args()
    out: dict = {"device": torch.cuda.get_device_name(0)}
    if "chain" in args.what:
        probe_chain(args, out)  # its 15 GB of weights are freed on return
        torch.cuda.empty_cache()
        print(json.dumps(out), flush=True)
    if {"timeline", "ttft"} & set(args.what):
        import radixlm
        kw = dict(model_path=args.model_path, load_format="dummy", dtype="bfloat16",
                  tokenizer_path=args.tokenizer_path, context_length=4096, device="cuda")
        kw.update(args.engine_kw)
        t0 = time.perf_counter()
        eng = radixlm.Engine(**kw)
        out["engine_s"] = round(time.perf_counter() - t0, 1)
        timed_generate(eng, [rand_ids(random.Random(0), 32, 49152)], [8])
        if "timeline" in args.what:
            probe_timeline(eng, args, out)
        if "ttft" in args.what:
            probe_ttft(eng, args, out)
        eng.shutdown()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
