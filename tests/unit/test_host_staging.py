"""host_staging: several int lists / arrays go to the device as views of one copy, values and
order kept (the CUDA side, and that it does not wait for the GPU's queue: tests/gpu)."""

from __future__ import annotations

import numpy as np
import torch

from radixlm.runtime.executor.host_staging import staged, staged_parts


def test_parts_come_back_in_order_with_their_values():
    parts = [[5, 6, 7], np.arange(10, 14), [], [2**40, -3]]
    out = staged_parts(parts, torch.device("cpu"))
    assert [t.tolist() for t in out] == [[5, 6, 7], [10, 11, 12, 13], [], [2**40, -3]]
    assert all(t.dtype == torch.int64 for t in out)
    assert staged([1, 2, 3], torch.device("cpu")).tolist() == [1, 2, 3]


def test_extend_batch_tensors_are_the_requests_own(make_engine, monkeypatch):
    """build_extend's staged tensors: ids, positions, pool rows, lengths and logit rows of a
    two-request extend with a cached prefix (a wrong offset between the parts would mix them)."""
    from radixlm.runtime.scheduler import batch_builder

    eng = make_engine()
    seen = []
    real = batch_builder.build_extend

    def build(reqs, *a, **k):
        fb, rows = real(reqs, *a, **k)
        seen.append(([(r.fill_ids[r.kv_len:r.kv_len + r.extend_len], r.kv_len, r.extend_len,
                       r.req_pool_idx) for r in reqs], fb))
        return fb, rows

    from radixlm.runtime.scheduler import scheduler as sched_module

    monkeypatch.setattr(sched_module, "build_extend", build)
    eng.generate(input_ids=list(range(40, 70)), sampling_params={"max_new_tokens": 1})
    eng.generate(input_ids=[list(range(40, 70)) + [3, 4], list(range(90, 97))],
                 sampling_params={"max_new_tokens": 1})
    reqs, fb = seen[-1]
    ids = [t for r in reqs for t in r[0]]
    pos = [p for r in reqs for p in range(r[1], r[1] + r[2])]
    assert fb.input_ids.tolist() == ids and fb.positions.tolist() == pos
    assert fb.req_pool_indices.tolist() == [r[3] for r in reqs]
    assert fb.seq_lens.tolist() == [r[1] + r[2] for r in reqs] == fb.seq_lens_cpu
    assert any(r[1] > 0 for r in reqs)  # one of them extends a cached prefix
    ends = np.cumsum([r[2] for r in reqs]) - 1
    assert fb.logits_indices.tolist() == ends.tolist()
