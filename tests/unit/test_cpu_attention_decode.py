"""The one-pass decode path of the CPU attention kernels (csrc/cpu_attention_decode.h: bf16 pool
and q, D a multiple of 64) against a dense fp32 reference: groups of 1 to 8 query heads per KV
head (register tiles of 4 heads, so 6 and 8 take two), D 64 and 128, key splits and the next-item
prefetch at 1-3 threads, kv_start, sliding window and soft-cap, lse, and a bad slot."""

from __future__ import annotations

import pytest
import torch

from cpu_attention_ref import TOL, close, close_lse, dense, kernels_built, make_pool  # noqa: F401 - autouse
from radixlm.runtime.attention import cpu_kernels

BF16 = torch.bfloat16


@pytest.fixture(autouse=True)
def _threads():
    prev = torch.get_num_threads()
    yield
    torch.set_num_threads(prev)


def dense_window(q, k_buf, v_buf, slots, scale, window, cap):
    """One query at the last of len(slots) positions: fp32 scores, soft-cap, then the window."""
    g = q.shape[1] // k_buf.shape[1]
    k = k_buf[slots].float().repeat_interleave(g, 1)
    v = v_buf[slots].float().repeat_interleave(g, 1)
    s = torch.einsum("qhd,khd->qhk", q.float(), k) * scale
    if cap:
        s = cap * torch.tanh(s / cap)
    n = len(slots)
    if window:
        s[..., : max(0, n - window)] = float("-inf")
    return torch.einsum("qhk,khd->qhd", s.softmax(-1), v)


@pytest.mark.parametrize("hq, hkv, d", [(9, 3, 64), (12, 2, 128), (4, 4, 64), (16, 2, 64)],
                         ids=["g3-d64", "g6-d128", "g1-d64", "g8-d64"])
@pytest.mark.parametrize("n_threads", [1, 2, 3])
def test_one_pass_decode_matches_dense(hq, hkv, d, n_threads):
    torch.set_num_threads(n_threads)
    gen = torch.Generator().manual_seed(hq * 1000 + d + n_threads)
    lens = [1, 7, 64, 65, 333, 1029, 2, 130]  # block edges; 1029 splits with few items
    k, v, r2t, rows = make_pool(lens, hkv, d, BF16, gen, shared=40)
    q = torch.randn(len(lens), hq, d, generator=gen).to(BF16)
    start = torch.tensor([0, 3, 64, 10, 200, 1, 2, 0])  # the 64-key one sees none
    scale = d ** -0.5
    out, lse = cpu_kernels.decode(q, k, v, r2t, rows, torch.tensor(lens), scale, kv_start=start,
                                  return_lse=True)
    for b, ln in enumerate(lens):
        ro, rl = dense(q[b:b + 1], k, v, r2t[rows[b], int(start[b]):ln], scale)
        close(out[b:b + 1], ro, BF16)
        close_lse(lse[b:b + 1], rl)
    # one long sequence alone: every thread takes key splits of it, merged by lse
    one = cpu_kernels.decode(q[5:6], k, v, r2t, rows[5:6], torch.tensor([1029]), scale)
    close(one, dense(q[5:6], k, v, r2t[rows[5], :1029], scale)[0], BF16)


@pytest.mark.parametrize("window, cap", [(100, 0.0), (0, 2.0), (700, 5.0), (1, 0.0)])
def test_one_pass_decode_window_and_softcap(window, cap):
    torch.set_num_threads(2)
    gen = torch.Generator().manual_seed(window + int(cap))
    lens = [900, 64, 333]
    k, v, r2t, rows = make_pool(lens, 3, 64, BF16, gen)
    q = torch.randn(len(lens), 9, 64, generator=gen).to(BF16)
    out = cpu_kernels.decode(q, k, v, r2t, rows, torch.tensor(lens), 0.125, window=window,
                             softcap=cap)
    for b, ln in enumerate(lens):
        ref = dense_window(q[b:b + 1], k, v, r2t[rows[b], :ln], 0.125, window, cap)
        torch.testing.assert_close(out[b:b + 1].float(), ref, atol=TOL[BF16], rtol=TOL[BF16])


def test_one_pass_decode_rejects_a_slot_outside_the_pool():
    gen = torch.Generator().manual_seed(0)
    k, v, r2t, rows = make_pool([100, 50], 3, 64, BF16, gen)
    r2t[rows[1], 20] = k.shape[0] + 5
    q = torch.randn(2, 9, 64, generator=gen).to(BF16)
    with pytest.raises(RuntimeError, match="outside the KV pool"):
        cpu_kernels.decode(q, k, v, r2t, rows, torch.tensor([100, 50]), 0.125)
