"""The Triton grouped experts (layers/triton_moe.py) under Triton's interpreter: the same output as
models/moe.Experts' eager path and as a per-pair reference written as HF computes it (fp32 and
bf16; tokens routed to no, one, and more than a block's worth of pairs per expert; an
intermediate size that is not a multiple of the block); the routing table covers every pair
exactly once and is built without a host sync (what a CUDA graph capture needs)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from triton_interpreter import import_interpreted  # tests/unit is on sys.path

(tm,) = import_interpreted("radixlm.runtime.layers.triton_moe",
                           gpu_tests="tests/gpu/test_gpu_mla.py")
from radixlm.runtime.models.moe import Experts  # noqa: E402

HID, INTER = 64, 48


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _setup(t, n_exp, k, dtype, seed=0, skew=False):
    g = torch.Generator().manual_seed(seed)
    ex = Experts(n_exp, HID, INTER)
    ex.gate_up_proj.data = (torch.randn(n_exp, 2 * INTER, HID, generator=g) * 0.2).to(dtype)
    ex.down_proj.data = (torch.randn(n_exp, HID, INTER, generator=g) * 0.2).to(dtype)
    x = torch.randn(t, HID, generator=g).to(dtype)
    scores = torch.rand(t, n_exp, generator=g)
    if skew:  # most tokens to experts 0 and 1: more than BLOCK_M pairs each, others empty
        scores[:, :2] += 2.0
    w, idx = scores.topk(k, dim=-1)
    idx, perm = idx.sort(dim=-1)
    return ex, x, idx, w.gather(1, perm).float()


def _reference(ex, x, idx, w):
    """HF's module math per pair: linear, silu, product, linear, times weight, cast; summed in
    ascending expert order."""
    out = torch.zeros_like(x)
    for s in range(idx.shape[1]):
        rows = []
        for i in range(x.shape[0]):
            e = int(idx[i, s])
            gu = F.linear(x[i : i + 1], ex.gate_up_proj.data[e])
            gate, up = gu.split(INTER, dim=-1)
            y = F.linear(F.silu(gate) * up, ex.down_proj.data[e])
            rows.append((y * w[i, s]).to(x.dtype))
        out = out + torch.cat(rows)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("t,n_exp,k,skew", [(1, 64, 6, False), (5, 8, 2, False),
                                            (37, 4, 2, True)], ids=["bs1-64x6", "t5", "skewed"])
def test_matches_eager_and_reference(dtype, t, n_exp, k, skew):
    ex, x, idx, w = _setup(t, n_exp, k, dtype, skew=skew)
    got = tm.experts(x, ex.gate_up_proj.data, ex.down_proj.data, idx, w)
    assert got.dtype == dtype and got.shape == x.shape
    for ref in (_reference(ex, x, idx, w), ex(x, idx, w)):  # HF's math; the CPU eager path
        if dtype == torch.float32:
            torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
        else:
            # the interpreter (Triton 3.7) rounds fp32 -> bf16 toward zero, not to nearest as
            # the GPU does, and the kernel rounds 5 times as HF's modules do (gate, up, silu,
            # product, down): a bias of a few ulps, ~1% of the output's norm; a wrong expert,
            # weight or row is off by O(100%)
            err = (got.float() - ref.float()).norm() / ref.float().norm()
            assert err < 0.03, f"relative error {err:.4f}"


def test_block_size_per_model():
    assert tm.block_m_for(64, 6) == 16  # DeepSeek-V2-Lite: 12 pairs per expert at batch 128
    assert tm.block_m_for(256, 8) == 16  # V3
    assert tm.block_m_for(8, 2) == 32  # Mixtral
    assert tm.block_m_for(4, 4) == 64  # capped


def _rowwise_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
    """The interpreter's tl.dot (numpy's matmul), one row of `a` at a time: the same products and
    sums for a row whatever the tile's row count."""
    from triton.runtime.interpreter import TensorHandle

    assert a.data.dtype == b.data.dtype == np.float32  # (create_dot's fp8 branch not needed here)
    rows = [np.matmul(a.data[i : i + 1], b.data, dtype=d.data.dtype)
            for i in range(a.data.shape[0])]
    return TensorHandle(np.concatenate(rows) + d.data, d.dtype.scalar)


