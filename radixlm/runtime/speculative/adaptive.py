"""Adaptive draft lengths: per step, draft where the expected tokens pay for the step's cost.

Model (re-estimated every step):
- Acceptance: a request's drafts are accepted token by token with probability `a` until the
  first rejection, so its j-th draft token adds a**j expected output tokens (the verify always
  yields one token: the correction or the bonus). `a` is the request's recent record (decayed
  counts) shrunk toward the global record for drafts of the same match length.
- Cost: a step that computes T tokens (T = batch + drafts) takes c0 + c1 * T seconds, fitted
  online from the measured steps (per-T bins of recent steps, a Bayesian line fit around a
  prior ratio c1 / c0; see CostModel).
- A draft model (STANDALONE) adds cd seconds per draft forward: a chain of depth S costs
  cd * S on top (S = the longest draft of the step), cd measured as the draft forwards' own
  running mean (the target's c0 + c1 T is fitted on the step time without them).
Choice: with E expected tokens and T tokens so far (E = T = B without drafts), a step costs
P + c1 (T - B) + cd S, P the plain step of the batch (measured; else the line's c0 + c1 B: see
`marginal`), and a draft token of gain g raises its rate iff
g > E * dc / (1 + rho_m (T - B) + rho_dm S), rho_m = c1 / P, rho_dm = cd / P, dc = rho_m (+ rho_dm
when the token deepens the chain).
Tokens are taken in decreasing gain while that holds: a compute-bound batch (rho * T >> 1)
drafts only near-certain tokens, a request whose drafts fail drafts nothing (0 = plain decode).
A request not drafting for a while forgets its record (its estimate drifts back to the global
one), so a change of text (chat -> quoting) is noticed.

Verify overhead: a verify step also pays a fixed cost no token count explains (the acceptance
kernels, its host work, and on a GPU the step it cannot overlap): `ov`, the recent verifies' time
above a plain step of the batch (its recent mean) plus what the line's slope adds for the drafts,
relative to that plain step; on a GPU the plain step is the overlapped one the scheduler runs when
it skips the lookups (a lookup step cannot overlap: 4.65 against 4.31 ms at batch 1). Drafts must
then also pay for it: a step verifies only if E / (1 + rho_m (T - B) + rho_dm S + ov) > B. (On an
H200 a verify cost ~1.3 ms over a 4.1 ms plain step at batch 1 while the line, held near its 1%
prior, predicted ~0.1 ms: exploring drafts that never passed cost 6%.)
Skipped steps and probes: when no draft could pay (`hopeless`), or, where a skipped step overlaps
(a GPU), the last DRY_STEPS lookups found or verified nothing, the scheduler runs its plain
step (overlapped on a GPU) without even looking drafts up; every `probe_interval` such steps one
step looks up and verifies up to two tokens per request (16 in all) anyway, so the estimates see a
change of text. The interval doubles (up to PROBE_MAX) while probes find nothing and resets when
one is accepted; it is never shorter than the probes' measured overhead allows (ov / PROBE_BUDGET
steps: a probe that costs two plain steps, as a verify at batch 64 on an H200 can, waits at
least 200 steps, so hopeless probing costs <= 1%; at batch 1 a verify's ~0.2 steps keeps
PROBE_MIN). A verify is measured against a plain step of its batch size, so a batch size never
seen plain takes one first; on a GPU the first verify is as small as a probe (a first verify of
every request at batch 64 cost about 3 plain steps).
Shadows (NGRAM where a skipped step overlaps; shadow.py): drafts scored against the tokens plain
steps produced instead of verified. Then no probe runs, the global record starts at no evidence
(every step hopeless: no lookup, no verify, until some draft was seen to pass), one dry lookup
step stops the lookups, and a shadow that passed where the batch could now pay resumes them.
Global acceptance is kept per match length and pooled; a match length with little record of its
own takes the pooled rate (its 0.5 start would otherwise keep every step from being hopeless).
"""

from __future__ import annotations

import heapq
import math
from typing import Callable, Optional

