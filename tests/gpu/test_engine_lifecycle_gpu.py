"""On a CUDA GPU: engines created and shut down one after another in one process give their
device memory back, and a garbage collection that frees another engine's CUDA graphs cannot
invalidate a capture in progress (it did: a shut-down Engine left its runner <-> graph runner
cycle to the collector, which ran during the next Engine's capture; 'operation not permitted
when stream is capturing (function reset)'). Run with `pytest -m gpu tests/gpu`."""

from __future__ import annotations

import gc

import pytest
import torch

pytestmark = pytest.mark.gpu

SP = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
PROMPT = list(range(5, 69))


def _engine(path):
    import radixlm

    return radixlm.Engine(model_path=path, device="cuda", dtype="float32", skip_tokenizer_init=True,
                          context_length=1024, max_total_tokens=4096, attention_backend="triton",
                          cuda_graph_max_bs=8)


def _generate_once(path) -> list[int]:
    eng = _engine(path)
    try:
        assert eng.runner.graph_runner is not None, "the test needs captured decode graphs"
        out = eng.generate(input_ids=PROMPT, sampling_params=SP)["output_ids"]
        eng.wait_idle()
        eng.check_integrity()
    finally:
        eng.shutdown()
    return out


def test_engines_in_a_loop_give_device_memory_back(tiny_llama_path):
    ref = _generate_once(tiny_llama_path)  # the first one also loads kernels and libraries
    gc.collect()
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    for _ in range(5):
        assert _generate_once(tiny_llama_path) == ref
    torch.cuda.synchronize()
    # no gc.collect() here: shutdown itself must have let the pool, weights and graphs go
    end = torch.cuda.memory_allocated()
    assert end <= start * 1.01 + (1 << 20), (start, end)


def test_no_collection_can_run_during_a_capture(tiny_llama_path, monkeypatch):
    from radixlm.runtime.executor import cuda_graph

    seen = []
    run_model = cuda_graph.CudaGraphRunner._run_model

    def spy(self, fb):
        if torch.cuda.is_current_stream_capturing():
            seen.append(gc.isenabled())
        return run_model(self, fb)

    monkeypatch.setattr(cuda_graph.CudaGraphRunner, "_run_model", spy)
    _generate_once(tiny_llama_path)
    assert seen and not any(seen), seen
    assert gc.isenabled()
