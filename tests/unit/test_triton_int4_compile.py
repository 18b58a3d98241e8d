"""The int4 Triton kernels (layers/triton_int4.py) compile for an H100 (sm_90) here, without a
GPU: Triton's interpreter (tests/unit/test_triton_int4.py) runs any Python the kernels hold, so a
construct the compiler refuses (a reshape, a dot's operand types, a non-constexpr global) would
first show on the GPU. Triton lowers to PTX and runs its bundled ptxas, which needs no device. A
fresh process: this session's triton may be imported with the interpreter on."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCRIPT = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from radixlm.runtime.layers import triton_int4 as T

target = GPUTarget("cuda", 90, 32)
common = {"QW": "*i32", "S": "*fp16", "Z": "*u8"}
bn, bk, warps, stages = T.gemv_config(4096, 4096)
gemv = {"X": "*bf16", **common, "B": "*bf16", "Y": "*bf16", "N": "i32", "K": "i32",
        "stride_qw": "i32", "stride_s": "i32", "GROUP": "constexpr", "SUB": "constexpr",
        "HAS_BIAS": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr",
        "NUM_STAGES": "constexpr"}
k = triton.compile(ASTSource(T._int4_gemv_kernel, gemv, {"GROUP": 128, "SUB": min(128, bk),
                   "HAS_BIAS": True, "BLOCK_N": bn, "BLOCK_K": bk, "NUM_STAGES": stages}),
                   target=target,
                   options={"num_warps": warps})
assert "cubin" in k.asm
gemm = {"X": "*bf16", **common, "B": "*bf16", "Y": "*bf16", "M": "i32", "N": "i32", "K": "i32",
        "stride_xm": "i32", "stride_ym": "i32", "stride_qw": "i32", "stride_s": "i32",
        "GROUP": "constexpr", "HAS_BIAS": "constexpr", "IEEE": "constexpr",
        "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr"}
for m, n in ((64, 4096), (512, 4096)):  # the decode-batch and the prefill tiles
    bm, bn, bk, warps, stages = T.gemm_config(m, n, 4096, 128)
    k = triton.compile(ASTSource(T._int4_gemm_kernel, gemm, {"GROUP": 128, "HAS_BIAS": False,
                       "IEEE": False, "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk}),
                       target=target, options={"num_warps": warps, "num_stages": stages})
    assert "cubin" in k.asm
print("compiled")
"""


def test_int4_kernels_compile_for_sm90():
    if importlib.util.find_spec("triton") is None or \
            importlib.util.find_spec("triton.backends.nvidia") is None:
        pytest.skip("no triton with its NVIDIA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    p = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=300)
    if "ptxas" in p.stderr and "not found" in p.stderr:
        pytest.skip("Triton's bundled ptxas is missing")
    assert p.returncode == 0 and "compiled" in p.stdout, p.stderr[-3000:]
