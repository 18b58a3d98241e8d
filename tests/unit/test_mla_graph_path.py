"""The MLA decode on the CUDA-graph path, checked on the CPU: graphs cannot be captured here, so
executor/cuda_graph.CudaGraphRunner runs with "capture" = one forward on the bucket's static
batch and "replay" = the same forward again on the same static buffers, refilled by the runner's
own replay(). That is what a graph sees: a batch padded to its bucket (padding rows on the
zero pool row, seq_len 1) whose host lists are placeholders (seq_lens_cpu = [1] * bucket), and
device tensors whose values change between replays. The MLA backend's triton decode (Triton
interpreter), with the routed experts in the Triton grouped kernel as on CUDA,
must give HF's greedy tokens through it; the torch decode, which pads rows to
max(seq_lens_cpu), must not (the reason it keeps supports_cuda_graph False).
The real capture runs in tests/gpu/test_gpu_mla.py."""

from __future__ import annotations

import pytest
import torch

import arch_parity as ap
from emulated_graphs import Replay
from triton_interpreter import import_interpreted

import_interpreted("radixlm.runtime.attention.triton_mla_decode",
                   "radixlm.runtime.layers.triton_moe", gpu_tests="tests/gpu/test_gpu_mla.py")
from radixlm.runtime.executor.cuda_graph import CudaGraphRunner  # noqa: E402
from test_model_parity_deepseek import CASES, MAX_NEW, prompts  # noqa: E402


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


class EmulatedGraphRunner(CudaGraphRunner):
    """CudaGraphRunner's static buffers, buckets, padding and replay(); the "graph" of a bucket
    re-runs the forward on the bucket's static ForwardBatch and writes the logits into the
    tensor the capture returned, as a replayed graph does."""

    def _capture_all(self) -> None:
        for bs in self.buckets:
            fb = self._batch(bs)
            with torch.inference_mode():
                out = self._run_model(fb)

            def replay(fb=fb, out=out):
                with torch.inference_mode():
                    out.copy_(self._run_model(fb))

            self.graphs[bs], self.outputs[bs] = Replay(replay), out


# V3's shape only (q LoRA, sigmoid grouped routing, a dense first layer): the graph path is the
# runner's and the decode kernel's; both shapes' model code is test_model_parity_deepseek's
@pytest.fixture(scope="module", params=["v3"])
def case(request, tmp_path_factory):
    cls, config = CASES[request.param]
    path = tmp_path_factory.mktemp(request.param)
    model = ap.save_tiny(cls, config(), path)
    ids = prompts()
    return str(path), ids, ap.hf_greedy(model, ids, MAX_NEW)


def _engine_with_graphs(path, backend):
    eng = ap.make_engine(path, attention_backend=backend, max_running_requests=8)
    runner = eng.runner
    assert runner.graph_runner is None  # the CPU never captures
    # the engine is idle: its scheduler thread waits on the inbox while the graphs are built
    runner.graph_runner = EmulatedGraphRunner(runner, 8)
    return eng


def test_triton_decode_through_the_graph_runner_matches_hf(case, monkeypatch):
    """The routed experts run layers/triton_moe.py, as in CUDA graphs (interpreted here; the eager
    experts' equality with it is test_triton_moe's)."""
    from radixlm.runtime.models.moe import Experts

    monkeypatch.setattr(Experts, "kernel_on_cpu", True)
    path, ids, ref = case
    eng = _engine_with_graphs(path, "triton")
    try:
        assert eng.runner.attn_backend.supports_cuda_graph
        outs = ap.generate(eng, ids, MAX_NEW)  # 5 requests: bucket 8, three padding rows
        assert [o["output_ids"] for o in outs] == ref
        replays = eng.runner.graph_runner.replays
        assert replays >= MAX_NEW - 1
        outs = ap.generate(eng, ids[1:2], MAX_NEW)  # bucket 1, after larger buckets ran
        assert outs[0]["output_ids"] == ref[1]
        assert eng.runner.graph_runner.replays > replays
        eng.wait_idle()
        eng.check_integrity()
    finally:
        eng.runner.graph_runner = None  # (shutdown would synchronize CUDA to release graphs)
        eng.shutdown()


def test_torch_decode_is_not_graph_safe(case):
    """Negative control: the same runner with the torch decode reads the placeholder host
    lengths and loses every key past the first: tokens differ, hence supports_cuda_graph False."""
    path, ids, ref = case
    eng = _engine_with_graphs(path, "torch_native")
    try:
        assert not eng.runner.attn_backend.supports_cuda_graph
        outs = ap.generate(eng, ids, MAX_NEW)
        assert [o["output_ids"] for o in outs] != ref
        eng.wait_idle()
        eng.check_integrity()
    finally:
        eng.runner.graph_runner = None
        eng.shutdown()


def test_decode_metadata_reads_no_host_list(case):
    """The triton decode's metadata keeps device views only: a DECODE ForwardBatch whose host
    lengths are placeholders gives the same attention as one whose are right."""
    from radixlm.runtime.attention.mla_backend import _TritonDecodeMeta
    from radixlm.runtime.executor.forward_batch import ForwardBatch, ForwardMode

    path = case[0]
    eng = ap.make_engine(path, attention_backend="triton")
    try:
        backend = eng.runner.attn_backend
        seq_lens = torch.tensor([5, 9])
        fb = ForwardBatch(mode=ForwardMode.DECODE, input_ids=torch.zeros(2, dtype=torch.long),
                          positions=seq_lens - 1, out_cache_loc=torch.zeros(2, dtype=torch.long),
                          req_pool_indices=torch.tensor([0, 1]), seq_lens=seq_lens,
                          logits_indices=torch.arange(2), seq_lens_cpu=[1, 1])
        backend.init_forward_metadata(fb)
        meta, segs = fb.attn_metadata
        assert isinstance(meta, _TritonDecodeMeta) and segs == []
        assert meta.seq_lens is fb.seq_lens and meta.req_pool_indices is fb.req_pool_indices
    finally:
        eng.shutdown()

