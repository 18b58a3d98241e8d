"""The int4 GEMV (layers/triton_int4.gemv, M = 1) config sweep on a GPU, against torch's tinygemm
(`_weight_int4pack_mm`, group 128, bf16) and cuBLAS bf16 at Llama-3.1-8B's projection shapes.

One JSON line per (shape, config): the GEMV's median us a call, its GB/s (packed weights +
fp16 scales + uint8 zeros), its speed-up over tinygemm and over cuBLAS bf16 (> 1: faster), and
its error against the dequantized fp32 weight; then one line per shape with the best config
(and the top 5), and a last line with each shape's best (what gemv_config should return). gate_up runs twice: plain (N = 28672)
and as llama's MLP runs it at batch 1 (gate_up_silu: the SiLU-and-mul epilogue, N = 14336 out;
its baselines are the plain gate_up GEMMs, without the activation).

Timing: each call reads one of several copies of the weights (> 256 MB in all, > 5x the L2:
from HBM, as in a forward); the copies' calls are captured in one CUDA graph (no launch gaps,
as a decode step's graph), the graph replayed REPS times, each between CUDA events, after a
warm-up; the median replay / copies is the figure. Every candidate is compiled first in a pool
of processes (Triton's disk cache), so the timing loop only loads cubins.

    python benchmarks/int4_gemv_sweep.py [--shapes down o] [--quick]

752 timings (gemv_sweep: 140 configs a shape at K = 4096, 192 at K = 14336; 75 of each from
stream_sweep, the second round's knobs) of ~360 distinct kernels. The first round (379
timings, 145 kernels) ran in 45 s on an H100 host; this one is estimated at ~2 min (written
without a GPU; not yet run)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
if os.path.dirname(_HERE) not in sys.path:
    sys.path.insert(0, os.path.dirname(_HERE))

from benchmarks.kernel_bench import capture, pool_failures  # noqa: E402

SHAPES = {"qkv": (6144, 4096, False), "o": (4096, 4096, False),
          "gate_up": (28672, 4096, False), "gate_up_silu": (28672, 4096, True),
          "down": (4096, 14336, False)}
GROUP = 128
COLD_BYTES = 256 << 20
REPS = 25
DEV = "cuda"  # (a CPU dry run of bench_shape under Triton's interpreter sets "cpu")


def gemv_sweep(n: int, k: int) -> list[tuple]:
    """Configs (BLOCK_N, BLOCK_K, warps, stages, PREFETCH, SPLIT_K[, CACHE, UNROLL, MAXNREG,
    PERSIST, LEAN]) to time at (N, K), the default first. warps = BLOCK_K / 1024 always
    (gemv_config: one 16-byte block a thread).
    - pipelined (stages 2 / 4, the words cp.async'ed ahead), prefetch off / on: rows 2 / 4 / 8,
      BLOCK_K 1024 / 2048, split-K 1 / 2 / 4 where each split keeps >= 2 steps;
    - one-shot (stages 1: a program's loads all issued at once, no shared memory): rows
      1 / 2 / 4 / 8, BLOCK_K 1024 / 2048 / 4096, split-K giving 1 or 2 steps a split (2:
      also with PREFETCH 2, the second step's words loaded with the first's);
    - stages 1 with PREFETCH 2 (the words one step ahead in registers) over whole K or in 2
      splits: rows 2 / 4 / 8, BLOCK_K 1024 / 2048;
    - stream_sweep's."""
    from radixlm.runtime.layers import triton_int4

    out = [tuple(triton_int4.gemv_config(n, k))]
    for bn in (2, 4, 8):
        for bk in (1024, 2048):
            steps = -(-k // bk)
            for sp in (1, 2, 4):
                if -(-steps // sp) >= 2:
                    out += [(bn, bk, bk // 1024, st, pf, sp) for st in (2, 4) for pf in (0, 1)]
    for bn in (1, 2, 4, 8):
        for bk in (1024, 2048, 4096):
            steps = -(-k // bk)
            for per in (1, 2):
                if steps >= per:
                    out.append((bn, bk, bk // 1024, 1, 0, -(-steps // per)))
                if steps >= per == 2 and bn > 1:  # the second step's words prefetched
                    out.append((bn, bk, bk // 1024, 1, 2, -(-steps // per)))
    for bn in (2, 4, 8):  # the words one step ahead in registers, whole K or in 2 splits
        for bk in (1024, 2048):
            out += [(bn, bk, bk // 1024, 1, 2, sp) for sp in (1, 2) if -(-k // bk) >= 2 * sp]
    out += stream_sweep(k)
    seen = set()
    return [c for c in out if not (c in seen or seen.add(c))]


def stream_sweep(k: int) -> list[tuple]:
    """The second round's knobs (11-value configs, triton_int4_host._gemv_knobs) around the
    first sweep's winners (rows 2 / 4 / 8, BLOCK_K 2048 on 2 warps, 1 stage), at stages 1:
    - LEAN alone (sm_90 at 4 rows, K = 4096: a step's loop body 649 -> 539 instructions, 128
      -> 96 registers), PREFETCH 0 and (K >= 2 steps) 2; the rest all with LEAN;
    - CACHE 1 (.cg) / 2 (evict_first) on the words, PREFETCH 0 / 2 (and at 4 rows without
      LEAN, to tell the two apart);
    - UNROLL 2 (the next step's words issued during this one's math), BLOCK_K 1024 / 2048;
    - MAXNREG: ptxas' register cap under the natural count (sm_90 with LEAN: 63 / 96 / 168
      at rows 2 / 4 / 8, 166 for gate_up_silu at 4, 161 for the stream at 4): more programs
      an SM, maybe spills;
    - PERSIST p programs an SM (triton_int4_stream: the next step's words in flight during
      this one's math across row tiles): p 2 / 4 / 8 / 16 (8 programs of 128 registers x 64
      threads fill an SM's registers), with and without evict_first, BLOCK_K 1024 / 2048,
      some with a register cap."""
    out = []
    steps = -(-k // 2048)
    pfs = (0, 2) if steps >= 2 else (0,)
    for bn in (2, 4, 8):
        out += [(bn, 2048, 2, 1, pf, 1, c, 1, 0, 0, 1) for pf in pfs for c in (0, 1, 2)]
        for bk in (1024, 2048):
            if -(-k // bk) >= 2:
                out += [(bn, bk, bk // 1024, 1, 0, 1, c, 2, 0, 0, 1) for c in (0, 2)]
        for p in (2, 4, 8, 16):
            out += [(bn, 2048, 2, 1, 0, 1, c, 1, 0, p, 1) for c in (0, 2)]
        out += [(bn, 1024, 1, 1, 0, 1, 2, 1, 0, p, 1) for p in (8, 16)]
    out += [(4, 2048, 2, 1, 0, 1, c) for c in (1, 2)]
    for bn, regs in ((4, (64, 80, 128)), (8, (112, 128))):  # (128: gate_up_silu's 166)
        out += [(bn, 2048, 2, 1, 0, 1, c, 1, r, 0, 1) for r in regs for c in (0, 2)]
    out += [(4, 2048, 2, 1, 0, 1, 2, 1, r, p, 1) for r, p in ((128, 8), (96, 10), (80, 12))]
    return out


def _layer(n: int, k: int, seed: int = 0):
    """(qweight, scales, zeros, codes) on the GPU: random codes, zeros in 0..16, small scales."""
    import torch

    from radixlm.runtime.layers import int4_linear

    g = torch.Generator(device=DEV).manual_seed(seed)
    q = torch.randint(0, 16, (n, k), device=DEV, dtype=torch.uint8, generator=g)
    z = torch.randint(0, 17, (n, k // GROUP), device=DEV, dtype=torch.uint8, generator=g)
    s = (torch.rand(n, k // GROUP, device=DEV, generator=g) * 0.02 + 1e-3).half()
    return int4_linear.pack_rows(q), s, z, q


def _worker(job):
    """Compile (run once) each config at its shape; {(label, cfg): error} of those that fail.
    Stops at the first other error (a CUDA fault poisons the context): the parent retries."""
    import torch
    from triton.compiler.errors import CompilationError
    from triton.runtime.errors import OutOfResources

    from radixlm.runtime.layers import triton_int4

    label, cfgs = job
    n, k, silu = SHAPES[label]
    qw, s, z, _ = _layer(n, k)
    x = torch.randn(1, k, device=DEV, dtype=torch.bfloat16)
    failed = {}
    for cfg in cfgs:
        try:
            triton_int4.gemv(x, qw, s, z, GROUP, config=cfg, silu=silu)
            torch.cuda.synchronize()
        except (OutOfResources, CompilationError) as e:
            failed[label, cfg] = f"{type(e).__name__}: {str(e)[:80]}"
        except Exception:  # noqa: BLE001 (left to the parent's own try)
            break
    return failed


def precompile(jobs, workers: int = 0, chunk: int = 4) -> dict:
    parts = [(label, cfgs[i:i + chunk]) for label, cfgs in jobs
             for i in range(0, len(cfgs), chunk)]
    return pool_failures(_worker, parts, workers)


def median_us(fn, n_calls: int, reps: int = REPS) -> float:
    """Median over `reps` replays of one CUDA graph of fn(0..n_calls-1), per call."""
    import torch

    g = capture(fn, n_calls)
    for _ in range(3):
        g.replay()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
          for _ in range(reps)]
    for a, b in ev:
        a.record()
        g.replay()
        b.record()
    torch.cuda.synchronize()
    del g
    return statistics.median(a.elapsed_time(b) for a, b in ev) * 1e3 / n_calls


def bench_shape(label: str, cfgs, failed: dict, dev: dict) -> list[dict]:
    import torch
    import torch.nn.functional as F

    from radixlm.runtime.layers import int4_torch, triton_int4

    n, k, silu = SHAPES[label]
    qw, s, z, q = _layer(n, k)
    x = torch.randn(1, k, device=DEV, dtype=torch.bfloat16)
    grp = torch.arange(k, device=DEV) // GROUP
    w = (q.float() - z.float()[:, grp]) * s.float()[:, grp]  # the dequantized weight, fp32
    ref = x.float() @ w.t()
    if silu:  # with the epilogue's roundings (gate and up, then SiLU, in bf16)
        g, u = (ref[:, : n // 2].bfloat16().float(), ref[:, n // 2:].bfloat16().float())
        ref = (g / (1 + torch.exp(-g))).bfloat16().float() * u
    w16 = w.to(torch.bfloat16)
    del w
    wbytes = n * k // 2 + n * (k // GROUP) * 3  # packed codes + fp16 scales + uint8 zeros
    copies = max(2, -(-COLD_BYTES // wbytes))
    lay = [(qw, s, z)] + [(qw.clone(), s.clone(), z.clone()) for _ in range(copies - 1)]
    w16s = [w16] + [w16.clone() for _ in range(max(2, -(-COLD_BYTES // (2 * n * k))) - 1)]
    bf = median_us(lambda i: F.linear(x, w16s[i % len(w16s)]), len(w16s))
    w16s.clear()
    del w16
    tiny = None
    try:  # torch's tinygemm on the same codes (layers/int4_torch's repack)
        packed = [int4_torch.pack(q, z, s) for _ in range(copies)]
        tiny = median_us(lambda i: int4_torch.matmul(x, *packed[i], GROUP), copies)
        packed.clear()
    except (RuntimeError, AttributeError) as e:  # the op missing in this build / GPU
        print(json.dumps({"shape": label, "tinygemm_error": str(e).splitlines()[0][:160]}))
    del q
    torch.cuda.empty_cache()
    rows = []
    for cfg in cfgs:
        row = {"bench": "int4_gemv_sweep", "shape": label, "N": n, "K": k, "silu": silu,
               "config": list(cfg), "default": cfg == tuple(triton_int4.gemv_config(n, k))}
        if (label, cfg) in failed:
            row["error"] = failed[label, cfg]
        else:
            try:
                us = median_us(lambda i, c=cfg: triton_int4.gemv(x, *lay[i], GROUP, config=c,
                                                                  silu=silu), copies)
                y = triton_int4.gemv(x, *lay[0], GROUP, config=cfg, silu=silu).float()
                row.update({"us": round(us, 2), "GBps": round(wbytes / us / 1e3, 1),
                            "vs_tinygemm": None if tiny is None else round(tiny / us, 3),
                            "vs_bf16": round(bf / us, 3),
                            "rel_err": float(f"{float((y - ref).norm() / ref.norm()):.2e}")})
            except Exception as e:  # noqa: BLE001 (reported, the sweep goes on)
                row["error"] = f"{type(e).__name__}: {str(e)[:120]}"
        row.update({"tinygemm_us": None if tiny is None else round(tiny, 2),
                    "bf16_cublas_us": round(bf, 2), **dev})
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def main(argv=None) -> int:
    import torch

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--quick", action="store_true", help="every 4th config only (a dry run)")
    args = ap.parse_args(argv)
    dev = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    jobs = []
    for label in args.shapes:
        n, k, _ = SHAPES[label]
        cfgs = gemv_sweep(n, k)
        jobs.append((label, cfgs[:1] + cfgs[1::4] if args.quick else cfgs))
    t0 = time.perf_counter()
    failed = precompile(jobs)
    print(json.dumps({"bench": "int4_gemv_precompile", "configs": sum(len(c) for _, c in jobs),
                      "failed": len(failed), "s": round(time.perf_counter() - t0, 1)}),
          flush=True)
    best = {}
    for label, cfgs in jobs:
        rows = [r for r in bench_shape(label, cfgs, failed, dev)
                if "us" in r and r["rel_err"] < 5e-2]  # (a wrong result never "wins": O(1))
        if rows:
            b = min(rows, key=lambda r: r["us"])
            d = next((r for r in rows if r["default"]), None)
            best[label] = b
            print(json.dumps({"bench": "int4_gemv_best", "shape": label, "config": b["config"],
                              "us": b["us"], "GBps": b["GBps"], "vs_tinygemm": b["vs_tinygemm"],
                              "vs_bf16": b["vs_bf16"], "default_us": d and d["us"],
                              "top5": [[r["config"], r["us"]] for r in
                                       sorted(rows, key=lambda r: r["us"])[:5]], **dev}),
                  flush=True)
    print(json.dumps({"bench": "int4_gemv_best_configs",
                      "configs": {lb: r["config"] for lb, r in best.items()},
                      "s": round(time.perf_counter() - t0, 1)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
