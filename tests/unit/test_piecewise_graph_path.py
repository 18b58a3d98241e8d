"""Extends through the piecewise graphs' path (executor/piecewise_graph.py), checked on the CPU:
graphs cannot be captured here, so a piece's "graph" re-runs the piece on the bucket's static
buffers, as a replay does (tests/unit/emulated_graphs.py). What is checked is everything around
the capture: the layer stack cut at each attention (models/llama_pieces.py), batches padded to
their bucket (padding rows write the scratch slot, never a live one), the attention between
pieces writing the static buffer, mixed batches' decode rows, extends above the largest bucket
running eagerly. Greedy tokens and logprobs must be those of the eager forward. Attention is
Triton's (interpreted), the backend the pieces need. The real capture runs in
tests/gpu/test_piecewise_gpu.py."""

from __future__ import annotations

import pytest
import torch

import staggered
from emulated_graphs import Replay
from triton_interpreter import import_interpreted

import_interpreted("radixlm.runtime.attention.triton_backend",
                   "radixlm.runtime.layers.triton_ops", gpu_tests="tests/gpu/test_piecewise_gpu.py")
from radixlm.runtime.executor.piecewise_graph import (PiecewiseGraphRunner,  # noqa: E402
                                                      token_buckets)
from radixlm.runtime.models import llama_pieces  # noqa: E402

V = 256
MAX_TOKENS = 32  # the largest bucket: the 48-token chunks run eagerly
KW = dict(skip_tokenizer_init=True, max_total_tokens=4096, context_length=512, dtype="float32",
          attention_backend="triton", max_running_requests=8, chunked_prefill_size=48)


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


class EmulatedPieces(PiecewiseGraphRunner):
    """PiecewiseGraphRunner's buckets, buffers, padding and run(); a piece's "graph" re-runs it."""

    def _capture(self, fn):
        with torch.inference_mode():
            fn()
        return Replay(fn)  # (replayed inside the runner's inference mode)


@pytest.fixture(scope="module", params=["llama", "qwen3"])  # qwen3: per-head q/k norms
def eng(tmp_path_factory, request):
    import radixlm
    from tiny_models import write_tiny_llama

    path = write_tiny_llama(str(tmp_path_factory.mktemp("pw")), vocab=V, heads=4, kv_heads=2,
                            tied=False, layers=3, arch=request.param)
    with pytest.MonkeyPatch.context() as mp:  # (the autouse fixture comes after this one)
        mp.setenv("TRITON_INTERPRET", "1")
        e = radixlm.Engine(model_path=path, **KW)
        yield e
        e.shutdown()


def test_the_pieces_give_the_eager_tokens(eng, integrity):
    runner = eng.runner
    ids = staggered.prompts(V, seed=1)
    eager = staggered.drive(eng, ids, "eager")
    pieces = EmulatedPieces(runner, MAX_TOKENS)
    seen = []
    real_run = pieces.run

    def run(fb):
        seen.append((fb.num_tokens, fb.num_decode_tail))
        return real_run(fb)

    pieces.run = run
    runner.piecewise = pieces
    for buf in runner.kv_pool.k_buffers + runner.kv_pool.v_buffers:  # the eager run's K/V sit
        buf.zero_()  # in the slots the same workload gets again: a K/V never written must show
    try:
        piecewise = staggered.drive(eng, ids, "pieces")
    finally:
        runner.piecewise = None
    for a, b in zip(eager, piecewise):
        assert a.output_ids == b.output_ids, a.rid
        la, lb = a.output_token_logprobs, b.output_token_logprobs
        assert lb == pytest.approx(la, abs=1e-4)  # padded GEMMs may sum in another order
    assert pieces.replays == len(seen) >= 5
    assert any(tail for _, tail in seen)  # mixed batches: decode rows after the extend's
    assert any(t not in pieces.buckets for t, _ in seen)  # padded to a larger bucket
    integrity(eng)


def test_padding_rows_are_reset_after_a_longer_batch(eng):
    """A batch of 20 tokens, then one of 5 in the 16 bucket: rows 5..16 must write the scratch
    slot 0 again, not the slots the longer batch's rows had."""
    pieces = EmulatedPieces(eng.runner, MAX_TOKENS)
    inputs = pieces.buf.inputs
    inputs[2, :20] = torch.arange(100, 120)
    pieces._dirty_to = 20
    assert pieces._stage(_fake_extend(5)) == 5
    assert inputs[2, :5].tolist() == list(range(200, 205))
    assert inputs[:, 5:20].eq(0).all()


def _fake_extend(t):
    from radixlm.runtime.executor.forward_batch import ForwardBatch, ForwardMode

    z = torch.zeros(t, dtype=torch.int64)
    return ForwardBatch(mode=ForwardMode.EXTEND, input_ids=z, positions=z,
                        out_cache_loc=torch.arange(200, 200 + t), req_pool_indices=z[:1],
                        seq_lens=torch.tensor([t]), logits_indices=torch.tensor([t - 1]))


def test_buckets_and_what_the_pieces_refuse(eng, monkeypatch):
    b = token_buckets(2048)
    assert b[0] == 16 and b[-1] == 2048 and b == sorted(set(b))
    assert all((hi - lo) / lo <= 0.125 for lo, hi in zip(b, b[1:]) if lo >= 256)
    assert all((hi - lo) / lo <= 0.05 for lo, hi in zip(b, b[1:]) if lo >= 1280)
    assert token_buckets(100)[-1] == 100
    runner = eng.runner
    assert llama_pieces.why_not(runner.model, runner.attn_backend) == ""

    class Other:
        accepts_stored_kv = False

    assert "backend" in llama_pieces.why_not(runner.model, Other())
    from radixlm.runtime.layers import triton_ops

    monkeypatch.setattr(triton_ops, "ENABLED", False)
    assert "FUSED_OPS" in llama_pieces.why_not(runner.model, runner.attn_backend)
