"""sampling/triton_argmax against torch.argmax on a CUDA GPU: the same index bit for bit (the
first of equal maxima, the first NaN, 0 for an all -inf row), fp32 / bf16 / fp16, vocabularies
of one, a chunk's multiple and Llama-3's 128,256; `check_argmax` also runs on the CPU through
Triton's interpreter (tests/unit/test_triton_argmax.py)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


def rows(batch: int, vocab: int, dtype, device, gen) -> torch.Tensor:
    x = torch.randn(batch, vocab, generator=gen).to(dtype)
    if vocab > 1:
        x[0, :] = float("-inf")  # everything masked
        if batch > 1:  # ties: the same maximum at three places, the first must win
            top = x[1].float().max() + 1
            for j in (vocab - 1, vocab // 2, vocab // 3):
                x[1, j] = top
        if batch > 2:  # NaNs: the first one wins over everything
            x[2, vocab // 2] = float("nan")
            x[2, vocab - 1] = float("nan")
            x[2, 0] = float("inf")
        if batch > 3:
            x[3, vocab - 1] = float("inf")
    return x.to(device)


def check_argmax(argmax_rows, device, vocab=(1, 4096, 9000, 128256), batches=(1, 5),
                 dtypes=(torch.float32, torch.bfloat16, torch.float16)):
    gen = torch.Generator().manual_seed(0)
    for v in vocab:
        for b in batches:
            for dtype in dtypes:
                x = rows(b, v, dtype, device, gen)
                got = argmax_rows(x)
                want = x.float().cpu().argmax(dim=-1)
                assert got.dtype == torch.int64 and got.shape == (b,)
                assert torch.equal(got.cpu(), want), (v, b, dtype, got.cpu(), want)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_argmax_matches_torch_cuda():
    from radixlm.runtime.sampling import triton_argmax

    check_argmax(triton_argmax.argmax_rows, "cuda")
    x = torch.randn(3, 128256, device="cuda")
    assert torch.equal(triton_argmax.argmax_rows(x), x.argmax(dim=-1))  # torch on the GPU too
