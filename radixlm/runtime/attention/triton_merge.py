"""Shared-prefix decode's last step in one launch (Triton): merge each grouped row's attention over
its group's shared prefix into its attention over its own suffix, in place.

Why: decode_with_groups did it with ~12 torch kernels per layer (two gathers, the log-sum-exp
merge's elementwise ops, a scatter); grouped decode steps run eagerly (outside CUDA graphs), so at
256 requests the H100 profile of such a step showed ~40 ms of host time for ~18 ms of GPU work,
one launch at a time. Same math as shared_prefix.merge_states, in fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize_on_alignment=["Rows"])
def _merge_kernel(Out, Lse, Rows, OSh, LseSh, stride_ot, stride_oh, stride_lt, stride_st,
                  stride_sh, stride_slt, D: tl.constexpr, BLOCK_D: tl.constexpr):
    i = tl.program_id(0)  # packed grouped row
    h = tl.program_id(1)
    r = tl.load(Rows + i).to(tl.int64)  # its row in the batch
    offs = tl.arange(0, BLOCK_D)
    d_ok = offs < D
    lse_a = tl.load(LseSh + i * stride_slt + h)
    lse_b = tl.load(Lse + r * stride_lt + h)
    m = tl.maximum(lse_a, lse_b)
    m = tl.where(m == float("-inf"), 0.0, m)  # both empty: weights 0, output 0
    w_a = tl.exp(lse_a - m)
    w_b = tl.exp(lse_b - m)
    o_a = tl.load(OSh + i * stride_st + h * stride_sh + offs, mask=d_ok, other=0.0).to(tl.float32)
    o_ptr = Out + r * stride_ot + h * stride_oh + offs
    o_b = tl.load(o_ptr, mask=d_ok, other=0.0).to(tl.float32)
    w = w_a + w_b
    o = (o_a * w_a + o_b * w_b) / tl.where(w > 0, w, 1.0)
    tl.store(o_ptr, o.to(Out.dtype.element_ty), mask=d_ok)


def merge_prefix_into(out: torch.Tensor, lse: torch.Tensor, rows: torch.Tensor,
                      o_sh: torch.Tensor, lse_sh: torch.Tensor) -> torch.Tensor:
    """out (B, H, D) / lse (B, H) fp32: each row's attention over its own keys; o_sh (M, H, D) /
    lse_sh (M, H): packed row i's attention over its group's shared prefix, where rows (M,) int
    gives packed row i's batch row. Writes merged rows into out (lse is left as it was)."""
    m, h, d = o_sh.shape
    if m == 0:
        return out
    assert out.stride(2) == 1 and o_sh.stride(2) == 1 and lse.stride(1) == 1
    assert lse_sh.stride(1) == 1 and lse.dtype == lse_sh.dtype == torch.float32
    _merge_kernel[(m, h)](out, lse, rows, o_sh, lse_sh, out.stride(0), out.stride(1),
                          lse.stride(0), o_sh.stride(0), o_sh.stride(1), lse_sh.stride(0),
                          D=d, BLOCK_D=max(16, triton.next_power_of_2(d)), num_warps=1)
    return out
