"""Does prefetching the next weight into L2 pay in a batch-1 decode step?

A diagnostic (one JSON line on stdout). The step's weight GEMVs (32 layers and the LM head, as in
Llama-3.1-8B at TP=1, or one rank's half at TP=2) in one CUDA graph, with the kernels between
them stood in for by gap kernels that spin for a set time and read no memory: rotary + decode
attention before o_proj, the RMSNorm (TP=1) or all-reduce + RMSNorm (TP=2) after o_proj and
after down_proj. The memory idles during the gaps; the variants start the next weight's first
bytes into L2 before or during them (layers/l2_prefetch):

  base        Triton GEMVs, nothing prefetched      engine  the engine's routing (cuBLAS where
                                                            triton_gemv has no tuned config)
  A<MB>       a prefetch kernel before each gap     B<MB>   the GEMV before a gap prefetches
  C<MB>       the gap kernel itself prefetches (as a fused norm / rotary / attention kernel would)
  E0          GEMVs under programmatic dependent launch, the gaps letting them launch early
  E           E0, each GEMV program asking for its own rows before it waits for x
  EB<MB>      E with B

    python benchmarks/probes/l2_prefetch_bs1.py [--tp 1,2] [--mb 8,16,32]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from radixlm.runtime.layers import l2_prefetch, triton_gemv  # noqa: E402

# (qkv, o, gate_up, down, lm_head) weight shapes (N, K) of one rank, Llama-3.1-8B
SHAPES = {1: [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)],
          2: [(3072, 4096), (4096, 2048), (14336, 4096), (4096, 7168), (64128, 4096)]}
# gap lengths in us: before o_proj (rotary + attention), after o_proj and after down_proj
GAPS_US = {1: (8.0, 2.5, 2.5), 2: (8.0, 9.0, 9.0)}


@triton.jit
def _clock(dummy):
    return tl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l,r", [dummy], dtype=tl.int64,
                                     is_pure=False, pack=1)


@triton.jit
def _gap_kernel(CYCLES, NEXT, TOTAL, CHUNK, PREFETCH: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    if PREFETCH:
        for off in range(0, TOTAL, CHUNK):
            l2_prefetch.prefetch_l2(NEXT + off, tl.minimum(CHUNK, TOTAL - off).to(tl.int32))
    t0 = _clock(0)
    t = t0
    while t - t0 < CYCLES:
        t = _clock(0)


def gap(cycles: int, prefetch=None, pdl: bool = False) -> None:
    dummy = _DUMMY
    nxt, total = (dummy, 0) if prefetch is None else (l2_prefetch.byte_view(prefetch[0]),
                                                      l2_prefetch.span(*prefetch))
    _gap_kernel[(1,)](cycles, nxt, total, 1 << 20, PREFETCH=total > 0, PDL=pdl, launch_pdl=pdl,
                      num_warps=1)


_DUMMY = None


def timed(fn, reps: int = 20) -> float:
    """Median ms of one replay of fn captured in a CUDA graph."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        g.replay()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e))
    del g
    return statistics.median(times[3:])


def calibrate() -> tuple[float, float]:
    """(us per gap launch at 0 cycles, cycles per us) from graphs of 200 gap kernels."""
    t = {c: timed(lambda c=c: [gap(c) for _ in range(200)]) * 1e3 / 200 for c in (2000, 40000)}
    per_us = (40000 - 2000) / (t[40000] - t[2000])
    return t[2000] - 2000 / per_us, per_us


