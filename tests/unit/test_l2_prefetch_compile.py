"""The L2 prefetch (layers/l2_prefetch.py) and the batch-1 GEMV's prefetching variants
(layers/triton_gemv.py: the next weight after the rows, PDL with each program's own rows before
it waits) compile for sm_90 here without a GPU, issuing the bulk prefetch from one thread, and
the share arithmetic covers the range in 16-byte multiples. Inline PTX does not run under the
interpreter; the GPU test (tests/gpu/test_triton_gemv_gpu.py) checks the results."""

from __future__ import annotations

import torch

from sm90_compile import run_sm90_script

SCRIPT = r"""
import triton
from triton.backends.compiler import GPUTarget
from radixlm.runtime.layers import l2_prefetch as L, triton_gemv as G

def compile_(fn, sig, consts, warps):
    s = dict(sig)
    s.update({k: "constexpr" for k in consts})
    return triton.compile(triton.compiler.ASTSource(fn=fn, signature=s, constexprs=consts),
                          target=GPUTarget("cuda", 90, 32), options={"num_warps": warps}).asm["ptx"]

PF = "cp.async.bulk.prefetch.L2.global"
ptx = compile_(L._prefetch_kernel, {"P": "*u8", "TOTAL": "i64"}, {"CHUNK_BYTES": L.CHUNK}, 1)
assert ptx.count(PF) == 1 and "setp.eq.u32 p, t, 0" in ptx
common = dict(X="*bf16", W="*bf16", Y="*bf16", N="i32", K="i32", stride_w="i32", NEXT="*u8",
              NEXT_TOTAL="i64", NEXT_SHARE="i64")
for fn, halves in ((G._gemv_kernel, 1), (G._gemv_silu_kernel, 2)):
    sig = dict(common, **({"B": "*bf16"} if halves == 1 else {}))
    for pf, pdl, own in ((False, False, False), (True, False, False), (False, True, False),
                         (False, True, True), (True, True, True)):
        consts = dict(BLOCK_N=8, BLOCK_K=256, EVEN_K=True, NUM_STAGES=4, PREFETCH=pf, PDL=pdl,
                      SELF_PREFETCH=own, **({"HAS_BIAS": False} if halves == 1 else {}))
        ptx = compile_(fn, sig, consts, 2)
        want = int(pf) + (halves if own else 0)
        assert ptx.count(PF) == want, (fn.__name__, pf, pdl, own, ptx.count(PF))
        assert ("griddepcontrol.wait" in ptx) == pdl
print("compiled")
"""


def test_prefetch_paths_compile_for_sm90():
    run_sm90_script(SCRIPT, "radixlm.runtime.layers.l2_prefetch")


def test_span_and_shares_cover_the_range():
    from radixlm.runtime.layers import l2_prefetch, triton_gemv

    t = torch.zeros(1004, dtype=torch.bfloat16)  # 2008 bytes: 2000 prefetched
    assert l2_prefetch.span(t, 1 << 20) == 2000
    assert l2_prefetch.span(t, 100) == 96
    for programs in (1, 3, 7, 125, 400):
        nxt, total, share, on = triton_gemv._prefetch_args((t, 1 << 20), programs, t)
        assert on and total == 2000 and share % 16 == 0
        assert share * programs >= total and (share - 16) * programs < total  # the least such
        assert nxt.dtype == torch.uint8 and nxt.numel() == 2008
    x = torch.zeros(4)
    assert triton_gemv._prefetch_args(None, 8, x) == (x, 0, 0, False)
    assert triton_gemv._prefetch_args((t, 8), 8, x)[3] is False  # under 16 bytes: nothing
