"""FP8 (e4m3) linear layers (layers/fp8_linear.py) against bf16 on a GPU: when is FP8 faster?

Two parts, JSON lines on stdout (and appended to `--result-file`):
  kernel  y = x (M, K) @ W^T at Llama-3.1-8B's projection shapes (qkv 4096->6144, o 4096->4096,
          gate_up 4096->28672, down 14336->4096) for M in 1, 8, 32, 128, 512, 2048:
            bf16        cuBLAS (F.linear), and at M=1 also radixlm's bf16 path (triton_gemv.linear)
            fp8         what Fp8Linear runs: M=1 the FP8 Triton GEMV; M>1 the per-token e4m3
                        quantization kernel + torch._scaled_mm with rowwise scales
            parts       _scaled_mm alone (x already quantized), the quantization kernel alone,
                        tensorwise _scaled_mm (cuBLASLt), and at M=1 a sweep of GEMV tiles
          timed inside CUDA graphs (as decode runs), weights cycled through copies totalling
          > 256 MB so they come from HBM as in a real forward, CUDA events over the replays.
          `speedup` = best bf16 / fp8; `rel_err` = |y_fp8 - y_bf16| / |y_bf16| (Frobenius).
  e2e     (--e2e) the Engine on dummy Llama-3.1-8B weights (benchmarks/configs/llama-3.1-8b),
          bf16 vs FP8 (the same config with an fp8 quantization_config, fp8_linear=scaled_mm):
          batch-1 decode tok/s (256 tokens after a 128-token prompt) and batch-64 decode
          (64 x 128 tokens after 128-token prompts), CUDA graphs on.
One summary line per run: per shape, the Ms at which FP8 is faster and the speedup per M.

    python benchmarks/fp8_linear.py --e2e --result-file benchmarks/results/fp8_linear-h100.jsonl

About 1 minute for the kernels and 1-2 for --e2e on an H100. Without CUDA it exits with status 2.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import shlex
import shutil
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from benchmarks.kernel_bench import capture  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
          "down": (4096, 14336)}
MS = (1, 8, 32, 128, 512, 2048)
COLD_BYTES = 256 << 20  # > 5x the H100's 50 MB L2
GEMV_SWEEP = ((8, 512, 2, 4), (4, 1024, 2, 3), (4, 2048, 8, 3), (8, 256, 4, 4),
              (16, 512, 4, 4), (2, 2048, 4, 4), (8, 1024, 8, 3))
CONFIG_DIR = os.path.join(_HERE, "configs", "llama-3.1-8b")


def git_commit() -> str:
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=_ROOT, text=True,
                             capture_output=True, timeout=10).stdout.strip()
        return sha or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def meta(command: str) -> dict:
    return {"device": torch.cuda.get_device_name(), "capability":
            ".".join(map(str, torch.cuda.get_device_capability())), "torch": torch.__version__,
            "cuda": torch.version.cuda, "git_commit": git_commit(), "command": command,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def graph_time_us(fn, n_calls: int, reps: int = 10) -> float:
    """Per call: `fn(i)` for i in range(n_calls) captured in one CUDA graph, replayed `reps`
    times between CUDA events (what a decode step's graph does: no launch gaps)."""
    g = capture(fn, n_calls)
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    del g
    return start.elapsed_time(end) * 1e3 / (reps * n_calls)


def bench_shape(label: str, n: int, k: int, ms, sweep: bool, dev: str = "cuda") -> list[dict]:
    from radixlm.runtime.layers import fp8_linear, triton_fp8, triton_gemv

    torch.manual_seed(0)
    copies = max(2, -(-COLD_BYTES // (n * k)))  # fp8 bytes per copy: n * k
    w16 = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    layers = []
    for w in w16:
        lin = torch.nn.Linear(k, n, bias=False, device=dev, dtype=torch.bfloat16)
        lin.weight.data = w
        layers.append(fp8_linear.Fp8Linear.from_linear(lin))
    bf_copies = max(2, -(-COLD_BYTES // (2 * n * k)))
    out = []
    for m in ms:
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        xq, sx = triton_fp8.quantize_rows(x)
        one = torch.ones((), device=dev)
        row = {"bench": "fp8_linear", "shape": label, "N": n, "K": k, "M": m}
        t = {}
        t["bf16_cublas"] = graph_time_us(lambda i: F.linear(x, w16[i % len(w16)]), bf_copies)
        if m == 1:
            t["bf16_radixlm"] = graph_time_us(
                lambda i: triton_gemv.linear(x, w16[i % len(w16)]), bf_copies)
        t["fp8_layer"] = graph_time_us(lambda i: layers[i](x), copies)
        t["fp8_quant_scaled_mm"] = graph_time_us(
            lambda i: torch._scaled_mm(*_q(triton_fp8, x, layers[i]), out_dtype=torch.bfloat16),
            copies)
        t["fp8_scaled_mm_only"] = graph_time_us(
            lambda i: torch._scaled_mm(xq, layers[i].weight.t(), scale_a=sx,
                                       scale_b=layers[i].weight_scale.view(1, -1),
                                       out_dtype=torch.bfloat16), copies)
        t["fp8_quant_only"] = graph_time_us(lambda i: triton_fp8.quantize_rows(x), 16)
        try:
            t["fp8_tensorwise"] = graph_time_us(
                lambda i: torch._scaled_mm(xq, layers[i].weight.t(), scale_a=one, scale_b=one,
                                           out_dtype=torch.bfloat16), copies)
        except RuntimeError as e:  # noqa: PERF203
            row["fp8_tensorwise_error"] = str(e).splitlines()[0][:160]
        if m == 1:
            t["fp8_gemv_default"] = graph_time_us(
                lambda i: triton_fp8.gemv(x, layers[i].weight, layers[i].weight_scale), copies)
            if sweep:
                best = None
                for cfg in GEMV_SWEEP:
                    us = graph_time_us(lambda i, cfg=cfg: triton_fp8.gemv(
                        x, layers[i].weight, layers[i].weight_scale, config=cfg), copies)
                    if best is None or us < best[1]:
                        best = (cfg, us)
                row["fp8_gemv_best_config"] = list(best[0])
                t["fp8_gemv_best"] = best[1]
        row.update({f"{key}_us": round(v, 2) for key, v in t.items()})
        bf16 = min(v for key, v in t.items() if key.startswith("bf16"))
        row["speedup"] = round(bf16 / t["fp8_layer"], 3)
        row["fp8_faster"] = t["fp8_layer"] < bf16
        row["fp8_weight_TBps"] = round(n * k / t["fp8_layer"] / 1e6, 3)
        row["bf16_weight_TBps"] = round(2 * n * k / bf16 / 1e6, 3)
        ref = F.linear(x, w16[0]).float()
        row["rel_err"] = round(float((layers[0](x).float() - ref).norm() / ref.norm()), 5)
        print(json.dumps(row), flush=True)
        out.append(row)
    w16.clear()
    layers.clear()
    torch.cuda.empty_cache()
    return out


def _q(triton_fp8, x, layer):
    xq, sx = triton_fp8.quantize_rows(x)
    return xq, layer.weight.t(), sx, layer.weight_scale.view(1, -1)


def timed(eng, prompts, n_out) -> float:
    """Wall seconds of one greedy generate of `n_out` tokens per prompt (ids)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    eng.generate(input_ids=prompts, sampling_params={"max_new_tokens": n_out,
                                                     "temperature": 0, "ignore_eos": True})
    return time.perf_counter() - t0


def e2e_side(label: str, path: str, n_tokens: int) -> dict:
    """One side of --e2e in this process (a fresh one per side: the first engine's memory, CUDA
    graph pools included, is then surely gone before the second loads; in one process the FP8
    engine ran out of memory on an H100 after the bf16 one)."""
    import radixlm

    kw = {"fp8_linear": "scaled_mm"} if label == "fp8" else {}
    rng = random.Random(0)
    ids = lambda n: [rng.randrange(1000, 120000) for _ in range(n)]  # noqa: E731
    row = {"bench": "fp8_linear_e2e", "weights": label}
    t0 = time.perf_counter()
    eng = radixlm.Engine(model_path=path, load_format="dummy", dtype="bfloat16",
                         skip_tokenizer_init=True, context_length=2048, max_running_requests=64,
                         cuda_graph_max_bs=64, **kw)
    try:
        row["engine_s"] = round(time.perf_counter() - t0, 1)
        row["weights_GB"] = round(sum(p.numel() * p.element_size() for p in
                                      eng.runner.model.parameters()) / 1e9, 2)
        timed(eng, [ids(128) for _ in range(4)], 8)  # warm-up
        p1 = ids(128)
        eng.flush_cache()
        t_pref = timed(eng, [p1], 1)
        eng.flush_cache()
        t_all = timed(eng, [p1], n_tokens)
        row["bs1_decode_tok_s"] = round((n_tokens - 1) / (t_all - t_pref), 1)
        batch = [ids(128) for _ in range(64)]
        eng.flush_cache()
        t_pref = timed(eng, batch, 1)
        eng.flush_cache()
        t_all = timed(eng, batch, 128)
        row["bs64_decode_tok_s"] = round(64 * 127 / (t_all - t_pref), 1)
        row["bs64_total_tok_s"] = round(64 * 128 / t_all, 1)
    finally:
        eng.shutdown()
    return row


def e2e(args) -> list[dict]:
    """The Engine on dummy Llama-3.1-8B weights, bf16 then FP8, each side in its own process."""
    with open(os.path.join(args.e2e_config, "config.json")) as f:
        cfg = json.load(f)
    tmp = tempfile.mkdtemp(prefix="fp8-llama8b-")
    cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(cfg, f)
    rows = []
    try:
        for label, path in (("bf16", args.e2e_config), ("fp8", tmp)):
            cmd = [sys.executable, os.path.abspath(__file__), "--e2e-side", label,
                   "--e2e-config", path, "--e2e-tokens", str(args.e2e_tokens)]
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
            lines = [ln for ln in p.stdout.splitlines() if ln.startswith('{"bench": "fp8_linear_e2e"')]
            row = (json.loads(lines[-1]) if p.returncode == 0 and lines else
                   {"bench": "fp8_linear_e2e", "weights": label,  # one side failing must not
                    "error": f"exit {p.returncode}: {p.stderr[-400:]}"})  # lose the other
            print(json.dumps(row), flush=True)
            rows.append(row)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if len(rows) == 2 and all("bs1_decode_tok_s" in r for r in rows):
        for key in ("bs1_decode_tok_s", "bs64_decode_tok_s"):
            rows[1][f"{key}_vs_bf16"] = round(rows[1][key] / rows[0][key], 3)
    return rows


def summary(rows: list[dict]) -> dict:
    out = {}
    for label in SHAPES:
        mine = [r for r in rows if r.get("shape") == label]
        out[label] = {"fp8_faster_at_M": [r["M"] for r in mine if r["fp8_faster"]],
                      "speedup_by_M": {r["M"]: r["speedup"] for r in mine}}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--m", nargs="+", type=int, default=list(MS))
    ap.add_argument("--no-sweep", action="store_true", help="M=1: only the default GEMV tiles")
    ap.add_argument("--e2e", action="store_true", help="also the Engine, bf16 vs FP8 dummy 8B")
    ap.add_argument("--e2e-tokens", type=int, default=256)
    ap.add_argument("--e2e-config", default=CONFIG_DIR, help="folder with the config.json")
    ap.add_argument("--result-file", help="append the JSON lines here")
    ap.add_argument("--e2e-side", choices=("bf16", "fp8"), help=argparse.SUPPRESS)  # e2e's child
    args = ap.parse_args(argv)
    if args.e2e_side:
        print(json.dumps(e2e_side(args.e2e_side, args.e2e_config, args.e2e_tokens)), flush=True)
        return 0
    if not torch.cuda.is_available():
        print("benchmarks/fp8_linear.py needs a CUDA GPU with FP8 tensor cores (SM89+: L4, "
              "H100, H200, ...); none is visible here", file=sys.stderr)
        return 2
    if torch.cuda.get_device_capability() < (8, 9):
        print(f"{torch.cuda.get_device_name()} has no FP8 tensor cores (SM89+ needed)",
              file=sys.stderr)
        return 2
    m = meta("python " + " ".join(shlex.quote(a) for a in sys.argv))
    rows = []
    t0 = time.perf_counter()
    for label in args.shapes:
        rows += bench_shape(label, *SHAPES[label], args.m, sweep=not args.no_sweep)
    summ = {"bench": "fp8_linear_summary", **m, "kernel_s": round(time.perf_counter() - t0, 1),
            "by_shape": summary(rows)}
    if args.e2e:
        t1 = time.perf_counter()
        rows += e2e(args)
        summ["e2e_s"] = round(time.perf_counter() - t1, 1)
        summ["e2e"] = {r["weights"]: {k: v for k, v in r.items() if k not in ("bench", "weights")}
                       for r in rows if r.get("bench") == "fp8_linear_e2e"}
    print(json.dumps(summ), flush=True)
    if args.result_file:
        with open(args.result_file, "a") as f:
            for r in rows:
                f.write(json.dumps({**r, "git_commit": m["git_commit"], "device": m["device"],
                                    "date": m["date"]}) + "\n")
            f.write(json.dumps(summ) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