def test_block_size_does_not_change_a_row(monkeypatch):
    # The kernel's claim is that BLOCK_M only pads: a row's sums are the same in a block of 16
    # rows as in one of 64, given a tl.dot whose rows do not depend on the tile's row count (a
    # GPU's MMA). The interpreter's tl.dot is numpy's matmul, whose BLAS may not give that: with
    # OpenBLAS's Haswell kernels (an AVX2 CPU) a row of a (16, K) @ (K, N) product differs from
    # the same row of a (64, K) one by an ulp or so (its AVX-512 kernels happen to agree), which
    # says nothing about the kernel. So the dot here runs row by row.
    from triton.runtime import interpreter

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", _rowwise_dot)
    ex, x, idx, w = _setup(37, 4, 2, torch.float32, skew=True)
    a = tm.experts(x, ex.gate_up_proj.data, ex.down_proj.data, idx, w, block_m=16)
    b = tm.experts(x, ex.gate_up_proj.data, ex.down_proj.data, idx, w, block_m=64)
    torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def test_routing_covers_every_pair_once_without_host_sync(monkeypatch):
    _, _, idx, _ = _setup(37, 8, 3, torch.float32, skew=True)
    flat = idx.reshape(-1)

    def refuse(*a, **kw):
        raise AssertionError("host sync in route_blocks")

    for name in ("tolist", "item", "__bool__", "__int__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    order, expert, start, end = tm.route_blocks(flat, 8, 16)
    monkeypatch.undo()
    assert expert.shape[0] == -(-flat.shape[0] // 16) + 8  # from shapes only
    seen = []
    for b in range(expert.shape[0]):
        e = int(expert[b])
        if e < 0:
            continue
        rows = range(int(start[b]), min(int(start[b]) + 16, int(end[b])))
        assert len(rows) > 0
        for r in rows:
            assert int(flat[order[r]]) == e  # the block's rows are its expert's pairs
            seen.append(int(order[r]))
    assert sorted(seen) == list(range(flat.shape[0]))  # every pair once
    ref = torch.argsort(flat, stable=True)  # expert order, pair order within an expert
    assert torch.equal(order, ref)
    assert int((expert >= 0).sum()) < expert.shape[0]  # spare blocks exist and are unused


@pytest.mark.parametrize("t,n_exp,k,block_m", [(300, 256, 8, 16), (50, 60, 6, 16), (1, 64, 6, 16)],
                         ids=["v3-batch300", "60-experts", "bs1"])
def test_routing_kernel_sorts_like_a_stable_sort(t, n_exp, k, block_m):
    """The routing kernel against its definition: a stable sort by expert, and each used block
    a run of one expert's rows (many chunks of pairs and blocks; experts padded to a power of 2)."""
    g = torch.Generator().manual_seed(t)
    flat = torch.rand(t, n_exp, generator=g).topk(k, dim=-1)[1].sort(dim=-1)[0].reshape(-1)
    order, expert, start, end = tm.route_blocks(flat, n_exp, block_m)
    assert torch.equal(order, torch.argsort(flat, stable=True))
    counts = torch.bincount(flat, minlength=n_exp)
    used = expert >= 0
    assert int(used.sum()) == int(((counts + block_m - 1) // block_m).sum())
    ends = torch.cumsum(counts, 0)
    for b in used.nonzero()[:, 0].tolist():
        e = int(expert[b])
        assert int(end[b]) == int(ends[e]) and int(ends[e] - counts[e]) <= int(start[b]) < int(end[b])


def test_shared_experts_output_joins_the_last_kernel():
    ex, x, idx, w = _setup(5, 8, 2, torch.float32)
    add = torch.randn_like(x)
    got = tm.experts(x, ex.gate_up_proj.data, ex.down_proj.data, idx, w, add=add)
    plain = tm.experts(x, ex.gate_up_proj.data, ex.down_proj.data, idx, w)
    assert torch.equal(got, plain + add)  # the routed sum first, then the add, as HF
    torch.testing.assert_close(ex(x, idx, w, add=add), ex(x, idx, w) + add, atol=0, rtol=0)
    Experts.kernel_on_cpu = True
    try:  # through Experts: the Triton path returns the sum with the add, once
        assert torch.equal(ex(x, idx, w, add=add), got)
    finally:
        Experts.kernel_on_cpu = False
