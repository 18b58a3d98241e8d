"""The symmetric-memory all-reduce (runtime/distributed/custom_all_reduce.py) against NCCL's on
2 GPUs: random tensors of many sizes, bf16 and fp32, eager and replayed from a CUDA graph with new
inputs; the two-rank sums must be bit-identical to NCCL's (a + b rounded once in both). Also
prints the per-call time of each inside a CUDA graph at decode sizes (no assertion on speed:
benchmarks measure). Run on a 2-GPU machine: `pytest -m gpu tests/gpu/test_custom_all_reduce.py`.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.multiprocessing as mp

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                       reason="needs 2 CUDA devices"),
]

SIZES = [2, 64, 4096, 4096 * 3 + 6, 65536, 1 << 20]  # elements (bf16: even, 4-byte words)
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _graph_us(fn) -> float:
    """Per call: 64 calls of fn() captured in one CUDA graph (benchmarks/fp8_linear's timer)."""
    from benchmarks.fp8_linear import graph_time_us

    return graph_time_us(lambda i: fn(), 64, reps=20)


def _worker(rank: int, init: str, out: "mp.Queue") -> None:
    import torch.distributed as dist

    from radixlm.runtime.distributed import parallel_state

    try:
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        tp = parallel_state.init_distributed(2, rank, init, f"cuda:{rank}", custom_all_reduce=True)
        assert tp.fast is not None, "the custom all-reduce was not set up"
        dev = torch.device("cuda", rank)
        bad = []
        for (name, dtype), one_shot in [(d, o) for d in DTYPES.items() for o in (False, True)]:
            tp.fast.one_shot = one_shot
            for n in SIZES:
                g = torch.Generator(device=dev).manual_seed(1000 * n + rank)
                x = torch.randn(n, generator=g, device=dev).to(dtype)
                want = x.clone()
                dist.all_reduce(want, group=tp.group)
                got = tp.all_reduce(x.clone().view(1, -1)).view(-1)
                if not torch.equal(got, want):
                    bad.append(f"{name} one_shot={one_shot} n={n}: "
                               f"max diff {(got.float() - want.float()).abs().max()}")
        tp.fast.one_shot = False
        # replayed from a CUDA graph with new inputs: the barriers and buffers survive replays
        x = torch.empty(1, 4096, dtype=torch.bfloat16, device=dev)
        y = torch.empty_like(x)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            y.copy_(tp.all_reduce(x.clone()))
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y.copy_(tp.all_reduce(x.clone()))
        for step in range(3):
            x.copy_(torch.randn(1, 4096, device=dev, generator=torch.Generator(
                device=dev).manual_seed(step * 7 + rank)).to(torch.bfloat16))
            want = x.clone()
            dist.all_reduce(want, group=tp.group)
            graph.replay()
            torch.cuda.synchronize()
            if not torch.equal(y, want):
                bad.append(f"graph replay {step}")
        assert not tp.fast.takes(torch.empty(3, dtype=torch.bfloat16, device=dev))  # 6 bytes
        times = {}
        for n in (4096, 8 * 4096, 64 * 4096):
            t = torch.randn(1, n, device=dev).to(torch.bfloat16)
            row = [_graph_us(lambda: dist.all_reduce(t, group=tp.group))]
            for one_shot in (False, True):
                tp.fast.one_shot = one_shot
                row.append(_graph_us(lambda: tp.fast(t)))
            tp.fast.one_shot = False
            times[n * 2] = tuple(row)
        out.put((rank, bad, times))
        parallel_state.destroy_distributed(timeout_s=30)
    except BaseException as e:  # noqa: BLE001 - reported to the test
        out.put((rank, [f"{type(e).__name__}: {e}"], {}))


def test_custom_all_reduce_equals_nccl():
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with tempfile.TemporaryDirectory() as d:
        init = "file://" + os.path.join(d, "init")
        procs = [ctx.Process(target=_worker, args=(r, init, q)) for r in range(2)]
        for p in procs:
            p.start()
        results = [q.get(timeout=300) for _ in procs]
        for p in procs:
            p.join(60)
    for rank, bad, times in sorted(results):
        for nbytes, (nccl, two, one) in sorted(times.items()):
            print(f"rank {rank} {nbytes} B per call: NCCL {nccl:.1f} us, two-shot {two:.1f} us, "
                  f"one-shot {one:.1f} us")
        assert not bad, (rank, bad)
