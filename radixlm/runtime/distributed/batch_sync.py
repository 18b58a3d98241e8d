"""Rank 0 -> ranks 1..N-1: each step's ForwardBatch, as int64 tensors over the TP group.

Rank 0 (the scheduler's rank) decides every batch; the other ranks only run the same forward on
their shard. Per step, two broadcasts from rank 0:
  header (7,) int64: [cmd, mode, T, B, N, num_decode_tail, R]   (cmd 1 = forward, 0 = stop)
  payload int64: input_ids (T) | positions (T) | out_cache_loc (T) | req_pool_indices (B)
                 | seq_lens (B) | logits_indices (N) | extend_prefix_lens (B) | extend_lens (B)
                 | req_to_token rows (R = sum of seq_lens: each request's row [:seq_len])
The rows carry whatever rank 0's scheduler wrote there (prefix matches, new slots, retractions),
so a worker's req_to_token equals rank 0's for every row the batch reads; its allocator and
radix cache are never used. Sending the whole rows each step (B * L ints) is the simple choice;
sending only the new entries is an optimization for later.
Not sent: `prefix_groups` (rank 0 runs TP batches without them: ModelRunner drops them) and
`mm_inputs` (no TP for LLaVA, refused by sharding).
"""

from __future__ import annotations

from typing import Optional

import torch

from radixlm.runtime.distributed.parallel_state import TPGroup
from radixlm.runtime.executor.forward_batch import ForwardBatch, ForwardMode

_HEADER = 7
_MODES = (ForwardMode.EXTEND, ForwardMode.DECODE)


def send_batch(tp: TPGroup, fb: ForwardBatch, req_to_token: torch.Tensor) -> None:
    """Rank 0: broadcast `fb` and the req_to_token rows it reads."""
    dev = fb.input_ids.device
    b = fb.batch_size
    seq_lens = fb.seq_lens_cpu or fb.seq_lens.tolist()
    rows = fb.req_pool_indices.tolist()
    r2t = [req_to_token[r, :n] for r, n in zip(rows, seq_lens)]
    extend = fb.mode == ForwardMode.EXTEND
    prefix = fb.extend_prefix_lens_cpu if extend else [0] * b
    ext = fb.extend_lens_cpu if extend else [0] * b
    i64 = lambda x: torch.as_tensor(x, dtype=torch.int64, device=dev)  # noqa: E731
    payload = torch.cat([i64(t) for t in (fb.input_ids, fb.positions, fb.out_cache_loc,
                                          fb.req_pool_indices, fb.seq_lens, fb.logits_indices,
                                          prefix, ext)] + [i64(t) for t in r2t])
    header = i64([1, _MODES.index(fb.mode), fb.num_tokens, b, int(fb.logits_indices.shape[0]),
                  fb.num_decode_tail, sum(seq_lens)])
    tp.broadcast(header)
    tp.broadcast(payload)


def send_stop(tp: TPGroup, device: torch.device | str) -> None:
    """Rank 0: tell the workers to leave their loop."""
    tp.broadcast(torch.zeros(_HEADER, dtype=torch.int64, device=device))


def recv_batch(tp: TPGroup, req_to_token: torch.Tensor,
               device: torch.device | str) -> Optional[ForwardBatch]:
    """Ranks 1..N-1: the next batch (its rows written into `req_to_token`), or None on stop."""
    header = tp.broadcast(torch.empty(_HEADER, dtype=torch.int64, device=device))
    cmd, mode, t, b, n, tail, r = header.tolist()
    if cmd == 0:
        return None
    payload = tp.broadcast(torch.empty(3 * t + 4 * b + n + r, dtype=torch.int64, device=device))
    ids, pos, loc, rpi, seq, logit_rows, prefix, ext, flat = payload.split(
        [t, t, t, b, b, n, b, b, r])
    seq_cpu, rows = seq.tolist(), rpi.tolist()
    start = 0
    for row, length in zip(rows, seq_cpu):
        req_to_token[row, :length] = flat[start : start + length]
        start += length
    fm = _MODES[mode]
    extend = fm == ForwardMode.EXTEND
    return ForwardBatch(mode=fm, input_ids=ids, positions=pos, out_cache_loc=loc,
                        req_pool_indices=rpi, seq_lens=seq, logits_indices=logit_rows,
                        seq_lens_cpu=seq_cpu,
                        extend_prefix_lens_cpu=prefix.tolist() if extend else [],
                        extend_lens_cpu=ext.tolist() if extend else [],
                        num_decode_tail=tail)
