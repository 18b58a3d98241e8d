"""Tensor-parallel layers: a full layer's weights cut into one rank's piece.

Megatron-style split, as SGLang does it:
- column parallel (qkv_proj, gate_up_proj, LM head): out features split, each rank computes its
  slice of the output; no communication (the slice feeds the rank's own heads / SiLU-and-mul).
  `column_parallel` keeps the layer's class (llama.Linear, layers/cpu_linear.Fp32GemmLinear,
  nn.Linear) so every fast path (CUDA GEMV, fp32 GEMM on CPU) still applies to the slice.
- row parallel (o_proj, down_proj): in features split, each rank multiplies its input slice by
  its weight columns, giving a partial sum of the full output; one all-reduce adds them, then
  the bias (once, not once per rank).
- vocab parallel embedding: rank r holds the rows [r * per, (r + 1) * per) of the table
  (per = ceil(vocab / tp), the last rank padded with zero rows); ids outside the range give zero
  rows, and the all-reduce of the ranks' lookups is the full lookup (exact: x + 0 + ...).
"""

from __future__ import annotations

import contextlib
import copy
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from radixlm.runtime.distributed.parallel_state import TPGroup


def _param(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t.contiguous(), requires_grad=False)


def _sliced_copy(linear: nn.Module, weight: torch.Tensor, bias) -> nn.Module:
    """A copy of `linear` (same class, own parameter dict) holding `weight` (out, in) and `bias`."""
    new = copy.copy(linear)
    new._parameters = dict(linear._parameters)
    new.weight = _param(weight)
    new.bias = None if bias is None else _param(bias)
    new.out_features, new.in_features = weight.shape
    return new


def column_parallel(linear: nn.Module, rows: Sequence[torch.Tensor | slice]) -> nn.Module:
    """The layer restricted to the output rows `rows` (pieces, concatenated in order): e.g. the
    rank's q rows, then its k rows, then its v rows of a fused qkv_proj."""
    w = torch.cat([linear.weight.detach()[r] for r in rows], dim=0)
    b = None if linear.bias is None else torch.cat([linear.bias.detach()[r] for r in rows])
    return _sliced_copy(linear, w, b)


_DEFERRED = [False]  # reduce_deferred's state (the forward runs on one thread)


@contextlib.contextmanager
def reduce_deferred():
    """Inside: every RowParallelLinear returns its rank's partial product (T, out), not yet
    all-reduced (two-batch overlap reduces it itself, asynchronously)."""
    prev, _DEFERRED[0] = _DEFERRED[0], True
    try:
        yield
    finally:
        _DEFERRED[0] = prev


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_r @ W[:, cols_r]^T) + b. x_r (T, in / tp) is the rank's slice of the
    input (its heads' attention output, its slice of the SiLU-and-mul); y (T, out) is whole."""

    def __init__(self, linear: nn.Module, cols: slice, tp: TPGroup):
        super().__init__()
        self.inner = _sliced_copy(linear, linear.weight.detach()[:, cols], None)
        self.bias = None if linear.bias is None else _param(linear.bias.detach())
        self.tp = tp

    @property
    def weight(self) -> torch.Tensor:
        return self.inner.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _DEFERRED[0]:  # the caller reduces (reduce_deferred); no bias then
            assert self.bias is None, "a row-parallel bias cannot wait for a deferred all-reduce"
            return self.inner(x)
        y = self.tp.all_reduce(self.inner(x))
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def extra_repr(self) -> str:
        return f"tp_rank={self.tp.rank}, tp_size={self.tp.size}, bias={self.bias is not None}"


def vocab_range(vocab: int, tp: TPGroup) -> tuple[int, int, int]:
    """(start, end, per): rank tp.rank holds vocab rows [start, end), padded to `per` rows."""
    per = -(-vocab // tp.size)
    start = min(tp.rank * per, vocab)
    return start, min(start + per, vocab), per


def vocab_shard(table: torch.Tensor, vocab: int, tp: TPGroup) -> torch.Tensor:
    """(vocab, hidden) -> the rank's (per, hidden) rows, zero-padded past the vocab."""
    start, end, per = vocab_range(vocab, tp)
    out = table.new_zeros((per,) + tuple(table.shape[1:]))
    out[: end - start] = table[start:end]
    return out


class VocabParallelEmbedding(nn.Module):
    """Embedding lookup over a vocab-split table: (T,) ids -> (T, hidden), all-reduced."""

    def __init__(self, embedding: nn.Embedding, vocab: int, tp: TPGroup):
        super().__init__()
        self.vocab, self.tp = vocab, tp
        self.start, self.end, self.per = vocab_range(vocab, tp)
        self.weight = _param(vocab_shard(embedding.weight.detach(), vocab, tp))  # (per, hidden)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.start) | (ids >= self.end)
        local = (ids - self.start).masked_fill(outside, 0)
        x = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return self.tp.all_reduce(x)

    def extra_repr(self) -> str:
        return f"vocab=[{self.start}, {self.end}) of {self.vocab}, per_rank={self.per}"


def gather_logits(local: torch.Tensor, vocab: int, tp: TPGroup) -> torch.Tensor:
    """(N, per) logits of the rank's vocab rows -> (N, vocab) on every rank (padding cut)."""
    return tp.all_gather(local, dim=-1)[:, :vocab]
