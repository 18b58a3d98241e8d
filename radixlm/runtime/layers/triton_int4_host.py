"""Host-side parts of the int4 GEMV (layers/triton_int4.gemv, M = 1): its configs (the
default a shape, the meaning of a config tuple's values) and split-K's arrival counters (the
kernels: triton_int4.py, triton_int4_stream.py)."""

from __future__ import annotations

from typing import Optional

import torch
import triton


def gemv_config(n: int, k: int) -> tuple:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages, PREFETCH, SPLIT_K[, CACHE]) for M == 1
    (PREFETCH: see triton_int4._gemv_rows; SPLIT_K: programs a row tile along K; CACHE 2: the
    weights loaded evict-first, see _gemv_knobs): first by reasoning and
    the sm_90 compile (the points below), then by timing (the last paragraph):
    - num_warps = BLOCK_K / 1024: Triton lays the (BLOCK_N, BLOCK_K/32, 4) word tile out as
      one 16-byte block per thread, 32 threads along a row, warps along the row too; x's
      (BLOCK_K/32, 4) load then has 4 values a thread in exactly that layout. With fewer
      blocks than 32 x warps (e.g. 1024 values on 4 warps) Triton loads x one value a thread
      and converts it through shared memory with a barrier, 8 times a step (the TTGIR shows
      11 convert_layout against 3).
    - BLOCK_N 8: each thread holds 8 rows x 4 words, so one x load serves 8 rows and z, s per
      (row, block) serve 32 values; 147 registers, no spills (16 rows at BLOCK_K 2048: 255
      registers and spills).
    - BLOCK_K 2048 = 1 KB of a row a step, 8 KB a program a step, 3 stages: K = 4096 is 2
      steps, all of a program's 16 KB requested at once; N = 4096 gives 512 programs of 2
      warps (~4 an SM: ~64 KB in flight an SM, what 4.8 TB/s x ~1 us of latency / 132 asks).
    Smaller K: BLOCK_K the power of two >= K (ragged K is masked), warps accordingly.
    Timed (H100, 2026-11-27, benchmarks/int4_gemv_sweep.py, 379 timings of the Llama-3.1-8B
    shapes, weights read from HBM): at K >= 2048 the best for every shape was 4 rows x BLOCK_K
    2048 on 2 warps in ONE stage (each program issues all its loads at once): qkv 14.2 -> 11.3,
    o 11.9 -> 7.9, gate_up 54.2 -> 40.1, down 27.6 -> 22.8 us (1.1-1.5 TB/s; tinygemm 0.8-0.9x
    of that time); down (K = 14336, 7 steps) with PREFETCH 2. No split-K config won (SPLIT_K 1).
    A second sweep (same day, H100, 752 timings with the cache, unroll, register-cap, persistent
    and LEAN variants) gained 3-10% at most; the plain config with evict-first weight loads
    (CACHE 2, PREFETCH 0) was best or within 5% of the best for every shape: down 22.8 -> 20.9,
    gate_up with the SiLU 41.6 -> 40.4, o 7.9 -> 7.4-7.7 us (qkv's best, 10.2 us, was BLOCK_K
    1024 on 1 warp unrolled twice with LEAN: not taken, one rule for all).
    Below K = 2048 the reasoning above stands (untimed)."""
    if k >= 2048:
        return 4, 2048, 2, 1, 0, 1, 2
    bk = max(32, min(2048, triton.next_power_of_2(k)))
    return 8, bk, max(1, bk // 1024), 3, 0, 1


def _gemv_knobs(config) -> tuple:
    """A config's 11 values from gemv_config's 6, or 4 or 5 (PREFETCH 0, SPLIT_K 1 when left
    out), or 7 to 11 (the streaming knobs, 0 / 1 / 0 / 0 / 0 when left out): CACHE (the word
    loads' cache operator: 0 default, 1 .cg, 2 evict_first), UNROLL (the K loop's unroll
    factor, 1: none), MAXNREG (ptxas' register cap a thread, 0: none; a lower cap fits more
    programs an SM, at the price of spills), PERSIST (0: a program a row tile; p > 0: p
    programs an SM stream the row tiles one after another, the next tile's words in flight
    during this tile's math: triton_int4_stream) and LEAN (1: fewer instructions a value,
    the same values: nibbles 5..7 one LOP3 each, bf16 x read as int32 pairs, no masks where
    N and K are whole tiles; triton_int4_dequant._gemv_block_sums, triton_int4._gemv_rows)."""
    assert 4 <= len(config) <= 11, config
    block_n, block_k, warps, stages, prefetch, split, cache, unroll, maxnreg, persist, lean = \
        tuple(config) + (0, 1, 0, 1, 0, 0, 0)[len(config) - 4:]
    prefetch = int(prefetch)
    assert prefetch in (0, 1, 2) and cache in (0, 1, 2) and unroll >= 1, config
    assert block_k % 32 == 0 and block_k & (block_k - 1) == 0 and split >= 1, config
    assert maxnreg == 0 or 24 <= maxnreg <= 255, config
    assert persist == 0 or (split == 1 and prefetch == 0 and stages == 1 and unroll == 1), \
        f"PERSIST streams its own way (stages 1, its own prefetch, no split-K): {config}"
    assert lean in (0, 1), config
    return (block_n, block_k, warps, stages, prefetch, split, cache, unroll, maxnreg, persist,
            bool(lean))


_COUNTERS: dict = {}  # device -> int32 zeros: split-K arrival counters, one a row tile


def _counters(device: torch.device, tiles: int) -> Optional[torch.Tensor]:
    """The split-K counters (all zero between calls: each call's last split resets its own), or
    None when they would first be allocated inside a CUDA graph capture (a capture records the
    zero-fill without running it: the call then runs without split-K). Own counters, not the
    GEMM's: the two kernels never run at once on a stream, but need not share a size."""
    return split_counters(_COUNTERS, device, tiles, 16384)


def split_counters(store: dict, device: torch.device, tiles: int,
                   floor: int) -> Optional[torch.Tensor]:
    """store[device]: (>= max(tiles, floor),) int32 zeros, grown when too short; None when
    they would first be allocated inside a CUDA graph capture (the GEMV's and the GEMM's
    split-K counters, each in its own store)."""
    c = store.get(device)
    if c is None or c.numel() < tiles:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        c = torch.zeros(max(tiles, floor), dtype=torch.int32, device=device)
        store[device] = c
    return c
