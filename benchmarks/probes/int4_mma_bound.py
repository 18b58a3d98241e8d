"""The tensor-core int4 GEMV for 1-8 rows (layers/triton_int4_mma.py) against the TMA GEMV at
its tuned config (layers/triton_int4_tma.py, batch 1's kernel before it) and cuBLAS bf16, at
Llama-3.1-8B's projection shapes: weights from HBM (copies > 256 MB cycled), calls captured in
one CUDA graph (benchmarks/fp8_linear.graph_time_us), us a call.
  cublas       bf16 F.linear at M rows (its bytes: ~4x the int4 bytes)
  tma          batch 1 only, its tuned config (int4_tma_tuned.py or the default)
  mma          each (R, WARPS, AHEAD) config; the best, and all of them in `mma_sweep`
One JSON line a (shape, M): each arm's us, TB/s of the int4 bytes (words + scales + zeros), the
mma output's error against the TMA GEMV's (M = 1; max abs over max abs). `--configs-out FILE`
writes each shape's best M = 1 config as {device: {"rows,K,group": [R, WARPS, AHEAD]}} (the form of
triton_int4_mma.TUNED).

    python benchmarks/probes/int4_mma_bound.py [--shapes o down] [--m 1 8]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from benchmarks.probes.int4_gemv_bound import COLD_BYTES, GROUP, SHAPES, _layer, _tma_call  # noqa: E402

CONFIGS = [(r, w, a) for a in (1, 2) for r, w in ((1, 4), (1, 8), (1, 16), (2, 4), (2, 8))]


def operands(n: int, k: int) -> tuple:
    """(int4 bytes of one layer, copies, the copies as Int4Linear layers (group 128), their mma
    words, bf16 weights of the same shape): > 256 MB of copies each, so that cycling through
    them reads from HBM, not L2."""
    import torch

    from radixlm.runtime.layers import int4_mma_layout as L

    torch.manual_seed(0)
    int4_bytes = n * k // 2 + n * (k // GROUP) * 3
    copies = max(2, -(-COLD_BYTES // int4_bytes))
    layers = [_layer(n, k) for _ in range(copies)]
    words = [L.pack(lyr.codes()) for lyr in layers]
    w16 = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
           for _ in range(max(2, -(-COLD_BYTES // (2 * n * k))))]
    return int4_bytes, copies, layers, words, w16


def bench(label: str, n: int, k: int, silu: bool, ms) -> list[dict]:
    import torch
    import torch.nn.functional as F

    from benchmarks.fp8_linear import graph_time_us
    from radixlm.runtime.layers import int4_mma_layout as L
    from radixlm.runtime.layers import triton_int4_mma as MM
    from radixlm.runtime.layers import triton_int4_tma as T

    int4_bytes, copies, layers, words, w16 = operands(n, k)
    name = torch.cuda.get_device_name()
    tma_cfg = T.config_for(n, k, GROUP, 2, name)
    cfgs = [c for c in CONFIGS if (c[0] == 2 or not silu)
            and L.supported(n, k, GROUP, torch.bfloat16, silu, c[0])]
    rows = []
    for m in ms:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        row = {"probe": "int4_mma_bound", "shape": label, "N": n, "K": k, "M": m, "silu": silu,
               "int4_MB": round(int4_bytes / 1e6, 1)}
        row["cublas_us"] = round(graph_time_us(lambda i: F.linear(x, w16[i % len(w16)]),
                                               len(w16)), 2)

        def mma(cfg):
            return lambda i: MM.gemv(x, words[i % copies], layers[i % copies].scales,
                                     layers[i % copies].zeros, GROUP, silu=silu, config=cfg)

        sweep = {}
        for cfg in cfgs:
            try:
                sweep[cfg] = graph_time_us(mma(cfg), copies)
            except Exception as e:  # noqa: BLE001 (reported)
                row.setdefault("errors", {})[str(cfg)] = f"{type(e).__name__}: {str(e)[:100]}"
        if sweep:
            best = min(sweep, key=sweep.get)
            row["mma_us"], row["mma_config"] = round(sweep[best], 2), list(best)
            row["mma_sweep"] = {str(list(c)): round(t, 2) for c, t in sweep.items()}
        if m == 1 and tma_cfg is not None:
            row["tma_us"] = round(graph_time_us(
                lambda i: _tma_call(layers[i % copies], x, n, k, silu, tma_cfg), copies), 2)
            row["tma_config"] = list(tma_cfg)
            if sweep:
                ref = _tma_call(layers[0], x, n, k, silu, tma_cfg).float()
                y = mma(best)(0).float()
                row["mma_rel_err_vs_tma"] = float((y - ref).abs().max() / ref.abs().max())
        for arm in ("cublas", "tma", "mma"):
            if f"{arm}_us" in row:
                b = int4_bytes * (4 if arm == "cublas" else 1)
                row[f"{arm}_TBps"] = round(b / row[f"{arm}_us"] / 1e6, 3)
        if "mma_us" in row:
            row["mma_speedup_vs_cublas"] = round(row["cublas_us"] / row["mma_us"], 3)
            if "tma_us" in row:
                row["mma_speedup_vs_tma"] = round(row["tma_us"] / row["mma_us"], 3)
        rows.append(row)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--m", type=int, nargs="+", default=[1, 8], choices=range(1, 9))
    ap.add_argument("--result-file", default=None)
    ap.add_argument("--configs-out", default=None)
    args = ap.parse_args(argv)
    import torch

    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "command": "python benchmarks/probes/int4_mma_bound.py " + " ".join(argv or sys.argv[1:])}
    table = {}
    for s in args.shapes:
        n, k, silu = SHAPES[s]
        for row in bench(s, n, k, silu, args.m):
            line = json.dumps({**row, **meta})
            print(line, flush=True)
            if args.result_file:
                with open(args.result_file, "a") as f:
                    f.write(line + "\n")
            if row["M"] == 1 and "mma_config" in row:
                table[f"{n},{k},{GROUP}"] = row["mma_config"]
        if args.configs_out:
            with open(args.configs_out, "w") as f:
                json.dump({meta["device"]: table}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
