"""Routed experts as two grouped GEMMs over (token, expert) pairs sorted by expert (Triton).

Why: models/moe.Experts' eager path loops over experts in Python after one host sync per layer
(the per-expert counts), which a CUDA graph cannot capture; its capture fallback ran every expert
on every token, a Python loop of E experts: at batch 1 it read all 64 of DeepSeek-V2-Lite's
experts instead of the 6 routed ones (10x the bytes of the roofline) and put ~6 E kernels per
layer into the graph. Here every shape comes from (T, k, E) alone and nothing syncs:
- routing (torch, `route_blocks`): the T*k pairs ordered by expert (prefix sums of a (T*k, E)
  one-hot, no sort); expert e's pairs padded to whole blocks of BLOCK_M rows (per model,
  `block_m_for`); block b -> (its expert or -1, its first sorted row, its expert's row end).
  NB = ceil(T*k / BLOCK_M) + E blocks bound any routing; the unused ones have expert -1 and run
  zero loop trips, so they read no weight.
- stage 1, grid (NB, ceil(I / BLOCK_N)): h = silu(x W_gate^T) * (x W_up^T) for the block's rows
  (each row a gathered token), (BLOCK_M, BLOCK_N) per program; h (T*k, I) in sorted order.
- stage 2, grid (NB, ceil(H / BLOCK_N)): y = h W_down^T, times the pair's routing weight, cast
  to the model dtype, stored at the pair's own row of contrib (T*k, H).
The caller sums each token's k rows in ascending expert order (HF's order of addition).
Roundings follow HF's module by module (gate, up, silu, product and down output each rounded to
the model dtype; the weight product in fp32, then rounded), so the result equals the eager path
up to GEMM accumulation order. A row's result does not depend on the other rows in its block
(BLOCK_M only pads), so a graph's padded batch gives its real rows the eager values.
Untuned (block sizes and warps are first guesses) and unmeasured on a GPU.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from radixlm.runtime.attention.triton_decode import dot_dtype, dot_precision

ENABLED = os.environ.get("RADIXLM_DISABLE_TRITON_MOE", "") in ("", "0")
BLOCK_N, BLOCK_K = 64, 64


def block_m_for(n_experts: int, top_k: int, typical_batch: int = 128) -> int:
    """Rows per block, fixed per model (not per call: a graph's padded batch and the eager batch
    must tile alike): about the pairs an expert gets at a typical decode batch, 16..64. Each
    block reads its expert's whole weights, so too small a block re-reads them (Mixtral, 8
    experts top-2: 32 pairs each at batch 128) and too large wastes MMA rows (DeepSeek-V2-Lite,
    64 experts top-6: 12; V3, 256 top-8: 4)."""
    want = typical_batch * top_k // max(1, n_experts)
    return min(64, max(16, triton.next_power_of_2(max(1, want))))


@triton.jit
def _silu_rounded(g, u, OUT: tl.constexpr):
    """HF's silu(gate) * up in the model dtype: each step rounded as torch rounds it."""
    g = g.to(OUT).to(tl.float32)
    u = u.to(OUT).to(tl.float32)
    s = (g / (1.0 + tl.exp(-g))).to(OUT).to(tl.float32)
    return (s * u).to(OUT)


@triton.jit
def _gate_up_kernel(X, W, Hbuf, Pairs, BlkExpert, BlkStart, BlkEnd, H, I, TOPK,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    DOT: tl.constexpr, PREC: tl.constexpr):
    b = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    e = tl.load(BlkExpert + b)
    start = tl.load(BlkStart + b)
    rows = start + tl.arange(0, BLOCK_M)  # sorted positions
    r_ok = rows < tl.load(BlkEnd + b)
    tok = tl.load(Pairs + rows, mask=r_ok, other=0) // TOPK  # (BLOCK_M,) gathered tokens
    n_ok = n < I
    offs_k = tl.arange(0, BLOCK_K)
    w_base = W + tl.maximum(e, 0).to(tl.int64) * (2 * I * H)  # W (E, 2I, H): [gate | up] rows
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    k_end = tl.where(e >= 0, H, 0)  # an unused block reads nothing
    for k0 in range(0, k_end, BLOCK_K):
        k = k0 + offs_k
        k_ok = k < H
        x = tl.load(X + tok[:, None].to(tl.int64) * H + k[None, :],
                    mask=r_ok[:, None] & k_ok[None, :], other=0.0).to(DOT)  # (BLOCK_M, BLOCK_K)
        wg = tl.load(w_base + n[None, :] * H + k[:, None], mask=n_ok[None, :] & k_ok[:, None],
                     other=0.0).to(DOT)  # (BLOCK_K, BLOCK_N)
        wu = tl.load(w_base + (n[None, :] + I) * H + k[:, None],
                     mask=n_ok[None, :] & k_ok[:, None], other=0.0).to(DOT)
        acc_g = tl.dot(x, wg, acc_g, input_precision=PREC)
        acc_u = tl.dot(x, wu, acc_u, input_precision=PREC)
    h = _silu_rounded(acc_g, acc_u, Hbuf.dtype.element_ty)
    tl.store(Hbuf + rows[:, None].to(tl.int64) * I + n[None, :], h,
             mask=r_ok[:, None] & n_ok[None, :] & (e >= 0))


