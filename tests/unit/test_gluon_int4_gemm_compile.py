"""The int4 wgmma GEMM (layers/gluon_int4_gemm.py, Gluon) compiles for an H100 / H200 (sm_90a)
here, without a GPU. Gluon kernels do not run under Triton's interpreter, so this is where its
layout reasoning is checked off the GPU: the dequantized words must already sit in wgmma's A
register layout (the kernel asserts that conversion trivial, a compile error otherwise), the
x^T tile's slot permutation must lower, and the MMAs must be wgmma (HGMMA in the SASS, A from
registers), chained without a wait between the steps of a group under ASYNC. A fresh process:
this session's triton may be imported with the interpreter on."""

from __future__ import annotations

from sm90_compile import run_sm90_script

SCRIPT = r"""
import inspect
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from radixlm.runtime.layers import gluon_int4_gemm as G

kernel = G._int4_gemm_wgmma_kernel
names = list(inspect.signature(kernel.fn).parameters)
# (K, GROUP, BM, WARPS, RREP, STEP, ASYNC, SPLIT_K, HAS_BIAS, HAS_PERM, BF16, MAXNREG)
CASES = [(4096, 128, 64, 8, 1, 64, False, 1, False, False, True, 128),
         (4096, 128, 16, 8, 1, 128, False, 4, True, False, True, None),
         (14336, 128, 64, 8, 1, 32, True, 4, False, False, True, None),
         (2048, 64, 32, 4, 2, 32, True, 2, True, True, False, None),
         (1024, 32, 64, 4, 1, 32, False, 1, False, True, False, None)]
for k, group, bm, warps, rrep, step, asy, split, bias, perm, bf16, maxnreg in CASES:
    consts = {"K": k, "GROUP": group, "BM": bm, "RREP": rrep, "STEP": step, "ASYNC": asy,
              "SPLIT_K": split, "HAS_BIAS": bias, "HAS_PERM": perm, "BF16": bf16,
              "num_warps": warps}
    dt = "bf16" if bf16 else "fp16"
    types = {"X": "*" + dt, "WD": "*i32", "S": "*fp16", "Z": "*u8", "P": "*i64", "B": "*" + dt,
             "Y": "*" + dt, "WS": "*fp32", "CNT": "*i32"}
    sig = {n: types.get(n, "constexpr" if n in consts else "i32") for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if sig[n] != "constexpr" and n not in ("M", "groups_per_split")}
    opts = {"num_warps": warps, **({"maxnreg": maxnreg} if maxnreg else {})}
    kern = triton.compile(GluonASTSource(kernel, sig, consts, attrs),
                          target=GPUTarget("cuda", 90, 32), options=opts)
    ptx = kern.asm["ptx"]
    kind = "bf16" if bf16 else "f16"
    # A from registers: wgmma's A operand is a brace list of 4 registers, not a descriptor
    assert f"wgmma.mma_async.sync.aligned.m64n{bm}k16.f32.{kind}.{kind} " in ptx, (k, bm)
    assert "sub.rn.%sx2" % kind in ptx
    mmas = ptx.count("wgmma.mma_async")
    waits = ptx.count("wgmma.wait_group")
    assert mmas >= rrep * step // 16, (mmas, step)
    if asy:  # one wait a group (and the prologue's / epilogue's at most), not one a step
        assert waits <= 2 + (0 if group == step else 0), (waits, group, step)
print("compiled")
"""


def test_gluon_int4_gemm_compiles_for_sm90():
    run_sm90_script(SCRIPT, "triton.experimental.gluon")
