"""The int4 Triton kernels (layers/triton_int4.py) compile for an H100 (sm_90) here, without a
GPU: Triton's interpreter (tests/unit/test_triton_int4.py) runs any Python the kernels hold, so a
construct the compiler refuses (a reshape, a dot's operand types, a non-constexpr global) would
first show on the GPU. Triton lowers to PTX and runs its bundled ptxas, which needs no device. A
fresh process: this session's triton may be imported with the interpreter on."""

from __future__ import annotations

from sm90_compile import run_sm90_script

SCRIPT = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from radixlm.runtime.layers import triton_int4 as T, triton_int4_gemm as TG
from radixlm.runtime.layers import triton_int4_stream as TS

target = GPUTarget("cuda", 90, 32)
common = {"QW": "*i32", "S": "*fp16", "Z": "*u8", "P": "*i64"}
gemv = {"X": "*bf16", **common, "B": "*bf16", "Y": "*bf16", "WS": "*fp32", "CNT": "*i32",
        "N": "i32", "K": "i32", "blocks_per_split": "i32", "ws_stride": "i32",
        "stride_qw": "i32", "stride_s": "i32", "magic": "i32", "GROUP": "constexpr",
        "HAS_PERM": "constexpr", "HAS_BIAS": "constexpr", "SILU": "constexpr",
        "EVEN_K": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr",
        "NUM_STAGES": "constexpr", "PREFETCH": "constexpr", "SPLIT": "constexpr",
        "CACHE": "constexpr", "UNROLL": "constexpr", "LEAN": "constexpr",
        "XPAIRS": "constexpr", "FULL": "constexpr"}
# the defaults, then split-K: one-shot (stages 1), pipelined with the prefetch, and with
# the words prefetched in registers
for n, kk, silu, cfg in ((4096, 4096, False, None), (4096, 14336, False, None),
                         (28672, 4096, True, None), (4096, 14336, False, (2, 2048, 2, 1, 0, 7)),
                         (28672, 4096, True, (4, 1024, 1, 4, 1, 2)),
                         (4096, 14336, False, (4, 1024, 1, 1, 2, 2))):
    knobs = T._gemv_knobs(cfg or T.gemv_config(n, kk))
    bn, bk, warps, stages, prefetch, split, cache = knobs[:7]
    for perm in ((False, True) if cfg is None else (True,)):
        k = triton.compile(ASTSource(T._int4_gemv_kernel, gemv, {
            "GROUP": 128, "HAS_PERM": perm, "HAS_BIAS": not silu, "SILU": silu,
            "EVEN_K": kk % bk == 0,
            "BLOCK_N": bn, "BLOCK_K": bk, "NUM_STAGES": stages,
            "PREFETCH": max(int(perm), prefetch),  # (both variants, not doubling compiles)
            "SPLIT": split > 1, "CACHE": cache, "UNROLL": 1, "LEAN": False, "XPAIRS": False,
            "FULL": False},
            {(i,): [["tt.divisibility", 16]] for i in range(16) if i != 11}),
            target=target, options={"num_warps": warps})
        assert "cubin" in k.asm
# the streaming knobs (triton_int4._gemv_knobs) on the sweep's family (4 rows, BLOCK_K 2048,
# 2 warps, 1 stage): each word load stays one 128-bit load a thread and takes the cache
# operator asked for; UNROLL 2 copies the loop body (3 times the word loads: the unrolled
# pair and the remainder loop); MAXNREG reaches ptxas; LEAN with x as int32 pairs (the
# second) keeps x's loads 64-bit and out of shared memory (a layout conversion there would
# need shared memory: 1 KB a program, where the reduction alone takes 32 bytes)
div = {(i,): [["tt.divisibility", 16]] for i in range(16) if i != 11}
for cache, unroll, maxnreg, want in ((1, 1, None, "ld.global.cg.v4.b32"),
                                     (2, 2, 96, "ld.global.L1::evict_first.L2::cache_hint.v4")):
    k = triton.compile(ASTSource(T._int4_gemv_kernel, gemv, {
        "GROUP": 128, "HAS_PERM": False, "HAS_BIAS": False, "SILU": False, "EVEN_K": True,
        "BLOCK_N": 4, "BLOCK_K": 2048, "NUM_STAGES": 1, "PREFETCH": 0, "SPLIT": False,
        "CACHE": cache, "UNROLL": unroll, "LEAN": unroll == 2, "XPAIRS": unroll == 2,
        "FULL": unroll == 2}, div),
        target=target,
        options={"num_warps": 2, "maxnreg": maxnreg})
    ptx = k.asm["ptx"]
    assert ptx.count(want) == 4 * (3 if unroll == 2 else 1), (want, ptx.count(want))
    assert maxnreg is None or f".maxnreg {maxnreg}" in ptx
    assert ptx.count("ld.global.v2.b32") == 8 * (3 if unroll == 2 else 1)  # x: 4 values
    assert k.metadata.shared <= 32, k.metadata.shared
