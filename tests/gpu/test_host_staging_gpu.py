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
