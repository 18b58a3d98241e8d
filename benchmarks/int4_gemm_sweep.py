"""The int4 GEMM's config sweep for benchmarks/int4_decode.py --kernels: which tiles to time at a
batch size, and a parallel precompile so that one GPU call can time them all.

Triton compiles a config in about a second and the grid below has a few hundred distinct
kernels (tile x split-K x EVEN_K), serially most of a 10-minute call; the timing itself is
milliseconds a config. So `precompile` first runs every config once at its real shape in a
pool of processes (one CUDA context each), which fills Triton's on-disk cache; the timing loop
in the parent then only loads cubins. A config that does not fit (shared memory, registers)
or fails to compile is returned and skipped by the timing loop (reported as a sweep error)."""

from __future__ import annotations

from benchmarks.kernel_bench import pool_failures

# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)
GEMM_TILES = tuple((bm, bn, bk, w, st) for bm in (16, 32, 64) for bn in (64, 128, 256)
                   for bk in (64, 128) for w in (4, 8) for st in (2, 3, 4))
# M > 64 (prefill) also: 128-row tiles, 8 warps (gemm_config's prefill default is one)
PREFILL_TILES = tuple((128, bn, bk, 8, st) for bn in (64, 128, 256) for bk in (64, 128)
                      for st in (2, 3, 4))


def gemm_sweep(m: int, n: int, k: int) -> list[tuple]:
    """GEMM configs (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, SPLIT_K) to time at (M, N, K):
    the tiles of GEMM_TILES with BLOCK_M >= min(M, 64) / 2 (a tile of half the batch: two row
    tiles, fewer registers), and PREFILL_TILES above M = 64, each with split-K 1, the rule's
    split, and twice it (at least 2 steps of BLOCK_K a split)."""
    from radixlm.runtime.layers import triton_int4_gemm as tg

    out = []
    for bm, bn, bk, w, st in GEMM_TILES + (PREFILL_TILES if m > 64 else ()):
        if bm < min(m, 64) // 2:
            continue
        tiles = -(-m // bm) * -(-n // bn)
        split = tg.split_for(m, tiles, k, bk)  # gemm_config's rule
        for sp in sorted({1, split, 2 * split} if split > 1 else {1}):
            if k // (bk * sp) >= 2:
                out.append((bm, bn, bk, w, st, sp))
    return out


def _worker(job):
    """Run each config once at its shape (compiles it into Triton's disk cache). Returns
    {(n, k, m, cfg): error} for the configs that failed to compile or launch; stops at the
    first other error (a CUDA fault poisons the context), leaving the rest to the parent."""
    import torch
    from triton.compiler.errors import CompilationError
    from triton.runtime.errors import OutOfResources

    from radixlm.runtime.layers import int4_linear, triton_int4_gemm

    n, k, m, cfgs = job
    torch.manual_seed(0)
    lyr = int4_linear.Int4Linear.quantize(
        torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02, 128)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    failed = {}
    for cfg in cfgs:
        try:
            triton_int4_gemm.gemm(x, lyr.qweight, lyr.scales, lyr.zeros, 128, config=cfg)
            torch.cuda.synchronize()
        except (OutOfResources, CompilationError) as e:
            failed[n, k, m, tuple(cfg)] = f"{type(e).__name__}: {str(e)[:60]}"
        except Exception:  # noqa: BLE001 (left to the parent's own try)
            break
    return failed


def precompile(jobs, workers: int = 0, chunk: int = 6) -> dict:
    """jobs: (n, k, m, configs). Compiles them all in `workers` processes (default: the CPU
    count less one, at most 15). Returns the failures {(n, k, m, cfg): error}."""
    if not jobs:
        return {}
    # configs cut into chunks: the pool balances the load (a kernel two chunks share, the
    # same config at another shape, may compile twice at once: harmless, the cache is atomic)
    parts = [(n, k, m, cfgs[i:i + chunk]) for n, k, m, cfgs in jobs
             for i in range(0, len(cfgs), chunk)]
    return pool_failures(_worker, parts, workers)
