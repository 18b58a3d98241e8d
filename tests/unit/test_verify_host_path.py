"""The host-side shortcuts of a speculative verify step, without a model: a lazy sampling take
gives the eager take's tensors (and gathers none for a greedy batch without penalties), the
freed slots taken as slices equal the gather, and the decode graphs' static inputs hold exactly
the inputs and the padding a bucket needs after batches of changing sizes, packed or not (only
rows a larger batch dirtied are padded again)."""

from __future__ import annotations

import random
import types

import pytest
import torch

from radixlm.runtime.executor.cuda_graph import CudaGraphRunner, batch_size_buckets
from radixlm.runtime.request import Req
from radixlm.runtime.sampling.sampler import Sampler
from radixlm.runtime.sampling.sampling_batch_info import SamplingBatchInfo
from radixlm.runtime.sampling_params import SamplingParams
from radixlm.runtime.speculative.rejection import accept_rows
from radixlm.runtime.speculative.worker import _rows_of

V = 16


def _req(output_ids, **params) -> Req:
    sp = SamplingParams(**params)
    sp.verify(V)
    req = Req("r", [1, 2, 3], sp)
    req.output_ids = list(output_ids)
    req.stop_token_ids = {5}
    return req


def test_lazy_take_gives_the_eager_tensors():
    reqs = [_req([1, 2, 2], temperature=0.7, top_k=5, top_p=0.9, min_p=0.05,
                 frequency_penalty=0.3, presence_penalty=0.2, repetition_penalty=1.2),
            _req([4], temperature=0, logit_bias={"3": -1.5}, min_new_tokens=6),
            _req([7, 7], temperature=1.1)]
    info = SamplingBatchInfo.from_reqs(reqs, V, "cpu")
    rows = [2, 0, 0, 1, 2, 2]
    eager = info.take(rows)
    lazy = info.take(rows, index=torch.tensor(rows), lazy=True)
    names = SamplingBatchInfo._ROW_TENSORS + SamplingBatchInfo._OPTIONAL_TENSORS
    assert any(getattr(info, n) is not None for n in SamplingBatchInfo._OPTIONAL_TENSORS)
    for name in names:
        a, b = getattr(eager, name), getattr(lazy, name)
        assert (a is None) == (b is None), name
        if a is not None:
            assert torch.equal(a, b), name
    # the same acceptance from either (the unseeded rows' noise: the global generator)
    logits = torch.randn(len(rows), V)
    draft = torch.tensor([3, -1, 4, 5, 0, -1])
    outs = []
    for taken in (info.take(rows), info.take(rows, lazy=True)):
        torch.manual_seed(5)
        outs.append(accept_rows(logits.clone(), taken, [reqs[r] for r in rows], draft,
                                Sampler()))
    assert all(torch.equal(x, y) for x, y in zip(*outs))


def test_lazy_take_of_a_greedy_batch_gathers_nothing():
    reqs = [_req([1, 2], temperature=0), _req([3], temperature=0)]
    info = SamplingBatchInfo.from_reqs(reqs, V, "cpu")
    taken = info.take([0, 0, 1], lazy=True)
    logits = torch.randn(3, V)
    draft = torch.tensor([int(logits[0].argmax()), -1, (int(logits[2].argmax()) + 1) % V])
    accept, token = accept_rows(logits, taken, [reqs[0], reqs[0], reqs[1]], draft, Sampler())
    assert accept.tolist() == [True, False, False]
    assert torch.equal(token, logits.argmax(dim=-1))
    gathered = [n for n in SamplingBatchInfo._ROW_TENSORS if n in vars(taken)]
    assert gathered == []
    with pytest.raises(AttributeError):
        taken.no_such_attribute


def test_freeing_an_allocated_view_without_a_copy_keeps_the_order():
    from radixlm.runtime.mem_cache.allocator import TokenSlotAllocator

    a, b = TokenSlotAllocator(12), TokenSlotAllocator(12)
    for alloc, copy in ((a, True), (b, False)):
        s = alloc.alloc(7)
        alloc.free(_rows_of(s, [2, 3, 4, 5]), copy=copy)
        alloc.free(_rows_of(s, [0, 6]), copy=copy)
        alloc.alloc(3)
    assert torch.equal(a.free_slots, b.free_slots)
    assert b.free_slots.tolist() == [11, 12, 3, 4, 5, 6, 1, 7]


@pytest.mark.parametrize("rows", [[3], [2, 3, 4], [0, 1, 5, 6, 9], [1, 3, 5, 7, 9, 11],
                                  list(range(12))])
def test_freed_rows_as_slices_equal_the_gather(rows):
    t = torch.arange(100, 112)
    assert torch.equal(_rows_of(t, rows), t[torch.tensor(rows)])


class _Graph:
    def __init__(self, runner, bucket):
        self.runner, self.bucket = runner, bucket

    def replay(self):  # what the captured graph reads: rows [0, bucket) of the static inputs
        r = self.runner
        r.seen.append({n: getattr(r, n)[: self.bucket].clone()
                       for n in ("input_ids", "positions", "out_cache_loc", "req_pool_indices",
                                 "seq_lens")})


def test_graph_inputs_are_padded_after_batches_of_changing_size():
    pad_row = 99
    g = object.__new__(CudaGraphRunner)
    g.runner = types.SimpleNamespace(req_to_token_pool=types.SimpleNamespace(pad_row=pad_row))
    g.buckets = batch_size_buckets(32)
    g.max_bs = n = g.buckets[-1]
    g.packed = torch.zeros(4, n, dtype=torch.int64)  # (as CudaGraphRunner.__init__ lays it out)
    g.input_ids, g.positions, g.req_pool_indices, g.seq_lens = g.packed.unbind(0)
    g.req_pool_indices.fill_(pad_row)
    g.seq_lens.fill_(1)
    g.out_cache_loc = torch.zeros(n, dtype=torch.int64)
    # like after a capture that left other values behind: the first replay pads its bucket
    g.seq_lens[3] = g.positions[3] = g.out_cache_loc[3] = 7
    g.graphs = {b: _Graph(g, b) for b in g.buckets}
    g.aux_outputs, g.replays, g.seen = {}, 0, []
    g.outputs = {b: torch.zeros(b, 1) for b in g.buckets}
    g._padded_from = n
    rng = random.Random(0)
    for bs in [1, 5, 5, 1, 5, 9, 3, 16, 2, 2, 31, 1] + [rng.randint(1, 32) for _ in range(60)]:
        # a verify's batch packs four of its inputs (fb.graph_inputs), a plain decode does not
        packed = torch.stack([torch.randint(0, 50, (bs,)), torch.randint(1, 50, (bs,)),
                              torch.randint(0, 8, (bs,)), torch.randint(2, 50, (bs,))])
        fb = types.SimpleNamespace(batch_size=bs, input_ids=packed[0], positions=packed[1],
                                   out_cache_loc=torch.randint(1, 50, (bs,)),
                                   req_pool_indices=packed[2], seq_lens=packed[3],
                                   graph_inputs=packed if rng.random() < 0.5 else None)
        g.replay(fb)
        seen = g.seen[-1]
        for name in ("input_ids", "positions", "out_cache_loc", "req_pool_indices", "seq_lens"):
            assert torch.equal(seen[name][:bs], getattr(fb, name)), (bs, name)
        assert (seen["out_cache_loc"][bs:] == 0).all() and (seen["positions"][bs:] == 0).all()
        assert (seen["req_pool_indices"][bs:] == pad_row).all(), bs
        assert (seen["seq_lens"][bs:] == 1).all(), bs
