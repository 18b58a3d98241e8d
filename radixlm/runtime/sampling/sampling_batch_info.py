"""Per-batch sampling state: the requests' sampling parameters laid out as (B, ...) tensors.

Built once when a batch's composition changes (`from_reqs`), then kept across decode steps and
edited in place (`filter` when requests finish, `merge` when a prefilled batch joins the running
one), so a decode step never walks the requests in Python to gather parameters.

Row i always describes the batch's i-th request. Shapes: B = rows, V = vocab_size.

Large (B, V) tensors exist only while some row needs them:
- `output_counts` (float32): how often each token occurs in the request's output so far; frequency,
  presence and repetition penalties read it (a row with no penalty ignores its row's contents).
- `prompt_seen` (bool): token occurs in the prompt; the repetition penalty (HF / vLLM semantics)
  also penalizes prompt tokens, the OpenAI-style frequency/presence penalties do not.
- `stop_mask` (bool): the request's stop tokens, blocked while `min_tokens_left > 0`.
- `logit_bias` (float32): the request's `logit_bias` {token: bias} as a dense row (0 elsewhere),
  added to the logits after the penalties, before the hard masks (SGLang's order).

Host-side flags (`is_all_greedy`, `need_*`, the min-tokens deadline) are plain Python values kept
next to the tensors, so deciding which kernels to run never reads a device tensor (no sync).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Optional

import torch

from radixlm.runtime.executor.host_staging import staged, staged_parts
from radixlm.runtime.request import Req


@dataclass
class _RowFlags:
    """Host-side per-row facts that decide which work a step does; lists of length B."""

    greedy: list[bool]
    top_k: list[int]  # already mapped: -1 -> vocab_size
    top_p: list[float]
    min_p: list[float]
    freq_or_presence: list[bool]
    repetition: list[bool]
    seeded: list[bool]
    biased: list[bool]  # the row has a logit_bias
    # Step number (see SamplingBatchInfo.step) at which the row's min_new_tokens is satisfied.
    min_tokens_deadline: list[int]

    def take(self, keep: list[int]) -> "_RowFlags":
        return _RowFlags(**{k: [v[i] for i in keep] for k, v in vars(self).items()})

    def extend(self, other: "_RowFlags", deadline_shift: int) -> None:
        for k, v in vars(self).items():
            o = getattr(other, k)
            v.extend([d + deadline_shift for d in o] if k == "min_tokens_deadline" else o)


class SamplingBatchInfo:
    def __init__(self, vocab_size: int, device: torch.device | str):
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.step = 0  # number of update() calls so far; min-token deadlines count in these steps
        self.flags: _RowFlags
        self.temperatures: torch.Tensor  # (B, 1) float32; greedy rows hold 1.0 (never divide by 0)
        self.top_ps: torch.Tensor  # (B,) float32
        self.top_ks: torch.Tensor  # (B,) int64, in [1, V]
        self.min_ps: torch.Tensor  # (B,) float32
        self.greedy_rows: torch.Tensor  # (B,) bool
        self.frequency_penalties: torch.Tensor  # (B,) float32
        self.presence_penalties: torch.Tensor  # (B,) float32
        self.repetition_penalties: torch.Tensor  # (B,) float32
        self.output_counts: Optional[torch.Tensor] = None  # (B, V) float32
        self.prompt_seen: Optional[torch.Tensor] = None  # (B, V) bool
        self.min_tokens_left: Optional[torch.Tensor] = None  # (B,) int64
        self.stop_mask: Optional[torch.Tensor] = None  # (B, V) bool
        self.logit_bias: Optional[torch.Tensor] = None  # (B, V) float32
        # Set by grammar code before sampling (True = allowed); consumed by one step (update()
        # clears it) so a stale mask can never constrain the next token.
        self.vocab_mask: Optional[torch.Tensor] = None  # (B, V) bool

    # --- construction ---------------------------------------------------------------------------
    @classmethod
    def from_reqs(cls, reqs: list[Req], vocab_size: int, device) -> "SamplingBatchInfo":
        info = cls(vocab_size, device)
        V, dev = vocab_size, info.device
        ps = [r.sampling_params for r in reqs]
        info.flags = _RowFlags(
            greedy=[p.is_greedy for p in ps],
            top_k=[V if p.top_k == -1 else min(p.top_k, V) for p in ps],
            top_p=[float(p.top_p) for p in ps],
            min_p=[float(p.min_p) for p in ps],
            freq_or_presence=[p.frequency_penalty != 0 or p.presence_penalty != 0 for p in ps],
            repetition=[p.repetition_penalty != 1 for p in ps],
            seeded=[p.seed is not None for p in ps],
            biased=[bool(p.logit_bias) for p in ps],
            min_tokens_deadline=[max(0, p.min_new_tokens - len(r.output_ids))
                                 for p, r in zip(ps, reqs)],
        )
        info._refresh_flags()

        # the per-row values in one (8, B) float32 host tensor and one copy, through pinned
        # memory on CUDA: a copy from pageable memory waits for the GPU work queued before it,
        # and a batch is built while a step is in flight (the overlap schedule). top_k (<= V)
        # and the greedy flag are exact in float32 (V < 2**24).
        greedy = info.flags.greedy
        rows = torch.tensor([[1.0 if g else float(p.temperature) for g, p in zip(greedy, ps)],
                             info.flags.top_p, info.flags.min_p,
                             [float(p.frequency_penalty) for p in ps],
                             [float(p.presence_penalty) for p in ps],
                             [float(p.repetition_penalty) for p in ps],
                             info.flags.top_k, greedy], dtype=torch.float32)  # (8, B)
        if dev.type == "cuda":
            rows = rows.pin_memory()
        rows = rows.to(dev, non_blocking=True)
        info.temperatures = rows[0].view(-1, 1)
        info.top_ps, info.min_ps = rows[1], rows[2]
        info.frequency_penalties, info.presence_penalties = rows[3], rows[4]
        info.repetition_penalties = rows[5]
        info.top_ks = rows[6].to(torch.int64)
        info.greedy_rows = rows[7] > 0.5

        if info.need_penalties:
            # One scatter from a flat (row, token) list instead of a per-request tensor op. Rows
            # without a penalty never read their counts, so their outputs are not counted here
            # (update() does count them: a zero-weight row is harmless and keeps it batched).
            uses = [a or b for a, b in zip(info.flags.freq_or_presence, info.flags.repetition)]
            rows, toks = _flatten([r.output_ids if u else [] for r, u in zip(reqs, uses)], dev)
            info.output_counts = torch.zeros(len(reqs), V, dtype=torch.float32, device=dev)
            info.output_counts.index_put_((rows, toks), torch.ones_like(toks, dtype=torch.float32),
                                          accumulate=True)
        if info.need_repetition:
            rows, toks = _flatten([r.vocab_input_ids() if rep else []
                                   for r, rep in zip(reqs, info.flags.repetition)], dev)
            info.prompt_seen = torch.zeros(len(reqs), V, dtype=torch.bool, device=dev)
            info.prompt_seen[rows, toks] = True
        if info.need_logit_bias:
            # One scatter from the flat (row, token, bias) triples of the rows that have a bias.
            biases = [p.logit_bias or {} for p in ps]
            rows, toks = _flatten([[int(t) for t in b] for b in biases], dev)
            vals = torch.tensor([v for b in biases for v in b.values()], dtype=torch.float32,
                                device=dev)
            info.logit_bias = torch.zeros(len(reqs), V, dtype=torch.float32, device=dev)
            info.logit_bias.index_put_((rows, toks), vals)
        if info.need_min_tokens:
            info.min_tokens_left = staged(info.flags.min_tokens_deadline, dev)
            rows, toks = _flatten([sorted(r.stop_token_ids) if d > 0 else []
                                   for r, d in zip(reqs, info.flags.min_tokens_deadline)], dev)
            info.stop_mask = torch.zeros(len(reqs), V, dtype=torch.bool, device=dev)
            info.stop_mask[rows, toks] = True
        return info

    # --- host-side flags (no device reads) ------------------------------------------------------
    def _refresh_flags(self) -> None:
        """Recompute the cached host flags from the per-row lists; called only when rows change,
        so a decode step reads plain attributes instead of looping over requests."""
        f, V = self.flags, self.vocab_size
        sampled = [i for i, g in enumerate(f.greedy) if not g]  # rows that are not argmax
        self.is_all_greedy = not sampled
        self.any_greedy = len(sampled) < len(f.greedy)
        restricted_ks = [f.top_k[i] for i in sampled if f.top_k[i] < V]
        self.need_top_k = bool(restricted_ks)
        self.max_top_k = max(restricted_ks, default=0)  # largest restricting top_k (0: none)
        self.need_top_p = any(f.top_p[i] < 1.0 for i in sampled)
        self.need_min_p = any(f.min_p[i] > 0.0 for i in sampled)
        self.need_freq_presence = any(f.freq_or_presence)
        self.need_repetition = any(f.repetition)
        self.need_penalties = self.need_freq_presence or self.need_repetition
        self.need_logit_bias = any(f.biased)
        self.seeded_rows = [i for i in sampled if f.seeded[i]]
        self._min_tokens_until = max(f.min_tokens_deadline, default=0)

    def __len__(self) -> int:
        return len(self.flags.greedy)

    @property
    def need_min_tokens(self) -> bool:
        """Some row still has min_new_tokens to produce (a host int compare, no device read)."""
        return self._min_tokens_until > self.step

    # --- the per-step work ----------------------------------------------------------------------
    def apply_penalties_and_masks(self, logits: torch.Tensor) -> None:
        """In place on logits (B, V) float32. Order as in vLLM: repetition, then frequency /
        presence, then logit_bias, then the hard masks (min_new_tokens stop tokens, grammar
        vocab_mask)."""
        if self.output_counts is not None:
            counts = self.output_counts  # (B, V)
            if self.need_repetition:
                # HF semantics: a seen token's logit moves toward "less likely" whatever its sign.
                seen = counts > 0
                if self.prompt_seen is not None:
                    seen |= self.prompt_seen
                rep = self.repetition_penalties.view(-1, 1)  # (B, 1)
                penalized = torch.where(logits > 0, logits / rep, logits * rep)
                torch.where(seen, penalized, logits, out=logits)
            if self.need_freq_presence:
                # OpenAI semantics: logit -= frequency * count + presence * [count > 0]
                logits.addcmul_(counts, self.frequency_penalties.view(-1, 1), value=-1.0)
                logits.sub_((counts > 0) * self.presence_penalties.view(-1, 1))
        if self.logit_bias is not None:
            logits.add_(self.logit_bias)
        if self.stop_mask is not None:
            active = (self.min_tokens_left > 0).view(-1, 1)  # (B, 1)
            logits.masked_fill_(self.stop_mask & active, float("-inf"))
        if self.vocab_mask is not None:
            logits.masked_fill_(~self.vocab_mask, float("-inf"))

    def update(self, next_token_ids: torch.Tensor) -> None:
        """After sampling: next_token_ids (B,) int64, one new output token per row."""
        if self.output_counts is not None:
            ones = torch.ones(len(self), 1, dtype=torch.float32, device=self.device)
            self.output_counts.scatter_add_(1, next_token_ids.view(-1, 1), ones)
        self._step_done(1)

    def _step_done(self, appended) -> None:
        """`appended`: tokens each row got this step (1, or a list with one count per row)."""
        self.step += 1
        if self.min_tokens_left is not None:
            if self.need_min_tokens:
                if not isinstance(appended, int):
                    appended = staged(appended, self.device)
                self.min_tokens_left.sub_(appended).clamp_(min=0)
            else:  # every row has its minimum: drop the (B, V) mask (host-side decision)
                self.min_tokens_left = self.stop_mask = None
        self.vocab_mask = None

    # --- batch edits ------------------------------------------------------------------------------
    _ROW_TENSORS = ("temperatures", "top_ps", "top_ks", "min_ps", "greedy_rows",
                    "frequency_penalties", "presence_penalties", "repetition_penalties")
    _OPTIONAL_TENSORS = ("output_counts", "prompt_seen", "min_tokens_left", "stop_mask",
                         "vocab_mask", "logit_bias")

    def take(self, rows: list[int], index: Optional[torch.Tensor] = None,
             lazy: bool = False) -> "SamplingBatchInfo":
        """A new batch of rows `rows` of this one (repeats allowed: speculative verification
        samples one request at several positions); this one is unchanged. `index`: the same
        rows as a device tensor, when the caller has one (no host -> device copy). `lazy`: a
        read-only view for one step: each tensor is gathered on its first read (a greedy batch
        without penalties reads none of them: 8 index_selects fewer per verify step); reading
        it after this batch's tensors change gives the new values."""
        new = SamplingBatchInfo(self.vocab_size, self.device)
        new.step = self.step
        new.flags = self.flags.take(rows)
        new._refresh_flags()
        idx = staged(rows, self.device) if index is None else index
        for name in self._ROW_TENSORS + self._OPTIONAL_TENSORS:
            t = getattr(self, name)
            if t is None:
                setattr(new, name, None)
            elif lazy:  # (unset: __init__ sets the optional ones to None)
                new.__dict__.pop(name, None)
                new.__dict__.setdefault("_lazy", {})[name] = (t, idx)
            else:
                setattr(new, name, t.index_select(0, idx))
        return new

    def __getattr__(self, name: str):
        # only for attributes not set: a lazy take's tensors, gathered on first read
        lazy = self.__dict__.get("_lazy")
        if lazy is None or name not in lazy:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        t, idx = lazy.pop(name)
        value = t.index_select(0, idx)
        setattr(self, name, value)
        return value

    def advance(self, rows: list[int], tokens: list[int], counts: list[int]) -> None:
        """update() for a step that appended counts[i] >= 1 tokens to row i: rows, tokens (N,)
        list every appended token (N = sum(counts)), copied to the device only when the
        penalties' counts need them. The host-side min-token deadlines count steps, so they
        stay conservative (a row has at least as many tokens as steps); `min_tokens_left` is
        exact."""
        if self.output_counts is not None:
            row_ids, token_ids = staged_parts([rows, tokens], self.device)
            ones = torch.ones(len(tokens), dtype=torch.float32, device=self.device)
            self.output_counts.index_put_((row_ids, token_ids), ones, accumulate=True)
        self._step_done(counts)

    def filter(self, keep: list[int]) -> None:
        """Keep rows `keep` (indices into the current rows, in the new order)."""
        step = self.step
        self.__dict__.update(self.take(keep).__dict__)
        self.step = step
        self._drop_unneeded()

    def _drop_unneeded(self) -> None:
        """Drop (B, V) tensors that no remaining row needs."""
        if not self.need_penalties:
            self.output_counts = None
        if not self.need_repetition:
            self.prompt_seen = None
        if not self.need_min_tokens:
            self.min_tokens_left = self.stop_mask = None
        if not self.need_logit_bias:
            self.logit_bias = None

    def keep_first(self, n: int) -> None:
        """filter(list(range(n))) without a host -> device index copy (which, on a GPU, waits
        for the work queued before it): the first n rows of each tensor, as views; a lazy
        take's pending tensors keep the first n of their index. For batches whose tensors no
        one else holds (a draft chain's take: its requests drafting deepest first)."""
        step = self.step
        self.flags = self.flags.take(list(range(n)))
        self._refresh_flags()
        lazy = self.__dict__.get("_lazy")
        for name, (t, idx) in list((lazy or {}).items()):
            lazy[name] = (t, idx[:n])
        for name in self._ROW_TENSORS + self._OPTIONAL_TENSORS:
            t = self.__dict__.get(name)
            if t is not None:
                self.__dict__[name] = t[:n]
        self.step = step
        self._drop_unneeded()

    def merge(self, other: "SamplingBatchInfo") -> None:
        """Append other's rows after ours. A (B, V) tensor that only one side has is padded with
        the neutral value (zero counts, nothing seen, no stop mask, all tokens allowed)."""
        assert other.vocab_size == self.vocab_size
        n_self, n_other = len(self), len(other)
        # Re-express other's min-token deadlines in our step count.
        self.flags.extend(other.flags, deadline_shift=self.step - other.step)
        self._refresh_flags()
        for name in self._ROW_TENSORS:
            setattr(self, name, torch.cat([getattr(self, name), getattr(other, name)]))
        neutral = {"output_counts": 0.0, "prompt_seen": False, "min_tokens_left": 0,
                   "stop_mask": False, "vocab_mask": True, "logit_bias": 0.0}
        for name in self._OPTIONAL_TENSORS:
            a, b = getattr(self, name), getattr(other, name)
            if a is None and b is None:
                continue
            ref = a if a is not None else b
            if a is None:
                a = torch.full((n_self, *ref.shape[1:]), neutral[name], dtype=ref.dtype,
                               device=self.device)
            if b is None:
                b = torch.full((n_other, *ref.shape[1:]), neutral[name], dtype=ref.dtype,
                               device=self.device)
            setattr(self, name, torch.cat([a, b]))


def _flatten(id_lists: list[list[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Row and token index tensors (N,) for every (row, token) pair, N = total ids: the tokens go
    to the device in one copy and the row ids are expanded there (no per-token Python work)."""
    flat = list(itertools.chain.from_iterable(id_lists))
    lengths, toks = staged_parts([[len(ids) for ids in id_lists], flat], device)
    # output_size given so CUDA need not read the total back from the device
    rows = torch.repeat_interleave(torch.arange(len(id_lists), device=device), lengths,
                                   output_size=len(flat))
    return rows, toks
