"""Shared pieces of the GPU kernel benchmarks (fp8_linear.py, int4_gemm_sweep.py,
int4_gemv_sweep.py, probes/gemv_sweep.py, probes/gpu_probe_bs1.py): a CUDA graph of n calls
captured after a warm-up, the median time of its replays, and a spawn pool that precompiles
Triton configs. torch is imported inside `capture` only: the pool's workers import
the sweep modules, and a CPU dry run needs no CUDA."""

from __future__ import annotations

import multiprocessing
import os


def capture(fn, n_calls: int):
    """fn(i) for i < n_calls captured in one CUDA graph (returned), after up to two calls on a
    side stream so compiles, allocations and kernel choices happen outside the capture."""
    import torch

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in range(min(n_calls, 2)):
            fn(i)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(n_calls):
            fn(i)
    return g


def replay_ms(g, reps: int = 7, skip: int = 2) -> float:
    """Median ms of one replay of CUDA graph g over `reps` timed replays, the first `skip` left
    out (clocks ramping up)."""
    import statistics

    import torch

    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        g.replay()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e))
    return statistics.median(times[skip:])


def pool_failures(worker, parts: list, workers: int = 0) -> dict:
    """worker(part) -> {key: error} over `parts` in a spawn pool of `workers` processes
    (default: the CPU count less one, at most 15); the failures merged."""
    workers = workers or max(1, min(15, (os.cpu_count() or 2) - 1))
    failed: dict = {}
    with multiprocessing.get_context("spawn").Pool(workers) as pool:
        for f in pool.imap_unordered(worker, parts):
            failed.update(f)
    return failed
