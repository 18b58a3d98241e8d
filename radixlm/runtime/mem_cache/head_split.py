"""Compute the head, read the tail: how a waiting request splits a prefix that the store holds
when the GPU has nothing else to do.

A request whose prompt's KV is in the store (a restart on a warm store) waited for the whole read,
the GPU idle meanwhile: a 16k-token 8B prefix read at ~72k tokens/s on an H200 host took 0.23 s
against 0.65 s to recompute it, a TTFT 2.4x lower, where the store could give more. Both can run
at once: the GPU computes the prefix's first h tokens (they need no KV before them) while the
reader threads read the pages after them; the request then goes on with the tail loaded below
its own head. With a compute rate C and a read rate R (tokens/s) the two take equally long at
    h = T * C / (C + R)        (T: the tokens the store found),
and the prefix is ready after T / (C + R) instead of T / R (for C = 30k and R = 72k tokens/s:
0.16 s instead of 0.23 s in theory; measured on an H200 the warm restart's TTFT p50 fell 6-7%,
and docs/hicache.md says where the rest goes). The technique is Cake's ("Compute Or Load KV
Cache? Why Not Both?", Jin et al., 2024), here with one cut point per request chosen from
measured rates.

Only while nothing else wants the GPU (no running batch, no chunk, no step in flight, no other
waiting request ready): under load the GPU's time is the scarce thing and the store's read is
free, so a request reads all of it, as before. Only on CUDA, where the reader's threads run on
host cores that the forward leaves free; on the CPU the forward takes every core.

The rates (mem_cache/tier_transfers.py `_rate`): R is the store's measured read rate; C the
measured rate of heads, and of extends that compute what a head would (one prompt from its first
token: scheduler/split_heads.py `_head_like`), fast per token (short attention); the rate of all
prefills where neither was measured (slower per token: a head cut with it is short, never longer
than balanced). Until this run has measured them, the rates an earlier run kept in the store,
and the read rate a start measures on a few stored pages (tier_prefetch.probe_read_rate).
"""

from __future__ import annotations

from typing import Optional

# a shorter head costs an admission round, a forward and a wait for less than it saves
MIN_HEAD_TOKENS = 512
# weight of the newest head in the head rate's average: heads grow as the estimate does (a
# first one cut with the rate of all prefills is short, and a short head computes fewer tokens
# a second), so the estimate follows them quickly (H200, 8B: heads of 2.6k, 4.4k and 5.5k
# tokens at 26k, 36k and 37k tokens/s; with the usual 0.2 the fifth head was still cut short)
HEAD_RATE_WEIGHT = 0.5


def head_split_pages(pages: int, page: int, compute_tps: Optional[float],
                     read_tps: Optional[float]) -> int:
    """Of `pages` stored pages (of `page` tokens) that follow a request's cached prefix, how many
    leading ones to compute instead of reading: whole pages, the rest (at least one page) read;
    0 when the rates are not measured yet or the head would be under MIN_HEAD_TOKENS."""
    if not compute_tps or not read_tps or pages < 2:
        return 0
    head = int(pages * compute_tps / (compute_tps + read_tps))
    if head * page < MIN_HEAD_TOKENS:
        return 0
    return min(head, pages - 1)
