"""Piecewise CUDA graphs for extend forwards (SGLang's "piecewise CUDA graph", on by default
there; `--disable-piecewise-cuda-graph`, `--piecewise-cuda-graph-max-tokens`).

An eager extend of an 8B Llama launches ~400 kernels from Python; on an H200 host that took
12-20 ms whatever the prompt length (benchmarks/probes/extend_launch.py: 16 to 4096 tokens), so
a short extend (a new turn's question, a mixed batch's few new tokens) left the GPU waiting on
the host for most of its step. A decode graph cannot hold an extend: the attention's work
depends on every request's prefix and new lengths. So the layer stack is cut at each attention
(models/llama_pieces.py): the L + 1 pieces between attentions are captured once per padded token
count (`token_buckets`), and a forward replays them with the attention launched eagerly
between them (one or two kernels a layer).

A batch of T tokens runs in the smallest bucket n >= T: rows [T, n) are padding (token 0,
position 0, KV slot 0, the scratch slot: what they compute is never read). Every piece's GEMMs
see n rows instead of T, which is why buckets are close together (`token_buckets`).
Batches above the largest bucket, and models or backends the pieces do not cover
(llama_pieces.why_not), run eagerly as before.
"""

from __future__ import annotations

import logging
import time

import torch

from radixlm.runtime.executor.cuda_graph import _capture_stream, buckets_up_to, capturing
from radixlm.runtime.executor.forward_batch import ForwardBatch, ForwardMode
from radixlm.runtime.models import llama_pieces

logger = logging.getLogger(__name__)


def token_buckets(max_tokens: int) -> list[int]:
    """16, 32, ... 128, then steps of 32 to 512 and of 64 after. Above a few hundred tokens an
    extend's GEMMs are compute-bound, so padding rows cost GPU time: at most 1/8 of a batch
    above 256 tokens, under 1/20 above 1280 (a coarser ladder, up to 1/4 above 128, padded a
    multi-turn run's 1536-token openings to 1792 rows: 14% more of its largest steps)."""
    sizes, n = [], 16
    while n <= max_tokens:
        sizes.append(n)
        n += 16 if n < 128 else 32 if n < 512 else 64
    return buckets_up_to(sizes, max_tokens)


class PiecewiseGraphRunner:
    def __init__(self, runner, max_tokens: int):
        self.runner = runner
        self.model = runner.model
        self.device = runner.device
        self.buckets = token_buckets(max_tokens)
        self.max_tokens = self.buckets[-1]
        self.buf = llama_pieces.PieceBuffers.allocate(self.model, self.max_tokens, self.device)
        self.graphs: dict[int, list] = {}  # bucket -> its L + 1 pieces' graphs, in order
        self.pool = None
        self.replays = 0  # forwards run through the pieces (tests read it)
        self._dirty_to = self.max_tokens  # rows [.., this) of buf.inputs may hold stale slots
        self._capture_all()

    def _capture(self, fn):
        """A CUDA graph of fn() on the capture stream, in this runner's memory pool (the CPU
        tests stand a re-run in for it)."""
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=_capture_stream(self.device)):
            fn()
        if self.pool is None:
            self.pool = graph.pool()
        return graph

    def _pieces(self, n: int) -> list:
        kv_pool = self.runner.kv_pool
        return [lambda k=k: llama_pieces.run_piece(self.model, k, self.buf, n, kv_pool)
                for k in range(len(self.model.layers) + 1)]

    @torch.inference_mode()
    def _capture_all(self) -> None:
        t0 = time.perf_counter()
        with capturing():
            self.buf.inputs.zero_()  # padding: every row writes the scratch slot 0
            for n in reversed(self.buckets):  # largest first: the pool's size is set once
                pieces = self._pieces(n)
                self._warm_up(pieces)
                self.graphs[n] = [self._capture(p) for p in pieces]
        self._dirty_to = 0
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.capture_s = time.perf_counter() - t0  # (start-up cost; the probes report it)
        logger.info("captured piecewise extend CUDA graphs for %d token counts (up to %d) in "
                    "%.1fs", len(self.buckets), self.max_tokens, self.capture_s)

    def _warm_up(self, pieces) -> None:
        """Each piece once outside a capture (Triton compiles, cuBLAS picks its kernels)."""
        if self.device.type != "cuda":
            return
        stream = _capture_stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for piece in pieces:
                piece()
        torch.cuda.current_stream(self.device).wait_stream(stream)

    def can_run(self, fb: ForwardBatch) -> bool:
        return (fb.mode == ForwardMode.EXTEND and 0 < fb.num_tokens <= self.max_tokens
                and not fb.capture_layers and fb.mm_inputs is None)

    def run(self, fb: ForwardBatch) -> torch.Tensor:
        """The extend batch `fb` through its bucket's pieces; returns the final hidden states
        of the rows fb.logits_indices (N, hidden), as the model's forward does."""
        t = self._stage(fb)
        n = next(b for b in self.buckets if b >= t)
        backend = self.runner.attn_backend
        fb.attn_backend = backend
        backend.init_forward_metadata(fb)
        graphs = self.graphs[n]
        graphs[0].replay()
        for k in range(len(graphs) - 1):
            llama_pieces.attention(self.model, k, self.buf, t, fb)
            graphs[k + 1].replay()
        self.replays += 1
        return llama_pieces.final_hidden(self.model, self.buf, t, fb.logits_indices)

    def _stage(self, fb: ForwardBatch) -> int:
        """fb's T tokens into rows [:T] of the static inputs; rows a longer batch wrote become
        padding again (KV slot 0: a stale slot would overwrite a live request's K/V). T."""
        t = fb.num_tokens
        inputs = self.buf.inputs
        inputs[0, :t].copy_(fb.input_ids)
        inputs[1, :t].copy_(fb.positions)
        inputs[2, :t].copy_(fb.out_cache_loc)
        if self._dirty_to > t:
            inputs[:, t : self._dirty_to].zero_()
        self._dirty_to = t
        return t
