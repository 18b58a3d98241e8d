"""Piecewise CUDA graphs of extends (executor/piecewise_graph.py) on a CUDA GPU: captured per
token bucket at start-up and replayed with the attention eager between pieces. fp32: the same
greedy tokens and logprobs as with them off, requests arriving one after another (mixed batches
with decode rows, cached prefixes, padding), with and without the overlap schedule, Llama and
Qwen3 (per-head q/k norms); no KV leak.
The CPU twin (tests/unit/test_piecewise_graph_path.py) checks the same path without capture."""

from __future__ import annotations

import pytest

import staggered

pytestmark = pytest.mark.gpu


def _engine(path, dtype="float32", **kw):
    import radixlm

    return radixlm.Engine(model_path=path, device="cuda", dtype=dtype,
                          skip_tokenizer_init=True, max_total_tokens=8192, context_length=512,
                          chunked_prefill_size=48, piecewise_cuda_graph_max_tokens=32,
                          cuda_graph_max_bs=16, **kw)


@pytest.fixture(scope="module")
def tiny_qwen3_path(tmp_path_factory):
    from tiny_models import write_tiny_llama

    return write_tiny_llama(str(tmp_path_factory.mktemp("qwen3-pieces")), vocab=512, heads=4,
                            kv_heads=2, tied=False, layers=3, arch="qwen3")


@pytest.mark.parametrize("arch,overlap", [("llama", False), ("llama", True), ("qwen3", True)])
def test_pieces_give_the_eager_tokens(tiny_llama_path, tiny_qwen3_path, integrity, arch,
                                      overlap):
    path = tiny_llama_path if arch == "llama" else tiny_qwen3_path  # qwen3: q/k norms
    ids = staggered.prompts(512, seed=2)
    runs, replays = {}, {}
    for name, off in (("eager", True), ("pieces", False)):
        eng = _engine(path, disable_piecewise_cuda_graph=off,
                      disable_overlap_schedule=not overlap)
        try:
            assert (eng.runner.piecewise is None) == off
            runs[name] = staggered.drive(eng, ids, name)
            replays[name] = 0 if off else eng.runner.piecewise.replays
            integrity(eng)
        finally:
            eng.shutdown()
    assert replays["pieces"] >= 5
    for a, b in zip(runs["eager"], runs["pieces"]):
        assert a.output_ids == b.output_ids, a.rid
        assert b.output_token_logprobs == pytest.approx(a.output_token_logprobs, abs=1e-4)


def test_bf16_pieces_stay_close(tiny_llama_path, integrity):
    """bf16: padded GEMMs may round apart from the eager ones (another row count), so a greedy
    token may flip where two logits are within bf16's step; nearly all must agree."""
    ids = staggered.prompts(512, seed=3)
    runs = {}
    for name, off in (("eager", True), ("pieces", False)):
        eng = _engine(tiny_llama_path, dtype="bfloat16", disable_piecewise_cuda_graph=off)
        try:
            runs[name] = staggered.drive(eng, ids, name)
            integrity(eng)
        finally:
            eng.shutdown()
    same = sum(a.output_ids == b.output_ids for a, b in zip(runs["eager"], runs["pieces"]))
    assert same >= len(ids) - 2, same
