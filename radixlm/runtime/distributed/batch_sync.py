"""Rank 0 -> ranks 1..N-1: each step's ForwardBatch.

Rank 0 (the scheduler's rank) decides every batch; the other ranks only run the same forward on
their shard. Per step, rank 0 sends:
  over the host group (gloo, `TPGroup.broadcast_host`), what a rank's host needs to launch the
  forward without waiting for its GPU, in one message of a fixed size when it fits:
    header (7,) int64: [cmd, mode, T, B, N, num_decode_tail, W]  (cmd 1 = forward, 0 = stop;
                       W = the longest seq_len: the width of the rows sent below)
    lens (B or 3B,) int64: seq_lens, then for EXTEND extend_prefix_lens and extend_lens; in the
                       message's INLINE_LENS slots after the header when they fit, else in a
                       second message (each broadcast is a round trip through gloo, which
                       both ranks' hosts wait for every step: ~0.3 ms on this project's
                       2-core CPU between two processes)
  over the TP group (NCCL on CUDA: in stream order, so the payload may be produced by work
  still queued, e.g. the overlap schedule's input ids, the previous step's samples):
    payload int64: input_ids (T) | positions (T) | out_cache_loc (T) | req_pool_indices (B)
                   | seq_lens (B) | logits_indices (N) | req_to_token rows (B x W, each row's
                   first W entries)
Neither side ever reads a device tensor on the host here. Before this split, everything went
through NCCL and the workers read the header with .tolist(): a worker learnt of step k+1 only
once rank 0's GPU had finished step k, so its host work (receive, scatter, launch) ran while
both GPUs idled, every step, and rank 0 synced on its own req_pool_indices too.

The rows carry whatever rank 0's scheduler wrote there (prefix matches, new slots, retractions),
so a worker's req_to_token equals rank 0's for every row the batch reads; its allocator and
radix cache are never used. Rows are sent whole (B x W ints, W the longest row: a row beyond its
own seq_len carries rank 0's entries there, which no attention reads); sending only new entries
would be smaller but must see every host-side rewrite of a row.
Not sent: `prefix_groups` (rank 0 runs TP batches without them: ModelRunner drops them) and
`mm_inputs` (no TP for LLaVA, refused by sharding).
"""

from __future__ import annotations

from typing import Optional

import torch

from radixlm.runtime.distributed.parallel_state import TPGroup
from radixlm.runtime.executor.forward_batch import ForwardBatch, ForwardMode

_HEADER = 7
INLINE_LENS = 3 * 64  # lens carried in the header's message: a batch of up to 64 rows (extend)
_MODES = (ForwardMode.EXTEND, ForwardMode.DECODE)


def _host(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def send_batch(tp: TPGroup, fb: ForwardBatch, req_to_token: torch.Tensor) -> None:
    """Rank 0: broadcast `fb` and the req_to_token rows it reads (no device-to-host sync)."""
    b, t, n = fb.batch_size, fb.num_tokens, int(fb.logits_indices.shape[0])
    seq_lens = fb.seq_lens_cpu
    if len(seq_lens) != b:
        raise ValueError(f"a TP batch needs seq_lens_cpu ({len(seq_lens)} values for {b} rows)")
    extend = fb.mode == ForwardMode.EXTEND
    lens = list(seq_lens) + (list(fb.extend_prefix_lens_cpu) + list(fb.extend_lens_cpu)
                             if extend else [])
    width = max(seq_lens, default=0)
    header = [1, _MODES.index(fb.mode), t, b, n, fb.num_decode_tail, width]
    inline = len(lens) <= INLINE_LENS
    tp.broadcast_host(_message(header, lens if inline else []))
    if not inline:
        tp.broadcast_host(_host(lens))
    parts = [fb.input_ids, fb.positions, fb.out_cache_loc, fb.req_pool_indices, fb.seq_lens,
             fb.logits_indices, req_to_token[fb.req_pool_indices, :width].reshape(-1)]
    tp.broadcast(torch.cat([p.to(torch.int64) for p in parts]))


def _message(header: list[int], lens: list[int]) -> torch.Tensor:
    """The host group's fixed-size message: header, then lens (if inline), zeros after."""
    msg = torch.zeros(_HEADER + INLINE_LENS, dtype=torch.int64)
    msg[:_HEADER] = _host(header)
    if lens:
        msg[_HEADER:_HEADER + len(lens)] = _host(lens)
    return msg


def send_stop(tp: TPGroup) -> None:
    """Rank 0: tell the workers to leave their loop."""
    tp.broadcast_host(_message([0] * _HEADER, []))


def recv_batch(tp: TPGroup, req_to_token: torch.Tensor,
               device: torch.device | str) -> Optional[ForwardBatch]:
    """Ranks 1..N-1: the next batch (its rows written into `req_to_token`), or None on stop.
    Blocks on the host group until rank 0 sends; then only enqueues device work."""
    msg = tp.broadcast_host(torch.empty(_HEADER + INLINE_LENS, dtype=torch.int64)).tolist()
    cmd, mode, t, b, n, tail, width = msg[:_HEADER]
    if cmd == 0:
        return None
    fm = _MODES[mode]
    extend = fm == ForwardMode.EXTEND
    n_lens = b * (3 if extend else 1)
    if n_lens <= INLINE_LENS:
        lens = msg[_HEADER:_HEADER + n_lens]
    else:
        lens = tp.broadcast_host(torch.empty(n_lens, dtype=torch.int64)).tolist()
    payload = tp.broadcast(torch.empty(3 * t + 2 * b + n + b * width, dtype=torch.int64,
                                       device=device))
    ids, pos, loc, rpi, seq, logit_rows, rows = payload.split([t, t, t, b, b, n, b * width])
    if b and width:
        req_to_token[rpi, :width] = rows.view(b, width).to(req_to_token.dtype)
    return ForwardBatch(mode=fm, input_ids=ids, positions=pos, out_cache_loc=loc,
                        req_pool_indices=rpi, seq_lens=seq, logits_indices=logit_rows,
                        seq_lens_cpu=lens[:b],
                        extend_prefix_lens_cpu=lens[b : 2 * b] if extend else [],
                        extend_lens_cpu=lens[2 * b :] if extend else [],
                        num_decode_tail=tail)
