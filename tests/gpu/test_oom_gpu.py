"""On a CUDA GPU: a real out-of-memory in a step's forward (the device filled by this test, all
but a few MB that a step's small tensors need and a long prefill's activations do not fit in)
fails that batch's requests with 503 (runtime/scheduler/isolation.py), and once the memory is
back the engine serves the same tokens as before, its KV accounting intact. The CPU tests
inject the exception instead (tests/unit/test_fault_isolation.py). Run with `pytest -m gpu`."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

SP = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
LEAVE_BYTES = 8 << 20  # room for a step's small tensors, not for 8 x 900 tokens of activations


def _engine(path, **kw):
    import radixlm

    return radixlm.Engine(model_path=path, device="cuda", dtype="float32", skip_tokenizer_init=True,
                          context_length=1024, attention_backend="triton", **kw)


def _fill_device() -> list[torch.Tensor]:
    """Allocate the device's free memory in blocks (1 GiB halving down to 1 MiB), then give
    LEAVE_BYTES back. Returns the blocks: the caller frees them."""
    torch.cuda.empty_cache()
    blocks, size = [], 1 << 30
    while size >= 1 << 20:
        try:
            blocks.append(torch.empty(size, dtype=torch.uint8, device="cuda"))
        except torch.cuda.OutOfMemoryError:
            size //= 2
    freed = 0
    while freed < LEAVE_BYTES and blocks:
        freed += blocks.pop().numel()
    return blocks


def test_a_real_oom_fails_the_batch_and_the_engine_serves_on(tiny_llama_path):
    gen = torch.Generator().manual_seed(3)
    short = [torch.randint(3, 512, (20,), generator=gen).tolist() for _ in range(4)]
    long = [torch.randint(3, 512, (900,), generator=gen).tolist() for _ in range(8)]
    eng = _engine(tiny_llama_path, max_total_tokens=16384)
    try:
        ref = [o["output_ids"] for o in eng.generate(input_ids=short, sampling_params=SP)]
        eng.wait_idle()
        blocks = _fill_device()
        try:
            outs = eng.generate(input_ids=long, sampling_params=SP)
            eng.wait_idle()
        finally:
            del blocks
            torch.cuda.empty_cache()
        reasons = [o["meta_info"]["finish_reason"] for o in outs]
        failed = [r for r in reasons if r.get("status_code") == 503]
        assert failed, reasons  # at least the first prefill batch ran out of memory
        assert all("out of memory" in r["message"] for r in failed)
        assert all(r in failed or r["type"] == "length" for r in reasons), reasons
        assert eng.get_stats()["oom_steps"] >= 1
        eng.check_integrity()
        again = [o["output_ids"] for o in eng.generate(input_ids=short, sampling_params=SP)]
        assert again == ref
        outs = eng.generate(input_ids=long, sampling_params=SP)  # memory back: all of them run
        assert all(o["meta_info"]["finish_reason"]["type"] == "length" for o in outs)
        eng.wait_idle()
        eng.check_integrity()
    finally:
        eng.shutdown()
