"""Does a small host -> device copy wait behind large ones queued on another stream (GPU)?

    python benchmarks/probes/copy_engine.py

The hierarchical cache's loads (mem_cache/kv_mover.py) DMA hundreds of MB a request on their own
stream; a forward's inputs (a few KB, scheduler/batch_builder.py) go host -> device on the compute
stream. An H200 timeline of the multi-turn benchmark (probes/step_timeline.py) showed extends
whose start waited 10-100 ms on the GPU while loads were queued. This measures, on one GPU
(not yet run: its one call stopped at a name clash, fixed since):
  fifo        BIG x 128 MiB DMAs queued on stream A, then one 8 KiB copy on stream B: when the
              small copy completes (ms after it was queued), against the DMAs' total
  fifo_small_by_kernel  the same with the small copy made by executor/uva_copy.py's kernel
  uva_fifo    the big copies made by a Triton kernel that reads the pinned host rows itself
              (rows_by_kernel: no copy engine, the GPU's SMs load over PCIe), CTAs 8..132:
              its GB/s, and the small copy's wait meanwhile (a way the loads could go)
  uva_gemm    a bf16 GEMM's slowdown while the kernel runs beside it (the SMs it takes)
One JSON line each.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import triton
import triton.language as tl

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if _ROOT not in sys.path:  # run as a script: the repository's packages
    sys.path.insert(0, _ROOT)

from benchmarks.offline_throughput import emit_result, git_commit  # noqa: E402
from radixlm.runtime.executor import uva_copy  # noqa: E402


@triton.jit
def _rows_from_host(Src, Dst, Slots, n_rows, row_words, BLOCK: tl.constexpr):
    # Src (n_rows, row_words) int64 in pinned host memory (read through UVA), Dst (cap,
    # row_words) int64 on the device: Dst[Slots[r]] = Src[r], a persistent grid walking rows
    pid, grid = tl.program_id(0), tl.num_programs(0)
    cols = tl.arange(0, BLOCK)
    for r in range(pid, n_rows, grid):
        slot = tl.load(Slots + r).to(tl.int64)
        src = Src + r * row_words  # (i32: the probe moves < 2^31 words)
        dst = Dst + slot * row_words
        for c in range(0, row_words, BLOCK):
            m = c + cols < row_words
            tl.store(dst + c + cols, tl.load(src + c + cols, mask=m), mask=m)


def rows_by_kernel(src: torch.Tensor, dst: torch.Tensor, slots: torch.Tensor, ctas: int,
             block: int = 2048, warps: int = 8) -> None:
    _rows_from_host[(ctas,)](src, dst, slots, src.shape[0], src.shape[1], BLOCK=block,
                             num_warps=warps)


def _ms(a, b):
    return a.elapsed_time(b)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--big", type=int, default=8, help="128 MiB copies queued")
    ap.add_argument("--result-file", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    row_words = 16384  # 128 KiB: one token of an 8B model's KV (all layers)
    rows = 1024  # 128 MiB
    host = torch.randint(0, 1 << 62, (args.big, rows, row_words), dtype=torch.int64).pin_memory()
    dst = torch.empty(args.big * rows + 1, row_words, dtype=torch.int64, device=dev)
    small = torch.arange(1024, dtype=torch.int64).pin_memory()
    small_dev = torch.empty_like(small, device=dev)
    a, b = torch.cuda.Stream(), torch.cuda.Stream()
    out = []

    def event(stream):
        e = torch.cuda.Event(enable_timing=True)
        e.record(stream)
        return e

    def small_copy_wait(issue_big, by_kernel=False):
        torch.cuda.synchronize()
        t0 = event(a)
        issue_big()
        end_big = event(a)
        time.sleep(0.002)  # the small copy queued after the big ones
        s0 = event(b)
        with torch.cuda.stream(b):
            if by_kernel:  # the engine's fix: executor/uva_copy.py
                uva_copy.copy_words(small, small_dev)
            else:
                small_dev.copy_(small, non_blocking=True)
        s1 = event(b)
        torch.cuda.synchronize()
        return {"big_ms": round(_ms(t0, end_big), 2), "small_done_ms": round(_ms(t0, s1), 2),
                "small_queued_ms": round(_ms(t0, s0), 2)}

    def dma():
        with torch.cuda.stream(a):
            for i in range(args.big):
                dst[1 + i * rows:1 + (i + 1) * rows].copy_(host[i], non_blocking=True)

    slots = torch.arange(1, 1 + rows, device=dev)
    for _ in range(2):
        r = small_copy_wait(dma)
    out.append({"probe": "copy_engine", "test": "fifo", **r,
                "gb_s": round(args.big * rows * row_words * 8 / r["big_ms"] / 1e6, 1)})
    assert uva_copy.available(dev), "uva_copy unavailable on this GPU (see the warning)"
    for _ in range(2):
        r = small_copy_wait(dma, by_kernel=True)
    out.append({"probe": "copy_engine", "test": "fifo_small_by_kernel", **r})
    for ctas in (8, 16, 32, 66, 132):
        def kernel(ctas=ctas):
            with torch.cuda.stream(a):
                for i in range(args.big):
                    rows_by_kernel(host[i], dst, slots + i * rows, ctas)
        kernel()  # compile, warm
        torch.cuda.synchronize()
        assert torch.equal(dst[1:1 + rows].cpu(), host[0]), "the UVA copy moved other bytes"
        r = small_copy_wait(kernel)
        out.append({"probe": "copy_engine", "test": "uva_fifo", "ctas": ctas, **r,
                    "gb_s": round(args.big * rows * row_words * 8 / r["big_ms"] / 1e6, 1)})
    x = torch.randn(8192, 4096, device=dev, dtype=torch.bfloat16)
    w = torch.randn(4096, 14336, device=dev, dtype=torch.bfloat16)
    for ctas in (0, 16, 32):
        torch.cuda.synchronize()
        if ctas:
            with torch.cuda.stream(a):
                for _ in range(4):
                    for i in range(args.big):
                        rows_by_kernel(host[i], dst, slots + i * rows, ctas)
        g0 = event(b)
        with torch.cuda.stream(b):
            for _ in range(20):
                x @ w
        g1 = event(b)
        torch.cuda.synchronize()
        out.append({"probe": "copy_engine", "test": "uva_gemm", "ctas": ctas,
                    "gemm_ms": round(_ms(g0, g1) / 20, 3)})
    for line in out:  # (stamped with the date and the command)
        emit_result({**line, "device": torch.cuda.get_device_name(), "git_commit": git_commit()},
                    args.result_file, __file__)


if __name__ == "__main__":
    main()