def run_tp(tp: int, mbs: list[int], out: dict) -> None:
    dev, dt = "cuda", torch.bfloat16
    qkv_s, o_s, gu_s, down_s, head_s = SHAPES[tp]
    layers = [[torch.randn(s, device=dev, dtype=dt) * 0.02 for s in (qkv_s, o_s, gu_s, down_s)]
              for _ in range(32)]
    head = torch.randn(head_s, device=dev, dtype=dt) * 0.02
    x = torch.randn(1, 4096, device=dev, dtype=dt)
    xo = torch.randn(1, o_s[1], device=dev, dtype=dt)
    xd = torch.randn(1, down_s[1], device=dev, dtype=dt)
    base_us, per_us = calibrate()
    cyc = [max(0, int((us - base_us) * per_us)) for us in GAPS_US[tp]]
    cfg = {id(w): triton_gemv.default_config(*w.shape) for ly in layers for w in ly}
    gu_cfg = triton_gemv.silu_config(*gu_s) or (4, 512, 4, 3)

    def step(mode: str, mb: int = 0, engine: bool = False):
        nbytes = mb << 20
        pdl = mode.startswith("E")
        selfp = mode in ("E", "EB")
        for i, (qkv, o, gu, down) in enumerate(layers):
            nxt = layers[i + 1][0] if i + 1 < len(layers) else head
            stops = [(o, cyc[0]), (gu, cyc[1]), (nxt, cyc[2])]  # after qkv, o, down

            def gemv(xin, w, k):
                pf = (stops[k][0], nbytes) if mode in ("B", "EB") and k is not None else None
                if engine:
                    triton_gemv.linear(xin, w)
                else:
                    triton_gemv.gemv(xin, w, config=cfg[id(w)], prefetch=pf, pdl=pdl,
                                     self_prefetch=selfp)

            def after(k):
                w, c = stops[k]
                if mode == "A":
                    l2_prefetch.prefetch(w, nbytes)
                gap(c, (w, nbytes) if mode == "C" else None, pdl=pdl)

            gemv(x, qkv, 0)
            after(0)
            gemv(xo, o, 1)
            after(1)
            if engine:
                triton_gemv.gate_up_silu(x, gu)
            else:
                triton_gemv.gemv_silu(x, gu, gu_cfg, pdl=pdl, self_prefetch=selfp)
            gemv(xd, down, 2)
            after(2)
        if engine:
            triton_gemv.linear(x, head)
        else:
            triton_gemv.gemv(x, head, config=triton_gemv.default_config(*head.shape), pdl=pdl,
                             self_prefetch=selfp)

    res = {"gap_launch_us": round(base_us, 2), "cycles_per_us": round(per_us, 1),
           "gaps_us": GAPS_US[tp]}
    res["base_ms"] = round(timed(lambda: step("base")), 4)
    res["engine_ms"] = round(timed(lambda: step("base", engine=True)), 4)
    res["gaps_only_ms"] = round(timed(lambda: [gap(c) for _ in range(32) for c in cyc]), 4)
    for mode in ("E0", "E"):
        res[f"{mode}_ms"] = round(timed(lambda mode=mode: step(mode)), 4)
    for mode in ("A", "B", "C", "EB"):
        for mb in mbs:
            res[f"{mode}{mb}_ms"] = round(timed(lambda mode=mode, mb=mb: step(mode, mb)), 4)
    nbytes = sum(w.numel() * 2 for ly in layers for w in ly) + head.numel() * 2
    res["weight_GB"] = round(nbytes / 1e9, 3)
    best = min((v, k) for k, v in res.items() if k.endswith("_ms") and k != "gaps_only_ms")
    res["best"] = best[1]
    res["best_vs_base"] = round(res["base_ms"] / best[0], 3)
    out[f"tp{tp}"] = res
    print(f"tp{tp}: {json.dumps(res)}", file=sys.stderr, flush=True)
    del layers, head
    torch.cuda.empty_cache()


def main() -> None:
    global _DUMMY
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tp", default="2,1")
    ap.add_argument("--mb", default="8,16,32")
    args = ap.parse_args()
    _DUMMY = torch.zeros(16, dtype=torch.uint8, device="cuda")
    out = {"probe": "l2_prefetch_bs1", "device": torch.cuda.get_device_name()}
    for tp in [int(t) for t in args.tp.split(",")]:
        run_tp(tp, [int(m) for m in args.mb.split(",")], out)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
