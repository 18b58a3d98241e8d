"""CUDA graphs for the decode forward: one captured graph per batch-size bucket.

A decode step of an 8B model launches ~500 small kernels; launched op by op from Python that costs
more than the GPU work at small batch sizes. Each bucket (1, 2, 4, 8, 16, 24, 32, ... up to
`--cuda-graph-max-bs`) is captured once at start-up; a step of B requests replays the smallest
bucket >= B with the B real rows copied into static input buffers and the rest padded.

Padding rows are harmless by construction: they read request row `pad_row` of req_to_token (all
zeros -> scratch slot 0), have seq_len 1, and write their K/V into scratch slot 0; their logits
rows are never read.

Contract with the attention backend: `supports_cuda_graph = True` means its DECODE
`init_forward_metadata` and `forward` read only device tensors of the ForwardBatch (no host
lists, no syncs, no data-dependent allocation), so they can run inside the capture and replay
with new values in the same buffers.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import threading
import time

import torch

from radixlm.runtime.executor.forward_batch import ForwardBatch, ForwardMode

# One capture stream per device for the whole process. cuBLAS keeps a workspace (32 MiB on an
# H200) for every stream it has run on until the process ends, so a new stream per bucket left
# 4 x 32 MiB behind each engine created and shut down (tests/gpu/test_engine_lifecycle_gpu.py);
# with one stream the workspace is made once and reused. The lock keeps two captures (engines
# built from two threads) off the one stream at the same time.
_CAPTURE_STREAMS: dict = {}
_CAPTURE_LOCK = threading.Lock()


def _capture_stream(device: torch.device) -> torch.cuda.Stream:
    index = torch.device(device).index
    key = torch.cuda.current_device() if index is None else index
    if key not in _CAPTURE_STREAMS:
        _CAPTURE_STREAMS[key] = torch.cuda.Stream(device)
    return _CAPTURE_STREAMS[key]

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def capturing():
    """Around a runner's captures: the process's capture lock, and no garbage collection. A
    collection during a capture can free another engine's graphs (a shut-down Engine's runner
    <-> graph runner cycle): CUDAGraph.reset is not permitted while a stream captures and
    invalidates this capture. So collect first, then hold collections off."""
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        with _CAPTURE_LOCK:
            yield
    finally:
        if was_enabled:
            gc.enable()


def buckets_up_to(sizes, largest: int) -> list[int]:
    """The ascending `sizes` up to `largest`, ending with `largest` itself (the last bucket)."""
    out = [b for b in sizes if b <= largest]
    if not out or out[-1] != largest:
        out.append(largest)
    return out


def batch_size_buckets(max_bs: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to 256, then every 16: few buckets, little padding."""
    return buckets_up_to([1, 2, 4, 8] + list(range(16, 257, 8)) + list(range(272, 1025, 16)),
                         max_bs)


class CudaGraphRunner:
    def __init__(self, runner, max_bs: int):
        self.runner = runner
        self.device = runner.device
        self.buckets = batch_size_buckets(max_bs)
        self.max_bs = self.buckets[-1]
        dev, n = self.device, self.max_bs
        i64 = dict(dtype=torch.int64, device=dev)
        # static inputs: every captured graph reads slices [:bucket] of these; four of them are
        # rows of one tensor, so a batch that packs its inputs the same way (fb.graph_inputs)
        # fills them in one copy
        self.packed = torch.zeros(4, n, **i64)
        self.input_ids, self.positions, self.req_pool_indices, self.seq_lens = self.packed.unbind(0)
        self.req_pool_indices.fill_(runner.req_to_token_pool.pad_row)
        self.seq_lens.fill_(1)
        self.out_cache_loc = torch.zeros(n, **i64)  # padding writes to scratch slot 0
        self.logits_indices = torch.arange(n, **i64)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}  # bucket -> (bucket, vocab) float32 logits
        # bucket -> (bucket, 3 * hidden) the target layers EAGLE-3 reads (runner.capture_layers)
        self.aux_outputs: dict[int, torch.Tensor] = {}
        self.pool = None
        self.replays = 0  # (tests read it: a speculative verify replayed a graph)
        # rows >= this hold padding values in the static inputs (at first: unknown, all rows)
        self._padded_from = n
        self._capture_all()

    def _batch(self, bs: int) -> ForwardBatch:
        return ForwardBatch(
            mode=ForwardMode.DECODE, input_ids=self.input_ids[:bs], positions=self.positions[:bs],
            out_cache_loc=self.out_cache_loc[:bs], req_pool_indices=self.req_pool_indices[:bs],
            seq_lens=self.seq_lens[:bs], logits_indices=self.logits_indices[:bs],
            seq_lens_cpu=[1] * bs, capture_layers=self.runner.capture_layers)

    def _run_model(self, fb: ForwardBatch) -> torch.Tensor:
        r = self.runner
        fb.attn_backend = r.attn_backend
        r.attn_backend.init_forward_metadata(fb)
        return r.model.compute_logits(r.model(fb))

    @torch.inference_mode()
    def _capture_all(self) -> None:
        with capturing():
            self._capture_buckets()

    def _capture_buckets(self) -> None:
        t0 = time.perf_counter()
        # largest first: smaller graphs then fit into the memory pool the largest one reserved
        stream = _capture_stream(self.device)
        for bs in reversed(self.buckets):
            fb = self._batch(bs)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):  # warm-up outside capture (autotuning, lazy init)
                for _ in range(2):
                    self._run_model(fb)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                out = self._run_model(fb)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[bs], self.outputs[bs] = graph, out
            if fb.aux_hidden is not None:
                self.aux_outputs[bs] = fb.aux_hidden
        torch.cuda.synchronize(self.device)
        logger.info("captured %d decode CUDA graphs (bs %s) in %.1fs", len(self.buckets),
                    self.buckets, time.perf_counter() - t0)

    def can_run(self, fb: ForwardBatch) -> bool:
        return fb.mode == ForwardMode.DECODE and fb.batch_size <= self.max_bs

    def replay(self, fb: ForwardBatch) -> torch.Tensor:
        """Run the decode batch `fb` through its bucket's graph; returns (B, vocab) logits."""
        bs = fb.batch_size
        bucket = next(b for b in self.buckets if b >= bs)
        if fb.graph_inputs is not None:
            self.packed[:, :bs].copy_(fb.graph_inputs)
        else:
            self.input_ids[:bs].copy_(fb.input_ids)
            self.positions[:bs].copy_(fb.positions)
            self.req_pool_indices[:bs].copy_(fb.req_pool_indices)
            self.seq_lens[:bs].copy_(fb.seq_lens)
        self.out_cache_loc[:bs].copy_(fb.out_cache_loc)
        end = min(bucket, self._padded_from)
        if end > bs:  # rows left over from a larger earlier batch become padding again
            self.out_cache_loc[bs:end].zero_()
            self.req_pool_indices[bs:end].fill_(self.runner.req_to_token_pool.pad_row)
            self.seq_lens[bs:end].fill_(1)
            self.positions[bs:end].zero_()
        # rows [bs, bucket) are padding now; rows past the bucket keep what they held (a
        # verify at batch 1 replays one bucket of 5 rows per step, and pads them only once:
        # four fewer launches per step)
        if self._padded_from <= bucket:
            self._padded_from = bs
        self.graphs[bucket].replay()
        self.replays += 1
        if self.aux_outputs:  # (valid until the next replay: the reader copies what it keeps)
            fb.aux_hidden = self.aux_outputs[bucket][:bs]
        return self.outputs[bucket][:bs]
