"""Int4 weight-only checkpoints (layers/int4_linear.py, Triton kernels) against bf16 on a GPU:
how much faster is decode with int4 weights?

Two parts, JSON lines on stdout (and appended to `--result-file`):
  e2e      (default) the Engine on dummy Llama-3.1-8B weights (benchmarks/configs/llama-3.1-8b),
           one arm per process (the previous arm's memory surely gone):
             bf16       the config as is
             awq-g128   + quantization_config AWQ gemm, group 128, zero points
             gptq-g128  + quantization_config GPTQ, group 128, sym, desc_act false
             awq-g128-torch  (--arms) AWQ on torch's int4 kernel (int4_linear=torch)
             awq-g128-reg    (--arms) AWQ with the register GEMV at batch 1
                             (RADIXLM_INT4_TMA=0 in the arm's process)
             (the defaults on Hopper: 1-8 rows on the tensor-core GEMV, RADIXLM_INT4_TMA=mma,
             and programmatic dependent launch, RADIXLM_PDL=1)
             awq-g128-mma, gptq-g128-mma  (--arms) without PDL; -mma-pdl: explicitly with
             bf16-nopdl     (--arms) bf16 without PDL
             awq-g128-tma   (--arms) batch 1 on the TMA GEMV, no PDL (the kernels before)
             awq-g128-nowg, gptq-g128-nowg  (--arms) 9-64 rows on the Triton GEMM, not the
                            wgmma GEMM (RADIXLM_INT4_WGMMA=0: the kernel before it)
           (dummy int4 weights: the random bf16 projections rounded to int4 at load),
           batch-1 decode tok/s (256 tokens after a 128-token prompt) and batch-64 decode tok/s
           (64 x 128 tokens after 128-token prompts), CUDA graphs on; each int4 arm also gets
           its ratio to the bf16 arm of the same run. One line per arm ("bench": "int4_decode").
  kernels  (--kernels) y = x (M, K) @ W^T at the 8B's projection shapes for M in 1 and 64:
           bf16 cuBLAS (F.linear) vs the int4 layer (GEMV at M = 1, GEMM above), timed inside
           CUDA graphs with weights cycled through copies totalling > 256 MB (from HBM, as in a
           forward); at M = 1 a small sweep of GEMV tiles, at every M > 1 the GEMM tile grid
           of benchmarks/int4_gemm_sweep.py (compiled in parallel first), reporting the default
           and the best (to set triton_int4's and triton_int4_gemm's defaults); gate_up at M = 1
           also with the SiLU epilogue (int4_gate_up_silu_us). `--ms`: the batch sizes.
`--tiny` runs the e2e part on a small config (hidden 256, 2 layers) on whatever device there is
(on the CPU the int4 arms run Int4Linear's torch emulation): a dry run that the script works.

    python benchmarks/int4_decode.py --kernels \
        --result-file benchmarks/results/int4_decode-gpu.jsonl
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

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from benchmarks.fp8_linear import graph_time_us, timed  # noqa: E402 (timers shared with FP8's)
from benchmarks.gpu_suite_parts import host_waits  # noqa: E402
from benchmarks.int4_gemm_sweep import gemm_sweep, precompile  # noqa: E402

CONFIG_DIR = os.path.join(_HERE, "configs", "llama-3.1-8b")
_AWQ = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True,
        "version": "gemm"}
_GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True, "desc_act": False,
         "checkpoint_format": "gptq"}
ARMS = {  # arm -> (quantization_config, int4_linear)
    "bf16": (None, "auto"),
    "awq-g128": (_AWQ, "triton"),
    "gptq-g128": (_GPTQ, "triton"),
    "awq-g128-torch": (_AWQ, "torch"),  # torch's _weight_int4pack_mm (layers/int4_torch.py)
    # the same AWQ / GPTQ layers with another Hopper batch-1 kernel (layers/int4_batch1.py):
    "awq-g128-reg": (_AWQ, "triton"),  # the register GEMV at batch 1 (no TMA)
    "awq-g128-mma": (_AWQ, "triton"),  # 1-8 rows on tensor cores (layers/triton_int4_mma.py)
    "gptq-g128-mma": (_GPTQ, "triton"),
    "awq-g128-mma-pdl": (_AWQ, "triton"),  # + programmatic dependent launch (triton_ops.pdl)
    "gptq-g128-mma-pdl": (_GPTQ, "triton"),
    "bf16-nopdl": (None, "auto"),  # bf16 without PDL (its RMSNorm, rotary, attention)
    "awq-g128-tma": (_AWQ, "triton"),  # batch 1 on the TMA GEMV, no PDL (the kernel before mma)
    # 9-64 rows on the Triton GEMM instead of the wgmma GEMM (layers/gluon_int4_gemm.py)
    "awq-g128-nowg": (_AWQ, "triton"),
    "gptq-g128-nowg": (_GPTQ, "triton"),
}
ARM_ENV = {"awq-g128-reg": {"RADIXLM_INT4_TMA": "0"},
           "awq-g128-mma": {"RADIXLM_INT4_TMA": "mma", "RADIXLM_PDL": "0"},
           "gptq-g128-mma": {"RADIXLM_INT4_TMA": "mma", "RADIXLM_PDL": "0"},
           "awq-g128-mma-pdl": {"RADIXLM_INT4_TMA": "mma", "RADIXLM_PDL": "1"},
           "gptq-g128-mma-pdl": {"RADIXLM_INT4_TMA": "mma", "RADIXLM_PDL": "1"},
           "bf16-nopdl": {"RADIXLM_PDL": "0"},
           "awq-g128-tma": {"RADIXLM_INT4_TMA": "1", "RADIXLM_PDL": "0"},
           "awq-g128-nowg": {"RADIXLM_INT4_WGMMA": "0"},
           "gptq-g128-nowg": {"RADIXLM_INT4_WGMMA": "0"}}
DEFAULT_ARMS = ("bf16", "awq-g128", "gptq-g128")
TINY = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 1024}
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
          "down": (4096, 14336)}
COLD_BYTES = 256 << 20  # > 5x the H100's 50 MB L2
# GEMV (BLOCK_N, BLOCK_K, warps, stages), default (8, 2048, 2, 3); (16, 1024, 4, 3): x through
# shared memory (warps != BLOCK_K / 1024), (16, 2048, 2, 2): spills. triton_int4.gemv_config
GEMV_SWEEP = ((8, 2048, 2, 3), (8, 2048, 2, 4), (8, 2048, 2, 2), (4, 2048, 2, 4),
              (8, 1024, 1, 4), (8, 1024, 1, 3), (4, 1024, 1, 4), (4, 4096, 4, 2),
              (8, 4096, 4, 2), (2, 2048, 2, 4), (16, 1024, 4, 3), (16, 2048, 2, 2))
# ... and each with PREFETCH 1 (the 5th value: a step's scales and zeros loaded one step
# ahead, triton_int4._gemv_rows; more registers)
GEMV_SWEEP = GEMV_SWEEP + tuple(c + (1,) for c in GEMV_SWEEP)
# GEMM configs: benchmarks/int4_gemm_sweep.py (the full tile grid at every --ms batch size > 1,
# compiled in parallel first)

def meta(command: str) -> dict:
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=_ROOT, text=True,
                             capture_output=True, timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        sha = "unknown"
    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {"device": dev, "torch": torch.__version__, "git_commit": sha, "command": command,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


# --- e2e --------------------------------------------------------------------------------------
def e2e_arm(arm: str, path: str, tiny: bool) -> dict:
    """One arm in this process: the engine on `path` (dummy weights), decode tok/s at batch 1
    and batch 64 (prefill time measured apart and subtracted)."""
    import radixlm

    cuda = torch.cuda.is_available()
    n1, bs, n64, plen = (16, 8, 8, 32) if tiny else (256, 64, 128, 128)
    rng = random.Random(0)
    vocab = TINY["vocab_size"] if tiny else 120000
    ids = lambda n: [rng.randrange(10, vocab - 10) for _ in range(n)]  # noqa: E731
    setting = ARMS[arm][1]  # (on the CPU "triton" runs Int4Linear's torch emulation)
    row = {"bench": "int4_decode", "arm": arm, "tiny": tiny, "int4_linear": setting,
           "dtype": "bfloat16" if cuda else "float32"}
    t0 = time.perf_counter()
    eng = radixlm.Engine(model_path=path, load_format="dummy",
                         dtype="bfloat16" if cuda else "float32", skip_tokenizer_init=True,
                         context_length=2048 if not tiny else 256, max_running_requests=bs,
                         cuda_graph_max_bs=bs, int4_linear=setting)
    try:
        model = eng.runner.model
        row["engine_s"] = round(time.perf_counter() - t0, 1)
        row["weights_GB"] = round(sum(t.numel() * t.element_size() for t in
                                      list(model.parameters()) + list(model.buffers())
                                      if t is not None) / 1e9, 3)
        row["int4_layers"] = sum(type(m).__name__ == "Int4Linear" for m in model.modules())
        # (batch 1 on a Hopper kernel: layers/int4_batch1.py; RADIXLM_INT4_TMA=0 / 1)
        row["int4_tma_layers"] = sum(getattr(m, "tma", None) is not None
                                     for m in model.modules())
        row["int4_batch1"] = sorted({m.tma.kind for m in model.modules()
                                     if getattr(m, "tma", None) is not None})
        # warm-up: every shape timed below runs once first (a Triton kernel compiles at its first
        # M: one compiling inside the prefill that is subtracted inflated a decode rate 2x)
        timed(eng, [ids(plen) for _ in range(4)], 4)
        timed(eng, [ids(plen)], 2)
        timed(eng, [ids(plen) for _ in range(bs)], 2)
        p1 = ids(plen)
        eng.flush_cache()
        t_pref = timed(eng, [p1], 1)
        eng.flush_cache()
        with host_waits() as waits:
            t_all = timed(eng, [p1], n1)
        row["bs1_decode_tok_s"] = round((n1 - 1) / (t_all - t_pref), 1)
        # (near 0: the host, not the GPU, bounds batch-1 decode)
        row["bs1_host_wait_ms_per_step"] = round(1e3 * waits[1] / max(waits[0], 1), 3)
        batch = [ids(plen) for _ in range(bs)]
        eng.flush_cache()
        t_pref = timed(eng, batch, 1)
        eng.flush_cache()
        t_all = timed(eng, batch, n64)
        row[f"bs{bs}_decode_tok_s"] = round(bs * (n64 - 1) / (t_all - t_pref), 1)
        eng.wait_idle()
        eng.check_integrity()
    finally:
        eng.shutdown()
    return row


def e2e(args, m: dict) -> list[dict]:
    with open(os.path.join(args.config, "config.json")) as f:
        base = json.load(f)
    if args.tiny:
        base.update(TINY)
    tmp = tempfile.mkdtemp(prefix="int4-decode-")
    rows = []
    try:
        for arm in args.arms:
            path = os.path.join(tmp, arm)
            os.makedirs(path)
            cfg = dict(base)
            if ARMS[arm][0] is not None:
                cfg["quantization_config"] = ARMS[arm][0]
            with open(os.path.join(path, "config.json"), "w") as f:
                json.dump(cfg, f)
            cmd = [sys.executable, os.path.abspath(__file__), "--arm-child", arm, "--config", path]
            if args.tiny:
                cmd.append("--tiny")
            env = {**os.environ, **ARM_ENV.get(arm, {})}
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
            lines = [ln for ln in p.stdout.splitlines() if ln.startswith('{"bench": "int4_decode"')]
            row = (json.loads(lines[-1]) if p.returncode == 0 and lines else
                   {"bench": "int4_decode", "arm": arm,  # one arm failing must not lose the rest
                    "error": f"exit {p.returncode}: {p.stderr[-600:]}"})
            rows.append({**row, **{k: m[k] for k in ("device", "git_commit", "date")}})
            print("arm done:", json.dumps(rows[-1]), file=sys.stderr, flush=True)  # (progress)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    ref = next((r for r in rows if r["arm"] == "bf16" and "error" not in r), None)
    for r in rows:
        if ref is not None and r is not ref and "error" not in r:
            for key in [k for k in r if k.endswith("_decode_tok_s")]:
                r[f"{key}_vs_bf16"] = round(r[key] / ref[key], 3)
        print(json.dumps(r), flush=True)
    return rows


# --- kernels ----------------------------------------------------------------------------------
def kernels(m_meta: dict, ms=(1, 64)) -> list[dict]:
    import torch.nn.functional as F

    from radixlm.runtime.layers import int4_linear, triton_int4, triton_int4_gemm

    rows = []
    jobs = [(n, k, m, gemm_sweep(m, n, k)) for n, k in SHAPES.values() for m in ms if m > 1]
    t0 = time.perf_counter()
    failed = precompile(jobs)  # every GEMM config, 16 processes: the sweep then hits the cache
    print(json.dumps({"bench": "int4_gemm_precompile", "configs": sum(len(j[3]) for j in jobs),
                      "failed": len(failed), "s": round(time.perf_counter() - t0, 1)}),
          flush=True)
    for label, (n, k) in SHAPES.items():
        torch.manual_seed(0)
        copies = max(2, -(-COLD_BYTES // (n * k // 2)))
        w16 = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
               for _ in range(max(2, -(-COLD_BYTES // (2 * n * k))))]
        layers = [int4_linear.Int4Linear.quantize(w16[i % len(w16)], 128) for i in range(copies)]
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            row = {"bench": "int4_kernel", "shape": label, "N": n, "K": k, "M": m}
            bf = graph_time_us(lambda i: F.linear(x, w16[i % len(w16)]), len(w16))
            q4 = graph_time_us(lambda i: layers[i](x), copies)
            fn, sweep = ((triton_int4.gemv, GEMV_SWEEP) if m == 1
                         else (triton_int4_gemm.gemm, gemm_sweep(m, n, k)))
            if m > 1:
                row["int4_default_config"] = list(triton_int4_gemm.gemm_config(m, n, k, 128))
            best = (None, q4)
            for cfg in sweep:
                if (n, k, m, tuple(cfg)) in failed:  # did not compile or run: not retried
                    row.setdefault("sweep_errors", []).append([list(cfg), failed[n, k, m, cfg]])
                    continue
                try:
                    us = graph_time_us(lambda i, cfg=cfg: fn(x, layers[i].qweight, layers[i].scales,
                                                             layers[i].zeros, 128, config=cfg),
                                       copies)
                except Exception as e:  # noqa: BLE001 (a tile that does not compile: skipped)
                    row.setdefault("sweep_errors", []).append([list(cfg), str(e)[:120]])
                    continue
                if us < best[1]:
                    best = (list(cfg), us)
            ref = F.linear(x, layers[0].dequantized_weight(torch.bfloat16)).float()
            row.update({"bf16_cublas_us": round(bf, 2), "int4_default_us": round(q4, 2),
                        "int4_best_us": round(best[1], 2), "int4_best_config": best[0],
                        "speedup_default": round(bf / q4, 3),
                        "speedup_best": round(bf / best[1], 3),
                        # packed bytes only (fp16 scales + uint8 zeros add 2.3% at group 128)
                        "int4_weight_TBps": round(n * k / 2 / q4 / 1e6, 3),
                        "bf16_weight_TBps": round(2 * n * k / bf / 1e6, 3),
                        "rel_err_vs_dequant": round(float((layers[0](x).float() - ref).norm()
                                                          / ref.norm()), 5),
                        **{key: m_meta[key] for key in ("device", "git_commit", "date")}})
            if label == "gate_up" and m == 1:  # what llama's MLP runs: + SiLU-and-mul, fused
                row["int4_gate_up_silu_us"] = round(graph_time_us(
                    lambda i: layers[i].gate_up_silu(x), copies), 2)
            try:  # the same layers on torch's int4 kernel (layers/int4_torch.py)
                for lyr in layers:
                    lyr.use_torch_kernels()
                tq = graph_time_us(lambda i: layers[i](x), copies)
                row["torch_int4_us"] = round(tq, 2)
                row["speedup_torch_int4"] = round(bf / tq, 3)
                row["torch_int4_rel_err"] = round(float((layers[0](x).float() - ref).norm()
                                                        / ref.norm()), 5)
            except RuntimeError as e:  # an op this torch build or GPU lacks
                row["torch_int4_error"] = str(e).splitlines()[0][:160]
            for lyr in layers:  # back to Triton for the next M
                lyr.torch_packed = lyr.torch_sz = None
            print(json.dumps(row), flush=True)
            rows.append(row)
        w16.clear()
        layers.clear()
        torch.cuda.empty_cache()
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arms", nargs="+", default=list(DEFAULT_ARMS), choices=list(ARMS))
    ap.add_argument("--config", default=CONFIG_DIR, help="folder with the config.json")
    ap.add_argument("--tiny", action="store_true", help="a small config: a dry run (CPU ok)")
    ap.add_argument("--kernels", action="store_true", help="also the per-shape kernel timings")
    ap.add_argument("--no-e2e", action="store_true", help="skip the Engine arms")
    ap.add_argument("--ms", type=int, nargs="+", default=[1, 64],
                    help="batch sizes of the kernel part (each swept: GEMV tiles at 1, GEMM "
                         "tiles above)")
    ap.add_argument("--result-file", help="append the JSON lines here")
    ap.add_argument("--arm-child", choices=list(ARMS), help=argparse.SUPPRESS)  # e2e's child
    args = ap.parse_args(argv)
    if args.arm_child:
        print(json.dumps(e2e_arm(args.arm_child, args.config, args.tiny)), flush=True)
        return 0
    if not args.tiny and not torch.cuda.is_available():
        print("benchmarks/int4_decode.py needs a CUDA GPU (use --tiny for a CPU dry run)",
              file=sys.stderr)
        return 2
    m = meta("python " + " ".join(shlex.quote(a) for a in sys.argv))
    rows = [] if args.no_e2e else e2e(args, m)
    if args.kernels and torch.cuda.is_available():
        rows += kernels(m, tuple(args.ms))
    if args.result_file:
        with open(args.result_file, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