from radixlm.runtime.speculative.step_cost import COST_BIN_WEIGHT, CostModel

PRIOR_WEIGHT = 4.0  # the global record counts as this many trials of the request's own
RECORD_DECAY = 0.8  # a request's record before adding a new verify's outcome
IDLE_DECAY = 0.95  # ... per step it had a draft but did not verify it
_MATCH_BUCKETS = 4  # global acceptance by suffix-match length: 1, 2, 3, 4+
BUCKET_PRIOR = 2.0  # a match length's record is shrunk toward the pooled rate by this many trials
OVERHEAD_EMA = 0.2  # weight of the newest verify in the overhead estimate
PROBE_MIN, PROBE_MAX = 16, 512  # skipped steps between probes
PROBE_TOKENS = 2  # draft tokens per request in a probe
PROBE_ROWS = 16  # ... and in all: at batch 64 a probe of every request cost ~3 plain steps
PROBE_BUDGET = 0.01  # share of the plain steps' time that probes may cost where nothing passes
DRY_STEPS = 4  # lookups in a row that found nothing: skip them too, probing as when hopeless


class Acceptance:
    """A request's decayed record: accepted drafts over trials (a trial ends at a rejection)."""

    __slots__ = ("succ", "trials")

    def __init__(self):
        self.succ = 0.0
        self.trials = 0.0