# the persistent stream (triton_int4_stream): plain, and [gate | up] with the SiLU epilogue,
# act-order and 64-bit offsets; its word loads (the first step's, the next one's in the loop)
stream = {"X": "*bf16", **common, "B": "*bf16", "Y": "*bf16", "N": "i32", "K": "i32",
          "stride_qw": "i32", "stride_s": "i32", "magic": "i32", "GROUP": "constexpr",
          "HAS_PERM": "constexpr", "HAS_BIAS": "constexpr", "SILU": "constexpr",
          "BLOCK_N": "constexpr", "BLOCK_K": "constexpr", "CACHE": "constexpr",
          "LEAN": "constexpr", "XPAIRS": "constexpr", "EVEN_K": "constexpr",
          "WIDE": "constexpr"}
for silu in (False, True):
    k = triton.compile(ASTSource(TS._int4_gemv_stream_kernel, stream, {
        "GROUP": 128, "HAS_PERM": silu, "HAS_BIAS": not silu, "SILU": silu, "BLOCK_N": 4,
        "BLOCK_K": 2048, "CACHE": 2, "LEAN": True, "XPAIRS": not silu, "EVEN_K": True,
        "WIDE": silu},
        {(i,): [["tt.divisibility", 16]] for i in range(11)}),
        target=target, options={"num_warps": 2})
    assert k.asm["ptx"].count("ld.global.L1::evict_first.L2::cache_hint.v4") == 8
gemm = {"X": "*bf16", **common, "B": "*bf16", "Y": "*bf16", "WS": "*fp32", "CNT": "*i32",
        "M": "i32", "N": "i32", "K": "i32", "words_per_split": "i32",
        "stride_xm": "i32", "stride_ym": "i32", "stride_qw": "i32", "stride_s": "i32",
        "magic": "i32",
        "GROUP": "constexpr", "HAS_PERM": "constexpr", "HAS_BIAS": "constexpr",
        "IEEE": "constexpr", "EVEN_K": "constexpr", "BLOCK_M": "constexpr",
        "BLOCK_N": "constexpr", "BLOCK_K": "constexpr", "SPLIT_K": "constexpr"}
# the decode-batch tiles (M 16 / 32 / 64) and the prefill tile; group 128 (one group a step) and
# group 32 (a group per word row)
# (split-K at N = 4096 and 6144, none at 28672 and for prefill)
for m, n, group in ((64, 4096, 128), (16, 28672, 128), (32, 6144, 128), (512, 4096, 128),
                    (64, 4096, 32)):
    bm, bn, bk, warps, stages, split = TG.gemm_config(m, n, 4096, group)
    k = triton.compile(ASTSource(TG._int4_gemm_kernel, gemm, {
        "GROUP": group, "HAS_PERM": group == 32, "HAS_BIAS": False, "IEEE": False,
        "EVEN_K": True, "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": split},
        # the JIT's specialization at these shapes: pointers, sizes and strides all multiples
        # of 16 (it decides the vector widths, and so which loads are cp.async-pipelined)
        {(i,): [["tt.divisibility", 16]] for i in range(18)}),
        target=target, options={"num_warps": warps, "num_stages": stages})
    assert "cubin" in k.asm
    assert k.metadata.shared <= 227 * 1024, (m, n, k.metadata.shared)  # an H100 SM's limit
    assert (split > 1) == (n <= 6144 and m <= 64), (m, n, split)
# the batch-1 GEMV over TMA (triton_int4_tma) at its default config, plain and [gate | up]:
# the words, scales and zeros come by TMA (cp.async.bulk.tensor, pipelined: the loop's loads
# appear once for the prologue's stages and once in the loop), no spills
from radixlm.runtime.layers import triton_int4_tma as TT
bn, bk, warps, stages, _ = TT.DEFAULT
for silu, kk in ((False, 14336), (True, 4096)):
    tma = {"X": "*bf16", "qd": f"tensordesc<i32[{bn}, {bk // 8}]>",
           "sd": f"tensordesc<fp16[{bk // 128}, {bn}]>", "zd": f"tensordesc<u8[{bk // 128}, {bn}]>",
           "P": "*i64", "B": "*bf16", "Y": "*bf16", "N_OUT": "i32", "magic": "i32",
           **{c: "constexpr" for c in ("K", "GROUP", "HAS_PERM", "HAS_BIAS", "SILU", "BLOCK_N",
                                       "BLOCK_K", "NUM_STAGES", "XPAIRS", "MATH")}}
    k = triton.compile(ASTSource(TT._int4_gemv_tma_kernel, tma, {
        "K": kk, "GROUP": 128, "HAS_PERM": silu, "HAS_BIAS": not silu, "SILU": silu,
        "BLOCK_N": bn, "BLOCK_K": bk, "NUM_STAGES": stages, "XPAIRS": not silu, "MATH": True},
        {(0,): [["tt.divisibility", 16]], (6,): [["tt.divisibility", 16]]}),
        target=target, options={"num_warps": warps})
    assert k.asm["ptx"].count("cp.async.bulk.tensor.2d") >= 3 * 2, "TMA loads"
    assert k.metadata.shared <= 64 * 1024, k.metadata.shared
print("compiled")
"""


def test_int4_kernels_compile_for_sm90():
    run_sm90_script(SCRIPT)