@triton.jit
def _down_kernel(Hbuf, W, Out, Pairs, Wts, BlkExpert, BlkStart, BlkEnd, H, I,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 DOT: tl.constexpr, PREC: tl.constexpr):
    b = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # output (hidden) columns
    e = tl.load(BlkExpert + b)
    rows = tl.load(BlkStart + b) + tl.arange(0, BLOCK_M)
    r_ok = rows < tl.load(BlkEnd + b)
    pair = tl.load(Pairs + rows, mask=r_ok, other=0)
    n_ok = n < H
    offs_k = tl.arange(0, BLOCK_K)
    w_base = W + tl.maximum(e, 0).to(tl.int64) * (H * I)  # W (E, H, I)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    k_end = tl.where(e >= 0, I, 0)
    for k0 in range(0, k_end, BLOCK_K):
        k = k0 + offs_k
        k_ok = k < I
        h = tl.load(Hbuf + rows[:, None].to(tl.int64) * I + k[None, :],
                    mask=r_ok[:, None] & k_ok[None, :], other=0.0).to(DOT)
        wd = tl.load(w_base + n[None, :] * I + k[:, None], mask=n_ok[None, :] & k_ok[:, None],
                     other=0.0).to(DOT)  # (BLOCK_K, BLOCK_N)
        acc = tl.dot(h, wd, acc, input_precision=PREC)
    wt = tl.load(Wts + pair, mask=r_ok, other=0.0).to(tl.float32)  # (BLOCK_M,)
    y = acc.to(Out.dtype.element_ty).to(tl.float32) * wt[:, None]
    tl.store(Out + pair[:, None].to(tl.int64) * H + n[None, :], y.to(Out.dtype.element_ty),
             mask=r_ok[:, None] & n_ok[None, :] & (e >= 0))


def route_blocks(flat: torch.Tensor, n_experts: int, block_m: int):
    """flat (P,) expert of each pair -> (pairs in expert order (P,), block expert (NB,) int32 with
    -1 for unused blocks, block first sorted row (NB,), block row end (NB,)), NB from shapes
    only. Elementwise ops and prefix sums only: no host sync (bincount and one_hot read the
    data's range on the host) and no sort kernel inside a graph capture; pairs of one expert
    keep their pair order (as a stable sort would)."""
    p = flat.shape[0]
    dev = flat.device
    hit = (flat[:, None] == torch.arange(n_experts, device=dev)).to(torch.int32)  # (P, E)
    seen = torch.cumsum(hit, 0)  # (P, E): pairs of expert e up to and including row p
    counts = seen[-1].to(torch.int64)  # (E,)
    cum_rows = torch.cumsum(counts, 0)
    rank = seen.gather(1, flat[:, None])[:, 0].to(torch.int64) - 1  # within its expert
    pos = (cum_rows - counts)[flat] + rank  # (P,) its sorted position
    order = torch.empty_like(flat).scatter_(0, pos, torch.arange(p, device=dev))
    blocks = (counts + block_m - 1) // block_m  # (E,)
    cum_blocks = torch.cumsum(blocks, 0)
    nb = triton.cdiv(p, block_m) + n_experts
    b = torch.arange(nb, device=dev)
    e = torch.searchsorted(cum_blocks, b, right=True)  # (NB,) E past the last used block
    e_c = e.clamp(max=n_experts - 1)
    start = cum_rows[e_c] - counts[e_c] + (b - (cum_blocks[e_c] - blocks[e_c])) * block_m
    expert = torch.where(e < n_experts, e_c, -1).to(torch.int32)
    return order, expert, start, cum_rows[e_c]


def experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, idx: torch.Tensor,
            w: torch.Tensor, block_m: int = 0) -> torch.Tensor:
    """x (T, H); gate_up (E, 2I, H) rows [gate | up]; down (E, H, I); idx (T, k) experts, each
    token's in ascending order; w (T, k) weights (fp32 or the model dtype) -> (T, H).
    block_m 0: block_m_for(E, k)."""
    t, k = idx.shape
    n_exp, two_i, hid = gate_up.shape
    inter = two_i // 2
    assert x.is_contiguous() and gate_up.is_contiguous() and down.is_contiguous()
    if t == 0:
        return x.new_zeros(0, hid)
    block_m = block_m or block_m_for(n_exp, k)
    order, expert, start, end = route_blocks(idx.reshape(-1), n_exp, block_m)
    h = x.new_empty(t * k, inter)  # sorted order
    contrib = x.new_empty(t * k, hid)  # pair order
    wts = w.reshape(-1).contiguous()
    dt = dot_dtype(x.dtype, gate_up.dtype)
    nb = expert.shape[0]
    common = dict(BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, DOT=dt,
                  PREC=dot_precision(dt), num_warps=4)
    _gate_up_kernel[(nb, triton.cdiv(inter, BLOCK_N))](
        x, gate_up, h, order, expert, start, end, hid, inter, k, **common)
    _down_kernel[(nb, triton.cdiv(hid, BLOCK_N))](
        h, down, contrib, order, wts, expert, start, end, hid, inter, **common)
    contrib = contrib.view(t, k, hid)
    out = contrib[:, 0]
    for j in range(1, k):  # ascending expert order per token, as HF's index_add
        out = out + contrib[:, j]
    return out
