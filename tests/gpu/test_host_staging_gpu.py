"""On a CUDA GPU: a staged copy (runtime/executor/host_staging.py) is queued behind the GPU's work
without the host waiting for it (a pageable copy waits: what made a batch built while a step ran
wait for that step), and lands the right values. Run with `pytest -m gpu tests/gpu`."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.gpu


def test_a_staged_copy_does_not_wait_for_the_queue():
    from radixlm.runtime.executor.host_staging import staged_parts

    dev = torch.device("cuda")
    staged_parts([[1]], dev)  # the ring's first buffer pinned
    torch.cuda.synchronize()
    torch.cuda._sleep(1_000_000_000)  # ~0.5 s of queued GPU work (clock cycles)
    busy = torch.cuda.Event()
    busy.record()
    t0 = time.perf_counter()
    ids, pos = staged_parts([list(range(100)), np.arange(5, 9)], dev)
    took = time.perf_counter() - t0
    assert not busy.query() and took < 0.1, f"the copy waited for the GPU ({took:.3f} s)"
    torch.cuda.synchronize()
    assert ids.tolist() == list(range(100)) and pos.tolist() == [5, 6, 7, 8]


def test_the_uva_kernel_copies_exactly():
    from radixlm.runtime.executor import uva_copy

    dev = torch.device("cuda")
    assert uva_copy.available(dev), "a kernel cannot read pinned host memory on this GPU"
    for n in (1, uva_copy.BLOCK - 1, uva_copy.BLOCK, uva_copy.BLOCK + 1, 12_345):
        src = torch.randint(-(1 << 62), 1 << 62, (n,), dtype=torch.int64).pin_memory()
        out = uva_copy.copy_words(src, torch.empty(n, dtype=torch.int64, device=dev))
        assert torch.equal(out.cpu(), src), n


def test_a_staged_copy_does_not_wait_behind_queued_loads():
    """The cache's loads fill the copy engine's queue (host -> device DMAs on a stream of their
    own); a forward's staged inputs copied after them arrive long before the loads are done."""
    from radixlm.runtime.executor.host_staging import staged_parts

    dev = torch.device("cuda")
    staged_parts([[1]], dev)
    big = torch.empty(8, 64 << 20, dtype=torch.uint8).pin_memory()  # 8 x 64 MiB
    dst = torch.empty_like(big, device=dev)
    loads = torch.cuda.Stream()
    torch.cuda.synchronize()
    with torch.cuda.stream(loads):
        for i in range(big.shape[0]):
            dst[i].copy_(big[i], non_blocking=True)
        loads_done = torch.cuda.Event()
        loads_done.record(loads)
    (ids,) = staged_parts([list(range(7, 107))], dev)
    inputs_done = torch.cuda.Event()
    inputs_done.record()
    inputs_done.synchronize()
    assert not loads_done.query(), "the inputs' copy waited for the loads queued before it"
    assert ids.tolist() == list(range(7, 107))
    torch.cuda.synchronize()
