"""The int4 wgmma GEMM for 9-64 rows (layers/gluon_int4_gemm.py) against the Triton int4 GEMM
(layers/triton_int4_gemm.py: these rows' kernel before it) and cuBLAS bf16, at Llama-3.1-8B's
projection shapes (gate_up without the SiLU: both GEMMs leave it to a separate kernel above 8
rows): weights from HBM (copies > 256 MB cycled), calls captured in one CUDA graph
(benchmarks/fp8_linear.graph_time_us), us a call.
  cublas   bf16 F.linear at M rows (its bytes: ~4x the int4 bytes)
  triton   the Triton GEMM at its default config (gemm_config)
  wgmma    each config of CONFIGS the kernel takes; the best, the default's, and all of them
           in `wgmma_sweep`; `--configs-out FILE` writes the best per (shape, batch tile)
One JSON line a (shape, M): each arm's us, TB/s of the int4 bytes, the wgmma output's error
against the Triton GEMM's (max abs over max abs).

    python benchmarks/probes/int4_wgmma_bound.py [--shapes o down] [--m 16 64]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from benchmarks.probes.int4_gemv_bound import GROUP  # noqa: E402
from benchmarks.probes.int4_mma_bound import operands  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
          "down": (4096, 14336)}
# (WARPS, RREP, STEP, SPLIT_K, MAXNREG, ASYNC): gluon_int4_gemm.gemm's config (None: its
# default); the synchronous ones first, then a group's MMAs in flight (ASYNC 1)
CONFIGS = ([(8, 1, 128, s, None, None) for s in (None, 1, 4)]
           + [(8, 1, 64, s, 128, None) for s in (None, 1, 4)]
           + [(4, 1, 64, s, None, None) for s in (None, 4, 8)]
           + [(8, 1, 64, s, None, None) for s in (None, 8)]
           + [(8, 1, 64, s, None, 1) for s in (None, 1, 4)]
           + [(8, 1, 32, s, None, 1) for s in (None, 1, 4)]
           + [(8, 1, 64, s, 128, 1) for s in (None, 1, 4)]
           + [(4, 1, 32, s, None, 1) for s in (None, 4, 8)])


def bench(label: str, n: int, k: int, ms, configs) -> list[dict]:
    import torch
    import torch.nn.functional as F

    from benchmarks.fp8_linear import graph_time_us
    from radixlm.runtime.layers import gluon_int4_gemm as GG
    from radixlm.runtime.layers import int4_wgmma_configs as WC
    from radixlm.runtime.layers import triton_int4_gemm as TG

    int4_bytes, copies, layers, words, w16 = operands(n, k)
    rows = []
    for m in ms:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        row = {"probe": "int4_wgmma_bound", "shape": label, "N": n, "K": k, "M": m,
               "int4_MB": round(int4_bytes / 1e6, 1)}
        row["cublas_us"] = round(graph_time_us(lambda i: F.linear(x, w16[i % len(w16)]),
                                               len(w16)), 2)
        lyr = layers[0]
        row["triton_us"] = round(graph_time_us(
            lambda i: TG.gemm(x, layers[i % copies].qweight, layers[i % copies].scales,
                              layers[i % copies].zeros, GROUP), copies), 2)

        def wg(cfg):
            return lambda i: GG.gemm(x, words[i % copies], layers[i % copies].scales,
                                     layers[i % copies].zeros, GROUP, config=cfg)

        sweep = {}
        for cfg in configs:
            if not WC.supported(n, k, GROUP, x.dtype, cfg[0], cfg[1]) or (
                    cfg[1] == 2 and m > 32):  # (BM 64 at 128 rows a warpgroup: 254 registers)
                continue
            try:
                sweep[cfg] = graph_time_us(wg(cfg), copies)
            except Exception as e:  # noqa: BLE001 (reported)
                row.setdefault("errors", {})[str(cfg)] = f"{type(e).__name__}: {str(e)[:160]}"
        sweep[None] = graph_time_us(wg(None), copies)  # config_for's default (no table)
        row["wgmma_default_us"] = round(sweep[None], 2)
        row["wgmma_default_config"] = list(WC.default_config(n, GROUP, m))
        best = min(sweep, key=sweep.get)
        row["wgmma_us"] = round(sweep[best], 2)
        row["wgmma_config"] = list(best) if best is not None else row["wgmma_default_config"]
        row["wgmma_sweep"] = {str(list(c)): round(t, 2) for c, t in sweep.items()
                              if c is not None}
        ref = TG.gemm(x, lyr.qweight, lyr.scales, lyr.zeros, GROUP).float()
        y = wg(best)(0).float()
        row["wgmma_rel_err_vs_triton"] = float((y - ref).abs().max() / ref.abs().max())
        row["wgmma_speedup_vs_cublas"] = round(row["cublas_us"] / row["wgmma_us"], 3)
        row["wgmma_speedup_vs_triton"] = round(row["triton_us"] / row["wgmma_us"], 3)
        for arm in ("cublas", "triton", "wgmma"):
            if f"{arm}_us" in row:
                b = int4_bytes * (4 if arm == "cublas" else 1)
                row[f"{arm}_TBps"] = round(b / row[f"{arm}_us"] / 1e6, 3)
        rows.append(row)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--m", type=int, nargs="+", default=[16, 32, 64], choices=range(9, 4097))
    ap.add_argument("--quick", action="store_true", help="only the default config (batch tiles "
                    "past 64 rows: the Triton GEMM's range)")
    ap.add_argument("--result-file", default=None)
    ap.add_argument("--configs-out", default=None, help="write each (shape, M)'s best config as "
                    "{device: {\"N,K,group\": {\"BM\": config}}} (int4_wgmma_configs.TUNED's form)")
    args = ap.parse_args(argv)
    import torch

    from benchmarks.offline_throughput import emit_result, git_commit
    from radixlm.runtime.layers.int4_wgmma_configs import bm_for

    device = torch.cuda.get_device_name()
    meta = {"device": device, "torch": torch.__version__, "git_commit": git_commit()}
    table: dict = {}
    for s in args.shapes:
        n, k = SHAPES[s]
        for row in bench(s, n, k, args.m, [] if args.quick else CONFIGS):
            emit_result({**row, **meta}, args.result_file, __file__)
            if row["M"] <= 64:
                table.setdefault(f"{n},{k},{GROUP}", {})[str(bm_for(row["M"]))] = \
                    row["wgmma_config"]
        if args.configs_out:
            with open(args.configs_out, "w") as f:
                json.dump({device: table}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
