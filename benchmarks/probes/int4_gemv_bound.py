"""What bounds the batch-1 int4 GEMV on a GPU: its loads or its math? And does keeping the words
in flight through TMA (layers/triton_int4_tma.py) lift it?

At Llama-3.1-8B's projection shapes, weights read from HBM (copies > 256 MB cycled, as in a
forward), calls captured in one CUDA graph (benchmarks/fp8_linear.graph_time_us), us a call:
  cublas     bf16 F.linear (the bytes' reference: 4x the int4 bytes)
  reg        triton_int4.gemv at its default config (the kernel a forward runs now)
  gemm       triton_int4_gemm.gemm at M = 1 (tensor cores on the same dequant), a few tiles
  tma        triton_int4_tma.gemv over a sweep of (BLOCK_N, BLOCK_K, warps, stages, programs
             an SM): the best, the top 5 and the default's time; `tma_loads`: the best
             config's walk with the math replaced by an XOR of the words (what the load side
             alone reaches)
One JSON line a shape: each arm's best us and config, its TB/s of int4 bytes (words + scales +
zeros), and the TMA arm's error against `reg` (max abs over max abs). `--configs-out FILE`
writes each shape's best TMA config as a table of layers/int4_tma_tuned.py's form.

    python benchmarks/probes/int4_gemv_bound.py [--shapes o down] [--quick]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from benchmarks.kernel_bench import pool_failures  # noqa: E402

SHAPES = {"qkv": (6144, 4096, False), "o": (4096, 4096, False),
          "gate_up_silu": (28672, 4096, True), "down": (4096, 14336, False)}
GROUP = 128
COLD_BYTES = 256 << 20


def tma_configs(quick: bool) -> list[tuple]:
    from radixlm.runtime.layers import triton_int4_tma as T

    if quick:
        return [T.DEFAULT, (16, 1024, 4, 4, 3), (32, 512, 4, 4, 2), (32, 512, 4, 6, 2),
                (64, 256, 4, 6, 2), (32, 1024, 4, 4, 2), (16, 2048, 4, 3, 2), (16, 1024, 2, 4, 2),
                (16, 1024, 2, 4, 4)]
    out = []
    for bn, bk, warps, stages in itertools.product((16, 32, 64), (256, 512, 1024, 2048),
                                                   (2, 4, 8), (3, 4, 6)):
        per_thread = bn * bk // (warps * 32)  # values a thread a step (registers: 32-256)
        if (bn * bk // 2 * stages > 96 << 10 or not 32 <= per_thread <= 256
                or not T.supported(4096, 14336, GROUP, bn, bk)):
            continue  # (words' shared memory a program; TMA boxes: supported())
        # programs an SM: up to the words' shared memory of ~200 KB an SM (more warps in flight
        # hide the math's latency: 3-4 an SM won at gate_up in the quick sweep)
        out += [(bn, bk, warps, stages, per_sm) for per_sm in (2, 3, 4, 6, 8)
                if per_sm * stages * bn * bk // 2 <= 200 << 10 and per_sm * warps <= 32]
    return out


GEMM_CONFIGS = [(16, 32, 128, 4, 3, 1), (16, 64, 128, 4, 3, 1), (16, 64, 256, 4, 3, 1),
                (16, 32, 256, 4, 4, 2), (16, 64, 128, 4, 4, 2)]


def _layer(n, k):
    import torch

    from radixlm.runtime.layers import int4_linear

    lyr = int4_linear.Int4Linear.quantize(
        torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02, GROUP)
    lyr.scales_t = lyr.scales.t().contiguous()
    lyr.zeros_t = lyr.zeros.t().contiguous()
    return lyr


def _tma_call(lyr, x, n, k, silu, cfg, math=True):
    from radixlm.runtime.layers import triton_int4_tma as T

    key = ("descs",) + tuple(cfg[:2])
    d = lyr.__dict__.get(key)
    if d is None:
        d = T.descriptors(lyr.qweight, lyr.scales_t, lyr.zeros_t, GROUP, cfg[0], cfg[1])
        lyr.__dict__[key] = d
    return T.gemv(x, d, n // 2 if silu else n, k, GROUP, silu=silu, config=cfg, math=math)


def _compile_worker(job):
    import torch
    from triton.compiler.errors import CompilationError
    from triton.runtime.errors import OutOfResources

    n, k, silu, cfgs = job
    torch.manual_seed(0)
    lyr = _layer(n, k)
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    failed = {}
    for cfg in cfgs:
        try:
            _tma_call(lyr, x, n, k, silu, cfg)
            torch.cuda.synchronize()
        except (OutOfResources, CompilationError, AssertionError, ValueError) as e:
            failed[n, k, silu, cfg] = f"{type(e).__name__}: {str(e)[:80]}"
        except Exception:  # noqa: BLE001 (a fault poisons the context: the parent retries)
            break
    return failed


def _sweep(arm, call_for, cfgs, copies, best, errors) -> list:
    """[(us, cfg)] of `call_for(cfg)` (a graph_time_us callable) over cfgs; best[arm] the
    fastest; a config the GPU refuses goes to errors."""
    from benchmarks.fp8_linear import graph_time_us

    out = []
    for cfg in cfgs:
        try:
            t = graph_time_us(call_for(cfg), copies)
        except Exception as e:  # noqa: BLE001 (reported)
            errors[str(cfg)] = f"{type(e).__name__}: {str(e)[:80]}"
            continue
        out.append((t, cfg))
        if arm not in best or t < best[arm][0]:
            best[arm] = (t, cfg)
    return out


def bench_shape(label, n, k, silu, cfgs, maxnreg=()) -> dict:
    import torch
    import torch.nn.functional as F

    from benchmarks.fp8_linear import graph_time_us
    from radixlm.runtime.layers import triton_int4, triton_int4_gemm

    torch.manual_seed(0)
    int4_bytes = n * k // 2 + n * (k // GROUP) * 3
    copies = max(2, -(-COLD_BYTES // int4_bytes))
    layers = [_layer(n, k) for _ in range(copies)]
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    row = {"probe": "int4_gemv_bound", "shape": label, "N": n, "K": k, "silu": silu,
           "int4_MB": round(int4_bytes / 1e6, 1)}

    def reg(i):
        lyr = layers[i % copies]
        return triton_int4.gemv(x, lyr.qweight, lyr.scales, lyr.zeros, GROUP, silu=silu)

    w16 = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
           for _ in range(max(2, -(-COLD_BYTES // (2 * n * k))))]
    t_cublas = graph_time_us(lambda i: F.linear(x, w16[i % len(w16)]), len(w16))
    del w16
    row["cublas_us"] = round(t_cublas, 2)
    t_reg = graph_time_us(reg, copies)
    row["reg_us"] = round(t_reg, 2)
    ref = reg(0).float()
    best = {}
    errors = {}
    timings = _sweep("tma", lambda cfg: (lambda i: _tma_call(layers[i % copies], x, n, k, silu,
                                                            cfg)), cfgs, copies, best, errors)
    if timings and maxnreg:  # the 3 best again under register caps (6th config value)
        capped = [tuple(c[:5]) + (r,) for _, c in sorted(timings)[:3] for r in maxnreg]
        timings += _sweep("tma", lambda cfg: (lambda i: _tma_call(layers[i % copies], x, n, k,
                                                                 silu, cfg)),
                          capped, copies, best, errors)
    if timings:
        row["tma_top5"] = [[round(t, 2), list(c)] for t, c in sorted(timings)[:5]]
        row["tma_default_us"] = next((round(t, 2) for t, c in timings
                                      if tuple(c) == tuple(cfgs[0])), None)
        # the load side alone at the best config (the math replaced by an XOR of the words)
        cfg = best["tma"][1]
        best["tma_loads"] = (graph_time_us(
            lambda i: _tma_call(layers[i % copies], x, n, k, silu, cfg, False), copies), cfg)
    if not silu:
        _sweep("gemm", lambda cfg: (lambda i: triton_int4_gemm.gemm(
            x, layers[i % copies].qweight, layers[i % copies].scales, layers[i % copies].zeros,
            GROUP, config=cfg)), GEMM_CONFIGS, copies, best, errors)
    for arm, (t, cfg) in best.items():
        row[f"{arm}_us"], row[f"{arm}_config"] = round(t, 2), list(cfg)
    for arm in ("cublas", "reg", "gemm", "tma", "tma_loads"):
        if f"{arm}_us" in row:
            b = int4_bytes * (4 if arm == "cublas" else 1)  # (cublas reads bf16: ~4x)
            row[f"{arm}_TBps"] = round(b / row[f"{arm}_us"] / 1e6, 3)
    if "tma" in best:
        y = _tma_call(layers[0], x, n, k, silu, best["tma"][1]).float()
        row["tma_rel_err_vs_reg"] = float((y - ref).abs().max() / ref.abs().max())
        row["tma_speedup_vs_reg"] = round(t_reg / best["tma"][0], 3)
    if errors:
        row["errors"] = errors
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--result-file", default=None)
    ap.add_argument("--maxnreg", type=int, nargs="*", default=[],
                    help="also each shape's 3 best TMA configs with these register caps")
    ap.add_argument("--configs-out", default=None,
                    help="write each shape's best TMA config as a JSON table of "
                         "layers/int4_tma_tuned.py's form (RADIXLM_INT4_TMA_CONFIGS)")
    args = ap.parse_args(argv)
    import torch

    cfgs = tma_configs(args.quick)
    from radixlm.runtime.layers import triton_int4_tma as T

    if T.DEFAULT in cfgs:  # the default first (tma_default_us)
        cfgs.remove(T.DEFAULT)
    cfgs.insert(0, T.DEFAULT)
    # (programs an SM is not compiled in)
    compile_cfgs = sorted({c[:4] + (2,) for c in cfgs})
    jobs = [(n, k, silu, compile_cfgs[i:i + 6])
            for n, k, silu in (SHAPES[s] for s in args.shapes)
            for i in range(0, len(compile_cfgs), 6)]
    failed = pool_failures(_compile_worker, jobs)
    print(json.dumps({"compile_failures": {str(k): v for k, v in failed.items()}}), flush=True)
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "command": "python benchmarks/probes/int4_gemv_bound.py " + " ".join(argv or sys.argv[1:])}
    table = {}
    for s in args.shapes:
        n, k, silu = SHAPES[s]
        row = {**bench_shape(s, n, k, silu, cfgs, tuple(args.maxnreg)), **meta}
        line = json.dumps(row)
        print(line, flush=True)
        if args.result_file:
            with open(args.result_file, "a") as f:
                f.write(line + "\n")
        if "tma_config" in row:
            table.setdefault("tma", {})[f"{n},{k},{GROUP}"] = row["tma_config"]
        if args.configs_out:  # (after every shape: a cut-short run keeps what it measured)
            with open(args.configs_out, "w") as f:
                json.dump({meta["device"]: table}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
