"""CUDA graphs of the EAGLE-3 head's chain steps (eagle3.py, depths 2..k).

A chain step is one decode forward of the one-layer head over the drafting requests' rows
(token d_{j-1}, features o_{j-1}) and its logits placed into the target's vocabulary: ~20
small kernels whose launches from Python cost more than the GPU work at small batches, every
depth of every step. Each batch-size bucket replays a graph captured at start-up instead.

It is executor/cuda_graph.CudaGraphRunner with another forward: the same buckets, static
inputs and padding (padding rows read the zero row of req_to_token and write the head's pool
at scratch slot 0), one more static input, g (the previous depth's pre-norm output, (B, H)),
and two outputs: the (B, V) float32 target-vocabulary logits as the "logits" and the (B, H)
pre-norm output, the next depth's g, where the base class keeps a target's layer features
(`aux_outputs`). Both are views of the graph's buffers, valid until the next replay.
The catch-up (depth 1's rows) replays them too, one decode row per position, where its
rows fit a bucket.
"""

from __future__ import annotations

import torch

from radixlm.runtime.executor.cuda_graph import CudaGraphRunner
from radixlm.runtime.executor.forward_batch import ForwardBatch


class HeadGraphRunner(CudaGraphRunner):
    def __init__(self, spec, runner, max_bs: int, vocab: int):
        """spec: the Eagle3Speculator (its head, backend and _forward); runner: the target's
        ModelRunner (device, req_to_token's padding row)."""
        self.spec, self.vocab = spec, vocab
        head = spec.head
        self.g = torch.zeros(max_bs, head.fc.weight.shape[0], dtype=head.fc.weight.dtype,
                             device=runner.device)
        super().__init__(runner, max_bs)

    def _batch(self, bs: int) -> ForwardBatch:
        fb = super()._batch(bs)
        fb.capture_layers = ()  # (the head has no target layers to keep)
        return fb

    def _run_model(self, fb: ForwardBatch) -> torch.Tensor:
        normed, out = self.spec._forward(fb, self.g[: fb.batch_size])
        fb.aux_hidden = out  # (B, H): the next depth's g (see the module docstring)
        return self.spec.head.to_target(self.spec.head.logits(normed), self.vocab)

    def run(self, fb: ForwardBatch, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One chain step of `fb.batch_size` rows: (logits (B, V) float32, pre-norm (B, H))."""
        self.g[: fb.batch_size].copy_(g)
        logits = self.replay(fb)
        return logits, fb.aux_hidden
