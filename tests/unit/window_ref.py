"""Shared by the sliding-window / logit soft-cap backend tests (test_sliding_window.py: torch_native
and cpu; test_triton_sliding_window.py: triton under the interpreter): a KV pool with scattered
slots and radix-style shared prefixes, ForwardBatches as the scheduler builds them, and a dense
fp32 reference with HF's masks (query at position p sees keys in (p - window, p])."""

from __future__ import annotations

from typing import Optional

import torch

from radixlm.runtime.executor.forward_batch import ForwardBatch, ForwardMode
from radixlm.runtime.mem_cache.kv_pool import KVPool

HQ, HKV, D = 8, 2, 32  # GQA, 4 query heads per KV head
SCALE = 0.3
CTX = 1024  # max_context_len of the backends: windows below it stay windows
# (window of layer 0, logit soft-cap): windows of one key, a few keys, longer than a 64-key block,
# longer than every request; soft-cap alone and with a window. Layer 1 is always full attention.
CASES = [(1, None), (7, None), (70, None), (600, None), (None, 2.0), (9, 2.0)]
CASE_IDS = ["w1", "w7", "w70", "w600", "cap", "w9-cap"]


def dense(q, k, v, q_pos, window: Optional[int], softcap: Optional[float], scale=SCALE):
    """q (n, Hq, D) at positions q_pos (n,), keys k / v (L, Hkv, D) at positions 0..L-1:
    causal, windowed, soft-capped attention in fp32 -> (n, Hq, D)."""
    g = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(g, 1)
    v = v.float().repeat_interleave(g, 1)
    s = torch.einsum("qhd,khd->qhk", q.float(), k) * scale
    if softcap:
        s = torch.tanh(s / softcap) * softcap
    kp = torch.arange(k.shape[0])[None, :]
    ok = kp <= q_pos[:, None]
    if window:
        ok &= kp > q_pos[:, None] - window
    s = s.masked_fill(~ok[:, None, :], float("-inf"))
    return torch.einsum("qhk,khd->qhd", torch.softmax(s, -1), v)


def make_pool(lens, shared: int, gen, n_layers=2, dtype=torch.float32, hkv=HKV, d=D):
    """Requests of `lens` tokens; request i is req_to_token row 2*i+1 (so a kernel ignoring
    req_pool_indices fails), slots scattered, never slot 0; every request whose length exceeds
    `shared` shares request 0's first `shared` slots (a radix-cache prefix). K/V random."""
    ctx = max(lens) + 4
    r2t = torch.zeros(2 * len(lens) + 2, ctx, dtype=torch.int64)
    perm = torch.randperm(sum(lens), generator=gen) + 1
    rows, at = [], 0
    for i, n in enumerate(lens):
        r2t[2 * i + 1, :n] = perm[at:at + n]
        at += n
        rows.append(2 * i + 1)
        if i and n > shared and lens[0] > shared:
            r2t[2 * i + 1, :shared] = r2t[1, :shared]
    pool = KVPool(sum(lens), n_layers, hkv, d, dtype, "cpu")
    for layer in range(n_layers):
        pool.k_buffers[layer].copy_(torch.randn(sum(lens) + 1, hkv, d, generator=gen))
        pool.v_buffers[layer].copy_(torch.randn(sum(lens) + 1, hkv, d, generator=gen))
    return pool, r2t, torch.tensor(rows)


def extend_batch(r2t, rows, prefix, ext, n_decode_tail=0) -> ForwardBatch:
    """EXTEND: request i has prefix[i] cached tokens and ext[i] new ones (the last n_decode_tail
    are decode rows, ext 1); the new tokens' slots come from req_to_token."""
    lens = [p + e for p, e in zip(prefix, ext)]
    loc = torch.cat([r2t[rows[i], prefix[i]:lens[i]] for i in range(len(lens))])
    return ForwardBatch(
        mode=ForwardMode.EXTEND, input_ids=torch.zeros(loc.shape[0], dtype=torch.int64),
        positions=torch.cat([torch.arange(p, p + e) for p, e in zip(prefix, ext)]),
        out_cache_loc=loc, req_pool_indices=rows.clone(), seq_lens=torch.tensor(lens),
        logits_indices=torch.zeros(len(lens), dtype=torch.int64), seq_lens_cpu=list(lens),
        extend_prefix_lens_cpu=list(prefix), extend_lens_cpu=list(ext),
        num_decode_tail=n_decode_tail)


def decode_batch(r2t, rows, lens) -> ForwardBatch:
    loc = torch.stack([r2t[rows[i], lens[i] - 1] for i in range(len(lens))])
    return ForwardBatch(
        mode=ForwardMode.DECODE, input_ids=torch.zeros(len(lens), dtype=torch.int64),
        positions=torch.tensor(lens) - 1, out_cache_loc=loc, req_pool_indices=rows.clone(),
        seq_lens=torch.tensor(lens), logits_indices=torch.arange(len(lens)),
        seq_lens_cpu=list(lens))


def run_and_check(backend, pool, r2t, rows, prefix, ext, fb, windows, softcap, gen, tol):
    """Every layer of `fb` through `backend` (K/V written as the model does), each against the
    dense reference over the pool's contents afterwards."""
    backend.init_forward_metadata(fb)
    t = fb.num_tokens
    for layer, window in enumerate(windows):
        q, k, v = (torch.randn(t, h, D, generator=gen).to(pool.dtype) for h in (HQ, HKV, HKV))
        out = backend.forward(q, k, v, layer, fb)
        kb, vb = pool.k_buffers[layer], pool.v_buffers[layer]
        at = 0
        for i, (p, e) in enumerate(zip(prefix, ext)):
            slots = r2t[rows[i], :p + e]
            ref = dense(q[at:at + e], kb[slots], vb[slots], torch.arange(p, p + e), window,
                        softcap)
            torch.testing.assert_close(out[at:at + e].float(), ref, atol=tol, rtol=tol,
                                       msg=lambda m: f"layer {layer} request {i}: {m}")
            at += e
