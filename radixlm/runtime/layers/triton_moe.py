"""Routed experts as two grouped GEMMs over (token, expert) pairs sorted by expert (Triton).

Why: models/moe.Experts' eager path loops over experts in Python after one host sync per layer
(the per-expert counts), which a CUDA graph cannot capture; its capture fallback ran every expert
on every token, a Python loop of E experts: at batch 1 it read all 64 of DeepSeek-V2-Lite's
experts instead of the 6 routed ones (10x the bytes of the roofline) and put ~6 E kernels per
layer into the graph. Here every shape comes from (T, k, E) alone and nothing syncs:
- routing (`route_blocks`, one single-program kernel): the T*k pairs ordered by expert (a
  counting sort); expert e's pairs padded to whole blocks of BLOCK_M rows (per model,
  `block_m_for`); block b -> (its expert or -1, its first sorted row, its expert's row end).
  NB = ceil(T*k / BLOCK_M) + E blocks bound any routing; the unused ones have expert -1 and run
  zero loop trips, so they read no weight.
- stage 1, grid (NB, ceil(I / BLOCK_N)): h = silu(x W_gate^T) * (x W_up^T) for the block's rows
  (each row a gathered token), (BLOCK_M, BLOCK_N) per program; h (T*k, I) in sorted order.
- stage 2, grid (NB, ceil(H / BLOCK_N)): y = h W_down^T, times the pair's routing weight, cast
  to the model dtype, stored at the pair's own row of contrib (T*k, H).
A third kernel sums each token's k rows in ascending expert order (HF's order of addition).
Roundings follow HF's module by module (gate, up, silu, product and down output each rounded to
the model dtype; the weight product in fp32, then rounded), so the result equals the eager path
up to GEMM accumulation order. A row's result does not depend on the other rows in its block
(BLOCK_M only pads), so a graph's padded batch gives its real rows the eager values.
Block sizes and warps: measured, see BLOCK_N below.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from radixlm.runtime.attention.triton_decode import dot_dtype, dot_precision

ENABLED = os.environ.get("RADIXLM_DISABLE_TRITON_MOE", "") in ("", "0")
# one config for every batch (BLOCK_K sets a row's summation order: graphs and eager must agree);
# benchmarks/probes/moe_block_sweep.py on an H200, V2-Lite's shapes (2026-11-28): BLOCK_K 128
# against 64: batch 1 47.2 vs 52.2 us a layer, batch 128 310 vs 318 us; BLOCK_N and warps
# within 2% (benchmarks/results/moe_block_sweep-h200.jsonl)
BLOCK_N, BLOCK_K = 64, 128
NUM_WARPS, NUM_STAGES = 4, 3


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


@triton.jit
def _route_kernel(Flat, Order, BlkExpert, BlkStart, BlkEnd, Scratch, P, E, NB,
                  BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, CH: tl.constexpr):
    # one program: a counting sort of the P pairs by expert (CH pairs at a time against all
    # E_PAD experts), then the block table; see route_blocks
    ee = tl.arange(0, E_PAD)
    cp = tl.arange(0, CH)
    counts = tl.zeros([E_PAD], tl.int32)
    for c in range(0, P, CH):
        f = tl.load(Flat + c + cp, mask=c + cp < P, other=-1).to(tl.int32)
        counts += tl.sum((f[:, None] == ee[None, :]).to(tl.int32), axis=0)
    incl = tl.cumsum(counts, axis=0)  # (E_PAD,) expert e's rows end here
    first = incl - counts
    run = tl.zeros([E_PAD], tl.int32)  # pairs of each expert placed so far
    for c in range(0, P, CH):
        p = c + cp
        f = tl.load(Flat + p, mask=p < P, other=-1).to(tl.int32)
        hit = (f[:, None] == ee[None, :]).to(tl.int32)  # (CH, E_PAD)
        earlier = tl.cumsum(hit, axis=0) - hit  # its expert's pairs before it in the chunk
        pos = tl.sum(hit * ((first + run)[None, :] + earlier), axis=1)  # (CH,) sorted row
        tl.store(Order + pos, p.to(Order.dtype.element_ty), mask=p < P)
        run += tl.sum(hit, axis=0)
    blocks = (counts + BLOCK_M - 1) // BLOCK_M
    cum_blocks = tl.cumsum(blocks, axis=0)
    e_ok = ee < E
    # per-expert tables through memory, to gather them by a block's expert
    tl.store(Scratch + ee, first, mask=e_ok)
    tl.store(Scratch + E_PAD + ee, incl, mask=e_ok)
    tl.store(Scratch + 2 * E_PAD + ee, cum_blocks - blocks, mask=e_ok)
    tl.debug_barrier()
    cum_used = tl.where(e_ok, cum_blocks, 1 << 30)  # (padding experts never count)
    for c in range(0, NB, CH):
        b = c + cp
        e = tl.sum((cum_used[None, :] <= b[:, None]).to(tl.int32), axis=1)  # searchsorted
        e_c = tl.minimum(e, E - 1)
        start = tl.load(Scratch + e_c) + (b - tl.load(Scratch + 2 * E_PAD + e_c)) * BLOCK_M
        ok = b < NB
        tl.store(BlkExpert + b, tl.where(e < E, e_c, -1), mask=ok)
        tl.store(BlkStart + b, start.to(BlkStart.dtype.element_ty), mask=ok)
        tl.store(BlkEnd + b, tl.load(Scratch + E_PAD + e_c).to(BlkEnd.dtype.element_ty),
                 mask=ok)


def route_blocks(flat: torch.Tensor, n_experts: int, block_m: int):
    """flat (P,) expert of each pair -> (pairs in expert order (P,), block expert (NB,) int32 with
    -1 for unused blocks, block first sorted row (NB,), block row end (NB,)), NB from shapes
    only. One kernel (`_route_kernel`, a counting sort in one program): no host sync, so a
    CUDA graph captures it; pairs of one expert keep their pair order (as a stable sort
    would). It replaced ~20 torch kernels (one-hot, prefix sums, gathers, a scatter, a
    searchsorted); with the slot sums in one kernel (`_sum_slots_kernel`, was k - 1 adds)
    DeepSeek-V2-Lite's batch-1 decode went 160 -> 211 tok/s on an H200."""
    p = flat.shape[0]
    dev = flat.device
    nb = triton.cdiv(p, block_m) + n_experts
    order = torch.empty_like(flat)
    expert = torch.empty(nb, dtype=torch.int32, device=dev)
    start = torch.empty(nb, dtype=torch.int64, device=dev)
    end = torch.empty(nb, dtype=torch.int64, device=dev)
    e_pad = triton.next_power_of_2(n_experts)
    scratch = torch.empty(3 * e_pad, dtype=torch.int32, device=dev)
    ch = max(1, min(32, 8192 // e_pad))  # (CH, E_PAD) tiles of at most 8192 values
    _route_kernel[(1,)](flat, order, expert, start, end, scratch, p, n_experts, nb,
                        BLOCK_M=block_m, E_PAD=e_pad, CH=ch, num_warps=4)
    return order, expert, start, end


@triton.jit
def _sum_slots_kernel(C, A, Out, H, K: tl.constexpr, BLOCK: tl.constexpr, ADD: tl.constexpr):
    # Out[t] = C[t, 0] + C[t, 1] + ... + C[t, K-1] (+ A[t] with ADD), each sum rounded to Out's
    # dtype (as K - 1 torch additions in slot order, then the shared experts' add, round)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = h < H
    base = C + t * K * H
    acc = tl.load(base + h, mask=ok, other=0.0)
    for j in tl.static_range(1, K):
        nxt = tl.load(base + j * H + h, mask=ok, other=0.0)
        acc = (acc.to(tl.float32) + nxt.to(tl.float32)).to(Out.dtype.element_ty)
    if ADD:
        a = tl.load(A + t * H + h, mask=ok, other=0.0)
        acc = (acc.to(tl.float32) + a.to(tl.float32)).to(Out.dtype.element_ty)
    tl.store(Out + t * H + h, acc, mask=ok)


def experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, idx: torch.Tensor,
            w: torch.Tensor, block_m: int = 0, add: torch.Tensor | None = None) -> torch.Tensor:
    """x (T, H); gate_up (E, 2I, H) rows [gate | up]; down (E, H, I); idx (T, k) experts, each
    token's in ascending order; w (T, k) weights (fp32 or the model dtype) -> (T, H).
    block_m 0: block_m_for(E, k). add (T, H): added to the sum last (the shared experts)."""
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
                  PREC=dot_precision(dt), num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    _gate_up_kernel[(nb, triton.cdiv(inter, BLOCK_N))](
        x, gate_up, h, order, expert, start, end, hid, inter, k, **common)
    _down_kernel[(nb, triton.cdiv(hid, BLOCK_N))](
        h, down, contrib, order, wts, expert, start, end, hid, inter, **common)
    out = x.new_empty(t, hid)  # each token's k rows in ascending expert order (HF's index_add)
    if add is not None:
        assert add.shape == out.shape and add.is_contiguous()
    _sum_slots_kernel[(t, triton.cdiv(hid, 1024))](contrib, add if add is not None else out, out,
                                                   hid, K=k, BLOCK=1024, ADD=add is not None)
    return out
