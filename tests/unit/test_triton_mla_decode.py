"""The Triton MLA decode kernel (attention/triton_mla_decode.py) under Triton's interpreter against
a torch reference of absorbed attention: DeepSeek's latent width (rank 512 + rope 64) with 16
heads (V2-Lite) and 128 heads (V2 / V3), short and long contexts, a ragged batch, bf16 and
fp32, one key range per row and split over the keys (flash-decoding, merged by log-sum-exp),
several heads per program. Sizes are kept small so that the interpreter takes seconds."""

from __future__ import annotations

import pytest
import torch

from triton_interpreter import import_interpreted  # tests/unit is on sys.path

(mla,) = import_interpreted("radixlm.runtime.attention.triton_mla_decode",
                            gpu_tests="tests/gpu/test_gpu_mla.py")

R, DR = 512, 64
SCALE = 0.06


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _case(lens, h, dtype, seed=0):
    """A pool of random latents, requests at rows 2i+1 of req_to_token with shuffled slots, and
    their absorbed queries; the reference output (B, H, R) in fp32 from the same rounded values."""
    g = torch.Generator().manual_seed(seed)
    cap = sum(lens) + 4
    buf = torch.randn(cap + 1, R + DR, generator=g).to(dtype)
    rt = torch.zeros(2 * len(lens) + 2, max(lens) + 8, dtype=torch.int64)
    perm = (torch.randperm(cap, generator=g) + 1).tolist()
    for i, n in enumerate(lens):
        rt[2 * i + 1, :n] = torch.tensor(perm[:n])
        perm = perm[n:]
    q = torch.randn(len(lens), h, R + DR, generator=g).to(dtype)
    ref = []
    for i, n in enumerate(lens):
        lat = buf[rt[2 * i + 1, :n]].float()  # (n, R + DR)
        p = (q[i].float() @ lat.T * SCALE).softmax(-1)  # (H, n)
        ref.append(p @ lat[:, :R])
    idx = torch.arange(1, 2 * len(lens), 2)
    return q, buf, rt, idx, torch.tensor(lens), torch.stack(ref)


def _check(out, ref, dtype):
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=2e-5, rtol=2e-5)
    assert out.dtype == dtype and out.shape == ref.shape
    torch.testing.assert_close(out.float(), ref, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("h,lens,splits", [
    (16, [1, 5, 40], 1),  # V2-Lite's heads, short contexts, one key range per row
    (16, [3, 200, 97], 4),  # long and ragged, 4 splits: some splits of the short row are empty
    (128, [1, 70], 2),  # V2 / V3's heads: 8 programs per (row, split), each over 16 heads
], ids=["h16-short", "h16-long-split4", "h128-split2"])
def test_decode_matches_reference(dtype, h, lens, splits):
    q, buf, rt, idx, seq_lens, ref = _case(lens, h, dtype)
    scratch = torch.full((mla.scratch_numel(len(lens), h, R, splits),), float("nan"))
    out = mla.decode(q, buf, rt, idx, seq_lens, R, SCALE, scratch=scratch, splits=splits)
    _check(out, ref, dtype)


def test_splits_and_head_blocks_agree():
    """The same rows with 1, 2, 4 splits and 16 or 32 heads per program: the same output up to
    fp32 rounding of the log-sum-exp merge."""
    q, buf, rt, idx, seq_lens, ref = _case([20, 90], 32, torch.float32, seed=3)
    base = mla.decode(q, buf, rt, idx, seq_lens, R, SCALE, splits=1)
    _check(base, ref, torch.float32)
    for splits, block_h in [(2, 16), (4, 16), (2, 32)]:
        out = mla.decode(q, buf, rt, idx, seq_lens, R, SCALE, splits=splits, block_h=block_h)
        torch.testing.assert_close(out, base, atol=1e-5, rtol=1e-5)


def test_padding_rows_and_persistent_buffers():
    """A CUDA-graph bucket's padding rows (pool row of zeros -> scratch slot 0, seq_len 1) give
    finite outputs, and the caller's `out` and scratch are written in place (what a replay
    reads), with no fresh allocation of either."""
    q, buf, rt, idx, seq_lens, ref = _case([9, 50], 16, torch.float32, seed=5)
    pad_row = rt.shape[0] - 1  # all zeros
    idx = torch.cat((idx, torch.tensor([pad_row, pad_row])))
    seq_lens = torch.cat((seq_lens, torch.tensor([1, 1])))
    q = torch.cat((q, torch.randn(2, 16, R + DR)))
    out = torch.full((4, 16, R), float("nan"))
    scratch = torch.full((mla.scratch_numel(4, 16, R, 4),), float("nan"))
    got = mla.decode(q, buf, rt, idx, seq_lens, R, SCALE, out=out, scratch=scratch, splits=4)
    assert got.data_ptr() == out.data_ptr()
    _check(out[:2], ref, torch.float32)
    torch.testing.assert_close(out[2:], buf[0, :R].expand(2, 16, R))  # one key: its value
    with pytest.raises(AssertionError, match="scratch too small"):
        mla.decode(q, buf, rt, idx, seq_lens, R, SCALE, scratch=scratch[:10], splits=4)


def test_split_count_is_a_power_of_two_from_shapes():
    assert mla.num_splits(1, 128, torch.device("cpu")) == 1  # interpreter: one range
    assert mla.scratch_numel(4, 16, R, 1) == 0
    assert mla.scratch_numel(2, 16, R, 4) == 2 * 16 * 4 * (R + 1)
