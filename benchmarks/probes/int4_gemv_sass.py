"""What the int4 GEMV (layers/triton_int4.gemv) compiles to on an H100 (sm_90), without a GPU.

A diagnostic (prints, no result file): for each config, the kernel Triton builds at a
Llama-3.1-8B shape (the JIT's specialization: every pointer, size and stride a multiple of 16),
lowered by Triton's bundled ptxas; one JSON line a config with its registers a thread, stack
(spills), shared memory, the SASS instruction count of the K loop's body (the instructions a
step: 128 values a thread at 4 rows x 2048, 256 at 8 rows) and that body's opcode histogram,
and the global loads by width. The loop body is the code between a backward branch and its
target (the persistent kernel's includes its tile-end reduction, skipped on most steps).

    python benchmarks/probes/int4_gemv_sass.py                  # the defaults and LEAN
    python benchmarks/probes/int4_gemv_sass.py --shape down --config 4 2048 2 1 2 1 0 1 0 0 1

Findings this was written for (2026-11-27, Triton 3.7): the default at K = 4096 (4 rows x
2048, 2 warps, 1 stage) loads the words with one LDG.E.128 a row a step (4 a thread), x with
8 LDG.E.64, zeros / scales one LDG.U8 / U16 a row; no shared memory in the loop (the 11
convert_layouts of the TTGIR are trivial), 128 registers (8 programs of 64 threads an SM);
649 instructions a step for 128 values (~5.1 a value against the 3 of LOP3 + FADD + FFMA);
LEAN: 539, 96 registers."""

from __future__ import annotations

import argparse
import collections
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

SHAPES = {"qkv": (6144, 4096, False), "o": (4096, 4096, False),
          "gate_up_silu": (28672, 4096, True), "down": (4096, 14336, False)}
TYPES = {"X": "*bf16", "QW": "*i32", "S": "*fp16", "Z": "*u8", "P": "*i64", "B": "*bf16",
         "Y": "*bf16", "WS": "*fp32", "CNT": "*i32"}


def _compile(kernel, consts: dict, warps: int, maxnreg: int):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = list(inspect.signature(kernel.fn).parameters)
    sig = {n: TYPES.get(n, "constexpr" if n in consts else "i32") for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if sig[n] != "constexpr" and n != "blocks_per_split"}
    return triton.compile(ASTSource(kernel, sig, consts, attrs),
                          target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": warps, "maxnreg": maxnreg or None})


def describe(shape: str, config) -> dict:
    import triton

    from radixlm.runtime.layers import triton_int4 as T
    from radixlm.runtime.layers import triton_int4_stream as TS

    n, k, silu = SHAPES[shape]
    n_out = n // 2 if silu else n
    (bn, bk, warps, stages, prefetch, split, cache, unroll, maxnreg, persist,
     lean) = T._gemv_knobs(config or T.gemv_config(n, k))
    common = {"GROUP": 128, "HAS_PERM": False, "HAS_BIAS": False, "SILU": silu,
              "BLOCK_N": bn, "BLOCK_K": bk, "CACHE": cache, "LEAN": lean, "XPAIRS": lean}
    if persist:
        kern = _compile(TS._int4_gemv_stream_kernel,
                        {**common, "EVEN_K": lean and k % bk == 0, "WIDE": False}, warps,
                        maxnreg)
    else:
        kern = _compile(T._int4_gemv_kernel, {
            **common, "EVEN_K": k % bk == 0, "NUM_STAGES": stages, "PREFETCH": prefetch,
            "SPLIT": split > 1, "UNROLL": unroll,
            "FULL": lean and k % bk == 0 and n_out % bn == 0}, warps, maxnreg)
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                        "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kern.asm["cubin"])
        f.flush()
        sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True).stdout
        res = subprocess.run([tool, "-res-usage", f.name], capture_output=True,
                             text=True).stdout
    ins = [(int(m.group(1), 16), m.group(2)) for m in
           re.finditer(r"/\*([0-9a-f]{4,})\*/\s*([^;]*);", sass)]
    body = []
    for addr, text in ins:
        b = re.search(r"BRA (0x[0-9a-f]+)", text)
        if b and int(b.group(1), 16) < addr and not body:  # the first backward branch
            body = [t for a, t in ins if int(b.group(1), 16) <= a <= addr]
    ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0] for t in body)
    return {"shape": shape, "config": [bn, bk, warps, stages, prefetch, split, cache, unroll,
                                       maxnreg, persist, int(lean)],
            "regs": int(re.search(r"REG:(\d+)", res).group(1)),
            "stack": int(re.search(r"STACK:(\d+)", res).group(1)),
            "shared": kern.metadata.shared, "instructions": len(ins),
            "loop_body": len(body), "loop_ops": dict(ops.most_common()),
            "loads": dict(collections.Counter(re.findall(r"\bLDG[.\w]*", sass)))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--config", nargs="+", type=int, default=None,
                    help="a config tuple (4 to 11 values); default: gemv_config, then LEAN")
    args = ap.parse_args(argv)
    os.environ.pop("TRITON_INTERPRET", None)
    from radixlm.runtime.layers import triton_int4 as T

    for shape in args.shape:
        n, k, _ = SHAPES[shape]
        cfgs = [tuple(args.config)] if args.config else \
            [T.gemv_config(n, k), tuple(T._gemv_knobs(T.gemv_config(n, k)))[:10] + (1,)]
        for cfg in cfgs:
            print(json.dumps(describe(shape, cfg)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