class AdaptivePolicy:
    def __init__(self, adaptive: bool, device_type: str, overlap: Optional[bool] = None):
        """`overlap`: whether a step without lookups overlaps (a GPU's overlap schedule; default:
        on CUDA). Only then is there something to gain by not looking drafts up, and only then
        are the verify's overhead, dry lookups and the pooled prior for untried match lengths
        used: on a CPU a lookup costs microseconds, the line fit prices the verify (its steps pin
        the slope), and optimism about a match length not yet tried is what lets a copy that
        starts after a stretch of failed drafts be drafted (copy-heavy text fell from 2.4x to
        1.5x without it)."""
        self.adaptive = adaptive
        # a prior c1 / c0: a 2-core CPU's decode is far from compute-bound only at small batches;
        # a GPU's far further (a token's FLOPs against all the weights' bytes)
        self.cost = CostModel(0.1 if device_type == "cpu" else 0.01)
        self.fast_skips = device_type == "cuda" if overlap is None else overlap
        start = [0.0, 0.0] if self.fast_skips else [1.0, 2.0]  # (a GPU: the pooled rate)
        self.glob = [list(start) for _ in range(_MATCH_BUCKETS)]  # (succ, trials) per bucket
        self.pooled = [1.0, 2.0]  # (succ, trials) over all buckets; starts at 1/2
        self.ov = 0.0  # a verify's fixed overhead, in plain steps of its batch (>= 0)
        self._ov_mean = 0.0  # ... the recent verifies' signed excess (EMA), whose floor is ov
        self.ov_measured = False
        self.plain: dict[int, float] = {}  # batch size -> recent plain steps' mean seconds
        self.fast: dict[int, float] = {}  # ... of the steps run without lookups (overlapped)
        self.probe_interval = PROBE_MIN
        self.skipped_steps = 0  # steps without lookups since the last probe
        self.dry_steps = 0  # consecutive lookups that found no draft
        self.probing = False  # this step is a probe (see `wants_verify`)
        self.probe_found = False
        self.draft_forward_s: Optional[float] = None  # a draft model's seconds per forward
        self.shadows = False  # drafts are scored without verifies (use_shadows)
        self.quiet = False  # the last wants_verify found the step hopeless

    def _bucket_rate(self, b: int) -> float:
        s, t = self.glob[b]
        if not self.fast_skips:
            return s / t
        ps, pt = self.pooled
        return (s + BUCKET_PRIOR * ps / pt) / (t + BUCKET_PRIOR)

    def marginal(self, batch: int) -> tuple[float, float]:
        """(rho_m, rho_dm): a verified token's and a draft forward's cost against a plain step
        of this batch (c1 / P and cd / P). P is the plain step's measured time where there is
        one: the line's c0 + c1 B is not a plain step where the cost is concave in T. On the
        CPU one row streams the weights and more rows are compute-bound, so the line through
        the verifies (SmolLM2 GGUF: 4-9 tokens, ~0.28 of a plain step a token) met T = 1 at
        ~0.6 of the real plain step, and read every token as ~0.5 of one: with copy-heavy
        drafts accepted ~95% of the time it still drafted 0-1 tokens in a third of the steps.
        Without a measured plain step P = c0 + c1 B, and the choice is the line's own."""
        rho, rho_d = self.cost.ratio(), self.draft_ratio()
        c0 = self.cost.c0
        plain = self._plain_time(batch) if c0 else None
        scale = c0 / plain if plain else 1.0 / (1.0 + rho * batch)
        return rho * scale, rho_d * scale

    def draft_ratio(self) -> float:
        """rho_d = cd / c0: a draft model's forward against the target step's fixed cost (0
        without a draft model or before both are measured: the first drafts measure them)."""
        self.cost.ratio()  # (fits c0 when new steps came in)
        c0 = self.cost.c0
        if self.draft_forward_s is None or not c0:
            return 0.0
        return self.draft_forward_s / c0

    def observe_draft(self, forwards: int, seconds: float) -> None:
        """A step's draft chain: `forwards` draft-model forwards took `seconds`."""
        if forwards <= 0 or not (math.isfinite(seconds) and seconds > 0):
            return
        per = seconds / forwards
        prev = self.draft_forward_s
        self.draft_forward_s = per if prev is None else prev + (per - prev) / COST_BIN_WEIGHT

    def estimate(self, rec: Acceptance, match_len: int) -> float:
        prior = self._bucket_rate(min(match_len, _MATCH_BUCKETS) - 1)
        return (rec.succ + PRIOR_WEIGHT * prior) / (rec.trials + PRIOR_WEIGHT)

    def hopeless(self, recs: list) -> bool:
        """True when no draft could pay this step whatever the lookups find (the step then
        skips the lookups). `recs`: the running requests' records (None: never drafted). Each
        request's acceptance is at most u = (succ + 4 top) / (trials + 4), top the best global
        rate; no draft pays when every u is below the first token's threshold
        (rho_m + rho_dm) B (`marginal`), or when endless chains (u / (1 - u) expected tokens a
        request) together cannot pay the verify's overhead: a verify pays only if its extra
        tokens exceed B * ov (choose's test with no token cost), so one good request among 64
        does not."""
        if not self.adaptive:
            return False
        B = len(recs)
        top = max(self._bucket_rate(b) for b in range(_MATCH_BUCKETS))
        bound, gain, w = top, 0.0, PRIOR_WEIGHT * top
        g_top = top / (1.0 - top) if top < 1.0 else math.inf
        for rec in recs:  # (once a step over the batch: kept lean, ~0.3 us a request)
            if rec is None or not rec.trials:
                gain += g_top
                continue
            u = (rec.succ + w) / (rec.trials + PRIOR_WEIGHT)
            if u > bound:
                bound = u
            gain += u / (1.0 - u) if u < 1.0 else math.inf
        rho_m, rho_dm = self.marginal(B)  # the first draft token also opens the chain
        if bound <= (rho_m + rho_dm) * B:
            return True
        return gain <= self.ov * B

    def wants_verify(self, recs: list) -> bool:
        """Called once per decode step: False runs the plain step without lookups, when no
        draft could pay (`hopeless`) or the last DRY_STEPS lookups found nothing; every
        probe_interval such steps, True with `probing` set."""
        self.probing = False
        self.quiet = self.hopeless(recs)
        # with shadows one dry lookup step ends the lookups: the shadows go on looking, off
        # the critical path (a lookup step cannot overlap: 8% of a step at batch 1)
        if self.dry_steps < (1 if self.shadows else DRY_STEPS) and not self.quiet:
            self.skipped_steps = 0
            return True
        if not self.adaptive:
            return True
        if self.shadows:  # (the drafts are scored in the off steps: no probe)
            return False
        self.skipped_steps += 1
        if self.skipped_steps < max(self.probe_interval, self._probe_floor()):
            return False
        self.skipped_steps = 0
        self.probing = True
        return True

    def _probe_floor(self) -> int:
        """The fewest skipped steps between probes that keeps their measured overhead within
        PROBE_BUDGET of the plain steps' time (0 before a verify measured it, or on a CPU)."""
        if not self.ov_measured:
            return 0
        return min(math.ceil(self.ov / PROBE_BUDGET), PROBE_MAX)

    def _end_probe(self, found: bool) -> None:
        self.probe_interval = PROBE_MIN if found else min(2 * self.probe_interval, PROBE_MAX)
        self.probing = False
        if found:
            self.dry_steps = 0  # accepted drafts: look them up every step again

    def choose(self, recs: list[Acceptance], lens: list[int], matches: list[int],
               max_tokens: Optional[int] = None,
               rows: Optional[Callable[[int], int]] = None) -> list[int]:
        """Draft length per request (<= lens[i], the draft it has); 0: plain decode. The step
        computes at most `max_tokens` tokens (B + drafts), when given. `rows(j)`: the verify
        rows a draft of length j takes (a draft tree's nodes at depth j; default j): the
        j-th token's cost is then rows(j) - rows(j - 1) rows."""
        width = (lambda j: 1) if rows is None else (lambda j: rows(j) - rows(j - 1))
        B = len(lens)
        room = ((max_tokens - B) if max_tokens is not None
                else sum(lens) if rows is None else sum(map(rows, lens)))
        if self.probing or (self.fast_skips and not self.ov_measured):
            room = min(room, PROBE_ROWS)  # (the first verify measures the overhead: keep it small)
        found = any(lens)
        if not found and self.fast_skips:  # (on a CPU a lookup costs microseconds: keep looking)
            self.dry_steps += 1
        if self.probing and not found:
            self._end_probe(False)
        if not self.adaptive or self.probing:
            cap = lens if not self.probing else [min(n, PROBE_TOKENS) for n in lens]
            ks = []
            for n in cap:
                k = 0
                while k < n and width(k + 1) <= room:
                    k += 1
                    room -= width(k)
                ks.append(k)
            return ks
        if found and self.fast_skips and self._plain_time(B) is None:
            return [0] * B  # a plain step of this batch first: verifies are measured against it
        rho_m, rho_dm = self.marginal(B)
        OV = self.ov
        heap = []  # (-gain, request, j): each request's next draft token to consider
        rates = [0.0] * B
        for i, n in enumerate(lens):
            if n:
                rates[i] = self.estimate(recs[i], matches[i])
                heap.append((-rates[i], i, 1))
        heapq.heapify(heap)
        ks = [0] * B
        E = T = float(B)
        S = 0  # the chain's depth so far (draft forwards)
        while heap and room > 0:
            neg, i, j = heap[0]
            g, w = -neg, width(j)
            dc = rho_m * w + (rho_dm if j > S else 0.0)
            if w > room or g <= E * dc / (1.0 + rho_m * (T - B) + rho_dm * S + OV):
                break
            heapq.heappop(heap)
            ks[i] = j
            E += g
            T += w
            room -= w
            S = max(S, j)
            if j < lens[i]:
                heapq.heappush(heap, (-g * rates[i], i, j + 1))
        if T > B and E <= B * (1.0 + rho_m * (T - B) + rho_dm * S + OV):
            ks = [0] * B  # the tokens pay for themselves but not for the verify's overhead
        if T == B or not any(ks):
            # a lookup that verifies nothing: where skipping it lets the step overlap, it cost
            # that overlap (8% of a step at batch 1 on an H200); count it as dry
            self.dry_steps += found and self.fast_skips
        else:
            self.dry_steps = 0
        for i, n in enumerate(lens):
            if n and not ks[i]:  # had a draft, skipped it: let its record fade toward the prior
                recs[i].succ *= IDLE_DECAY
                recs[i].trials *= IDLE_DECAY
        return ks

    def record(self, rec: Acceptance, match_len: int, drafted: int, accepted: int) -> None:
        """One verify's outcome for a request: `accepted` of its `drafted` tokens."""
        trials = accepted + (accepted < drafted)
        rec.succ = rec.succ * RECORD_DECAY + accepted
        rec.trials = rec.trials * RECORD_DECAY + trials
        for g in (self.glob[min(match_len, _MATCH_BUCKETS) - 1], self.pooled):
            g[0] = g[0] * 0.99 + accepted
            g[1] = g[1] * 0.99 + trials
        if self.probing and accepted:
            self.probe_found = True

    def use_shadows(self) -> None:
        """The drafter scores drafts without verifying them (shadow.py): no evidence yet, so
        every step is hopeless until a draft is seen to pass (the pooled rate starts at 0)."""
        self.shadows = True
        self.pooled = [0.0, 1.0]

    def record_shadow(self, rec: Acceptance, match_len: int, drafted: int, accepted: int,
                      recs: list) -> None:
        """A shadow draft's outcome, recorded as a verify's; where it passed and the batch
        (`recs`, as for `hopeless`) could now pay, the lookups resume (the dry steps end)."""
        self.record(rec, match_len, drafted, accepted)
        if accepted and self.dry_steps and not self.hopeless(recs):
            self.dry_steps = 0

    def observe_step(self, tokens: int, seconds: float, batch: Optional[int] = None) -> None:
        """A step's wall time; `batch` given for a verify step (its B requests, `tokens` >= B).
        A verify's time above what the line adds to a plain step of its batch updates the
        overhead estimate (the plain steps' own mean, not the fitted intercept: the verifies
        outnumber the plain steps' bins and pull the intercept up to themselves). On the CPU
        too (it was the GPU's alone): at batch 32 a CPU verify's lookups and host work cost more
        than the line's ~3% of a step a token, unmeasured, and drafting ran at 0.76-0.90x of
        plain decoding; measured, it drafts in 2% of the steps (0.985x)."""
        if not (math.isfinite(seconds) and seconds > 0):
            return
        if batch is None or tokens <= batch:
            _ema(self.plain, tokens, seconds)
        else:
            plain = self._plain_time(batch)
            if plain is not None:
                pred = plain * (1.0 + self.marginal(batch)[0] * (tokens - batch))
                extra = (seconds - pred) / plain
                # the mean of the signed excess, floored at 0 only when used: clamping each
                # sample first read step-time noise (both signs) as overhead (a CPU's bs1
                # copy-heavy run held ov at 0.2-1.5 with no fixed cost to explain it)
                if not self.ov_measured:  # the first measurement replaces the start value
                    self._ov_mean, self.ov_measured = extra, True
                else:
                    self._ov_mean += OVERHEAD_EMA * (extra - self._ov_mean)
                self.ov = max(self._ov_mean, 0.0)
            if self.probing:  # the probe's outcome sets when the next one runs
                self._end_probe(self.probe_found)
                self.probe_found = False
        self.cost.observe(tokens, seconds)

    def observe_fast(self, batch: int, seconds: float) -> None:
        """The period of a step the scheduler ran without lookups (overlapped on a GPU): what
        the speculative steps are measured against where there are such steps."""
        if math.isfinite(seconds) and seconds > 0:
            _ema(self.fast, batch, seconds)

    def _plain_time(self, batch: int) -> Optional[float]:
        """A plain step's recent mean seconds at this batch size (a skipped step's where
        measured, else a plain step's inside `step`), scaled by the line from the nearest batch
        size measured within 1/8; None when there is none."""
        for table in (self.fast, self.plain):
            t = table.get(batch)
            if t is not None:
                return t
            near = [b for b in table if abs(b - batch) * 8 <= batch]
            if near:
                b = min(near, key=lambda x: abs(x - batch))
                rho = self.cost.ratio()
                return table[b] * (1.0 + rho * batch) / (1.0 + rho * b)
        return None


def _ema(table: dict, key: int, seconds: float) -> None:
    old = table.get(key)
    table[key] = seconds if old is None else old + 0.1 * (seconds - old)
