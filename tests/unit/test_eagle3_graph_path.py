"""The EAGLE-3 head's chain steps on the CUDA-graph path (speculative/eagle3_graphs.py), checked
on the CPU: graphs cannot be captured here, so HeadGraphRunner runs with "capture" = one chain
forward on the bucket's static batch and "replay" = the same forward again on the same static
buffers, refilled by the runner's own replay() (padding rows, placeholder host lists, g copied
in), as test_mla_graph_path.py does for the target. Attention is Triton's (interpreted), the
backend a graph needs. Greedy tokens must equal plain decoding's, and the chain must have run
through the graph path. The real capture runs in tests/gpu/test_speculative_eagle3_gpu.py."""

from __future__ import annotations

import pytest
import torch

from emulated_graphs import Replay
from triton_interpreter import import_interpreted

import_interpreted("radixlm.runtime.attention.triton_backend",
                   gpu_tests="tests/gpu/test_speculative_eagle3_gpu.py")
from radixlm.runtime.speculative.eagle3_graphs import HeadGraphRunner  # noqa: E402

V, DV = 256, 100
KW = dict(skip_tokenizer_init=True, max_total_tokens=2048, context_length=256, dtype="float32",
          attention_backend="triton", max_running_requests=4)


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


class EmulatedHeadGraphs(HeadGraphRunner):
    """HeadGraphRunner's buffers, buckets, padding, run() and replay(); a bucket's "graph" re-runs
    the chain forward on the bucket's static batch into the tensors its capture returned."""

    def _capture_all(self) -> None:
        for bs in self.buckets:
            fb = self._batch(bs)
            with torch.inference_mode():
                logits = self._run_model(fb)
            out = fb.aux_hidden

            def replay(fb=fb, logits=logits, out=out):
                with torch.inference_mode():
                    logits.copy_(self._run_model(fb))
                    out.copy_(fb.aux_hidden)
                    fb.aux_hidden = out

            self.graphs[bs], self.outputs[bs], self.aux_outputs[bs] = Replay(replay), logits, out


def _eager_then_graphs(eng, spec, max_bs: int, seen: list, prompts, params) -> dict:
    """The same generation eagerly, then through emulated head graphs of `max_bs` rows: each
    run's output ids; `seen` gets a fresh list per run (what the test records into)."""
    runs = {}
    for name, graphs in (("eager", None), ("graphs", EmulatedHeadGraphs(spec, eng.runner,
                                                                        max_bs, V))):
        spec.graphs = graphs
        seen.append([])
        eng.flush_cache()
        runs[name] = [o["output_ids"] for o in eng.generate(input_ids=prompts,
                                                            sampling_params=params)]
    return runs


def _models_and_reference(tmp_path, seed: int, lengths, max_new: int):
    """A tiny target and EAGLE-3 head, random prompts of `lengths`, and the target's own greedy
    tokens for them: (target path, head path, prompts, sampling params, tokens)."""
    import radixlm
    from tiny_models import write_tiny_eagle3, write_tiny_llama

    target = write_tiny_llama(str(tmp_path / "t"), vocab=V, heads=4, kv_heads=2, tied=False,
                              layers=4)
    head = write_tiny_eagle3(str(tmp_path / "h"), vocab=V, draft_vocab=DV)
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, V, (n,), generator=g).tolist() for n in lengths]
    params = {"temperature": 0, "max_new_tokens": max_new, "ignore_eos": True}
    off = radixlm.Engine(model_path=target, **KW)
    try:
        want = [o["output_ids"] for o in off.generate(input_ids=prompts, sampling_params=params)]
    finally:
        off.shutdown()
    return target, head, prompts, params, want


def test_chain_through_graph_buffers_keeps_plain_tokens(tmp_path):
    import radixlm

    target, head, prompts, params, want = _models_and_reference(tmp_path, 3, (5, 19, 33), 16)
    on = radixlm.Engine(model_path=target, speculative_algorithm="EAGLE3",
                        speculative_adaptive=False, speculative_num_draft_tokens=4,
                        speculative_draft_model_path=head, **KW)
    try:
        spec = on.scheduler.spec
        assert spec.graphs is None  # (a CPU runner captures no graphs)
        chains, sample_step = [], spec._sample_step

        def recording(logits, *args):  # every chain depth's (active, V) logits, before sampling
            chains[-1].append(logits.clone())
            return sample_step(logits, *args)

        spec._sample_step = recording
        runs = _eager_then_graphs(on, spec, 4, chains, prompts, params)
        assert runs["eager"] == runs["graphs"] == want
        # the chain's logits at every depth (2 and 3 from the head's decode forwards) are the
        # eager ones: the drafts do not show it (a random head drafts one id over and over)
        assert len(chains[0]) == len(chains[1]) > 0
        for eager, graph in zip(*chains):
            torch.testing.assert_close(graph, eager, rtol=1e-5, atol=1e-5)
        assert spec.graphs.buckets == [1, 2, 4] and spec.graphs.replays > 0
        on.wait_idle()
        on.check_integrity()
    finally:
        on.shutdown()


def test_trees_through_graph_buffers_equal_eager_trees(tmp_path):
    """Top-k 2: the catch-up rows (as decode rows) and every level's beams replay the emulated
    head graphs; the trees drafted equal the eager path's (same nodes, same parents) and the
    tokens plain decoding's."""
    import radixlm
    from radixlm.runtime.speculative.tree import DraftTree

    target, head, prompts, params, want = _models_and_reference(tmp_path, 4, (5, 19), 7)
    on = radixlm.Engine(model_path=target, speculative_algorithm="EAGLE3",
                        speculative_adaptive=False, speculative_eagle_topk=2,
                        speculative_num_steps=3, speculative_num_draft_tokens=6,
                        speculative_draft_model_path=head, **KW)
    try:
        spec = on.scheduler.spec
        trees, draft = [], spec.draft

        def recording(sched, reqs):
            out = draft(sched, reqs)
            trees[-1].append([d for d in out if isinstance(d, DraftTree)])
            return out

        spec.draft = recording
        runs = _eager_then_graphs(on, spec, 8, trees, prompts, params)
        assert runs["eager"] == runs["graphs"] == want
        assert trees[0] == trees[1] and sum(map(len, trees[0])) > 5
        assert spec.graphs.replays > 0
        on.wait_idle()
        on.check_integrity()
    finally:
        on.shutdown()
