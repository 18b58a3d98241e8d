"""GGUF weights kept quantized on the CPU (layers/quantized_linear.py) vs the dequantized path.

Two parts, one JSON line per format/shape plus one for the engine (`--result-file` appends them):
  kernel  y = x (M, K) @ W^T for W as GGUF blocks (the C++ kernel: `direct` FMA loop, `tiled` /
          `chunked` dequantize + BLAS GEMM; `path` is the one QuantizedLinear picks for that M)
          against today's CPU path, an fp32 GEMM on fp32 weights (layers/cpu_linear.py). Weights
          are cycled through enough copies to exceed the L3 cache, as in a real forward where
          every layer's weights come from DRAM once per step. Shapes: SmolLM2-135M's projections
          (Q4_1) and head (Q8_0), Llama-8B-like 4096 x 4096 in Q4_1, Q8_0, Q4_K, Q6_K.
  engine  the bundled SmolLM2-135M Q4_1 GGUF through the Engine, gguf_keep_quantized on vs off:
          batch-1 and batch-8 decode tok/s, and a 512-token prefill, alternating on/off rounds.

    python benchmarks/quantized_cpu.py --result-file benchmarks/results/quantized_cpu-cpu.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:  # run as a script: the repository's packages
    sys.path.insert(0, _ROOT)

from benchmarks.cpu_attention import git_commit, meta as attn_meta  # noqa: E402

from radixlm.runtime.layers import quant_kernels as qk, quantized_linear  # noqa: E402

COLD_BYTES = 96 << 20  # > 3x this CPU's 32 MiB L3: cycled weights come from DRAM
SHAPES = [  # (label, ggml type id, N out, K in)
    ("smollm2.qkv", 3, 960, 576), ("smollm2.gate_up", 3, 3072, 576),
    ("smollm2.down", 3, 576, 1536), ("smollm2.head", 8, 49152, 576),
    ("llama8b.4096x4096", 3, 4096, 4096), ("llama8b.4096x4096", 8, 4096, 4096),
    ("llama8b.4096x4096", 12, 4096, 4096), ("llama8b.4096x4096", 14, 4096, 4096),
]


def make_blocks(fmt: int, n: int, k: int, rng) -> torch.Tensor:
    """Random weights in GGUF blocks: gguf's quantizer for Q4_1 / Q8_0; random bytes with
    small fp16 scales for Q4_K / Q6_K (gguf-py has no quantizer for them; timing does not care)."""
    from gguf import GGMLQuantizationType, quants

    if fmt in (3, 8):
        w = (rng.standard_normal((n, k)) * 0.02).astype(np.float32)
        return torch.from_numpy(quants.quantize(w, GGMLQuantizationType(fmt)))
    nbytes, at = (144, 0) if fmt == 12 else (210, 208)  # where the fp16 scale(s) sit
    raw = rng.integers(0, 256, size=(n, k // 256, nbytes), dtype=np.uint8)
    scales = (rng.random((n, k // 256, 2 if fmt == 12 else 1)) * 1e-3).astype(np.float16)
    raw[..., at:at + scales.shape[-1] * 2] = scales.view(np.uint8)
    return torch.from_numpy(raw.reshape(n, -1))


def timed(fn, copies: list, reps: int) -> float:
    """Median ms of `reps` calls, each on the next copy of the weights (cold in cache)."""
    fn(copies[0])
    times = []
    for i in range(reps):
        t = time.perf_counter()
        fn(copies[(i + 1) % len(copies)])
        times.append(time.perf_counter() - t)
    return round(statistics.median(times) * 1e3, 4)


def run_kernel(label: str, fmt: int, n: int, k: int, ms: list[int], reps: int) -> dict:
    rng = np.random.default_rng(0)
    q0 = make_blocks(fmt, n, k, rng)
    ncopy = max(2, -(-COLD_BYTES // (n * k * 4)))
    w32 = [qk.dequant(q0, fmt, k) for _ in range(ncopy)]  # distinct tensors, same values
    wq = [q0.clone() for _ in range(ncopy)]
    out = {}
    for m in ms:
        x = torch.randn(m, k)
        r = max(3, min(reps, int(4e9 / (2 * m * n * k + 1e8))))  # fewer reps for big GEMMs
        fp32 = timed(lambda w: F.linear(x, w), w32, r)
        direct = timed(lambda w: qk.gemm(x, w, fmt, k), wq, r)
        tiled = timed(lambda w: qk.load().gemm_tiled(x, w, fmt, k), wq, r)
        chunked = timed(lambda w: qk.load().gemm_chunked(x, w, fmt, k), wq, r)
        path = ("direct" if m <= quantized_linear.DIRECT_MAX_M else
                "tiled" if m <= quantized_linear.TILED_MAX_M else "chunked")
        best = {"direct": direct, "tiled": tiled, "chunked": chunked}[path]
        out[f"M={m}"] = {"fp32_gemm_ms": fp32, "direct_ms": direct, "tiled_ms": tiled,
                         "chunked_ms": chunked, "path": path, "speedup": round(fp32 / best, 2)}
    name = qk.FORMATS[fmt][0]
    return {"benchmark": "quantized_cpu", "part": "kernel", "label": label, "format": name,
            "shape": {"N": n, "K": k}, "unit": "ms per matmul (median, cold weights)",
            "weight_bytes": {"fp32": n * k * 4, name: int(q0.numel())}, "results": out}


def run_engine(args) -> dict:
    import radixlm

    rng = np.random.default_rng(1)
    runs, outputs = [], {}
    for rnd, mode in enumerate(["off", "on", "on", "off"][: 2 * args.engine_rounds]):
        eng = radixlm.Engine(max_total_tokens=8000, context_length=2048, dtype=args.dtype,
                             gguf_keep_quantized=mode, disable_radix_cache=True)
        try:
            assert eng.runner.keep_quantized == (mode == "on")
            vocab = eng.runner.model_config.vocab_size

            def ids(n):
                return rng.integers(100, vocab - 100, size=n).tolist()

            sp = {"temperature": 0, "max_new_tokens": args.decode_len, "ignore_eos": True}
            eng.generate(input_ids=[ids(16)], sampling_params={**sp, "max_new_tokens": 4})
            row = {"mode": mode, "round": rnd + 1}
            for b in (1, 8):
                t = time.perf_counter()
                o = eng.generate(input_ids=[ids(16) for _ in range(b)], sampling_params=sp)
                wall = time.perf_counter() - t
                row[f"decode_b{b}_tok_s"] = round(b * args.decode_len / wall, 2)
                outputs.setdefault(mode, []).append([r["output_ids"] for r in o])
            t = time.perf_counter()
            eng.generate(input_ids=[ids(512)], sampling_params={**sp, "max_new_tokens": 1})
            row["prefill_512_s"] = round(time.perf_counter() - t, 3)
            row["load_avg_1m"] = os.getloadavg()[0]
            runs.append(row)
        finally:
            eng.shutdown()

    def med(mode, key):
        return statistics.median(r[key] for r in runs if r["mode"] == mode)

    keys = ("decode_b1_tok_s", "decode_b8_tok_s", "prefill_512_s")
    return {"benchmark": "quantized_cpu", "part": "engine", "weights": "SmolLM2-135M-Instruct "
            "Q4_1 GGUF (Q8_0 tied head)", "dtype": args.dtype,
            "workload": f"random ids, 16-token prompts, {args.decode_len} greedy tokens "
                        "(ignore_eos), batch 1 and 8; one 512-token prefill",
            "runs": runs, "median": {m: {k: med(m, k) for k in keys} for m in ("on", "off")},
            "speedup_on_vs_off": {"decode_b1": round(med("on", keys[0]) / med("off", keys[0]), 2),
                                  "decode_b8": round(med("on", keys[1]) / med("off", keys[1]), 2),
                                  "prefill_512": round(med("off", keys[2]) / med("on", keys[2]), 2)}}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ms", type=int, nargs="+", default=[1, 8, 16, 32, 64, 256, 512])
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--skip-kernel", action="store_true")
    p.add_argument("--formats", nargs="+", default=None, help="kernel part: only these formats")
    p.add_argument("--skip-engine", action="store_true")
    p.add_argument("--engine-rounds", type=int, default=2, help="rounds of (off, on) engines")
    p.add_argument("--decode-len", type=int, default=64)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--result-file", default=None)
    args = p.parse_args(argv)
    command = "python " + " ".join(map(shlex.quote, [os.path.relpath(__file__, _ROOT),
                                                     *(sys.argv[1:] if argv is None else argv)]))
    load_start = os.getloadavg()[0]
    docs = []
    if not args.skip_kernel:
        docs += [run_kernel(*s, args.ms, args.reps) for s in SHAPES
                 if args.formats is None or qk.FORMATS[s[1]][0] in args.formats]
    if not args.skip_engine:
        docs.append(run_engine(args))
    for doc in docs:
        doc.update(attn_meta(command), quant_isa=qk.load().isa(), load_avg_1m_start=load_start)
        doc["git_commit"] = git_commit()
        line = json.dumps(doc)
        print(line, flush=True)
        if args.result_file:
            with open(args.result_file, "a") as f:
                f.write(line + "\n")


if __name__ == "__main__":
    main()
