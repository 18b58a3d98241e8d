"""The step-cost line of the adaptive policy (adaptive.py): seconds ~ c0 + c1 * T for a step of T
tokens, fitted online around a prior c1 / c0."""

from __future__ import annotations

import math
from typing import Optional

COST_BIN_WEIGHT = 16.0  # a step-cost bin averages about its last this many steps
FIT_BIN_WEIGHT = 4.0  # ... and counts as at most this many in the fit


class CostModel:
    """step seconds ~ c0 + c1 * T, fitted online; `ratio()` = c1 / c0.

    Steps are kept per bin of T (exact up to 16, then ~12% wide), each bin a running mean of its
    recent steps (weight: its count, capped), and the line is fitted over the bins. A bin keeps
    what it learned while the batch sits elsewhere, and the prior holds until the data pins the
    slope: fitting recent steps alone let ~30 decode steps at T = 28..32 (a few tokens of spread,
    5% scatter) set c1 / c0 anywhere from 0.001 to 10, and a verify of 54 drafts at batch 28
    followed (83 ms against 31 for a plain step)."""

    def __init__(self, prior_ratio: float):
        self.prior = prior_ratio
        self.bins: dict[int, list[float]] = {}  # bin -> [weight, mean T, mean seconds]
        self._ratio: Optional[float] = None  # cached until the next observation
        self.c0: Optional[float] = None  # the fitted fixed cost (seconds), set by ratio()

    def observe(self, tokens: int, seconds: float) -> None:
        key = tokens if tokens <= 16 else 16 + round(math.log(tokens / 16) / math.log(1.125))
        b = self.bins.setdefault(key, [0.0, 0.0, 0.0])
        b[0] = min(b[0] + 1.0, COST_BIN_WEIGHT)
        alpha = 1.0 / b[0]  # the running mean of the bin's last ~COST_BIN_WEIGHT steps
        b[1] += alpha * (tokens - b[1])
        b[2] += alpha * (seconds - b[2])
        self._ratio = None

    def ratio(self) -> float:
        if self._ratio is None:
            self._ratio = self._fit()
        return self._ratio

    def _fit(self) -> float:
        """Bayesian: the prior says c1 = prior * c0 give or take half; the data, weighted by how
        well it pins the slope (its T spread against the steps' own scatter around the line),
        moves it. Plain steps of one batch size (no spread) leave the prior; verifies of
        1..8 extra tokens at batch 1 (a 2x spread in time) decide it."""
        bins = list(self.bins.values())
        if len(bins) < 2:
            if bins:  # one batch size: the prior splits its mean time
                self.c0 = bins[0][2] / (1.0 + self.prior * bins[0][1])
            return self.prior
        # a bin's mean counts as at most FIT_BIN_WEIGHT steps: its scatter shrinks with more
        # steps, but load drifts (correlated with the batch shrinking) do not average away
        bins = [(min(n, FIT_BIN_WEIGHT), T, t) for n, T, t in bins]
        w = wT = wTT = wt = wTt = 0.0
        for n, T, t in bins:
            w, wT, wTT, wt, wTt = w + n, wT + n * T, wTT + n * T * T, wt + n * t, wTt + n * T * t
        det = w * wTT - wT * wT
        t_mean, T_mean = wt / w, wT / w
        # the steps' scatter around the unregularized line (5% of a step at least)
        s2 = (0.05 * t_mean) ** 2
        if det > 1e-9 * w * w:
            c0 = (wTT * wt - wT * wTt) / det
            c1 = (w * wTt - wT * wt) / det
            resid = sum(n * (t - c0 - c1 * T) ** 2 for n, T, t in bins) / max(w - 2.0, 1.0)
            s2 = max(s2, resid)
        p = self.prior
        tau = 0.5 * p * t_mean / (1.0 + p * T_mean)  # prior sd of c1 - p * c0, in seconds
        lam = s2 / (tau * tau)  # the prior's precision in units of the data's
        a00, a01, a11 = w + lam * p * p, wT - lam * p, wTT + lam
        det = a00 * a11 - a01 * a01
        c0 = (a11 * wt - a01 * wTt) / det
        c1 = (a00 * wTt - a01 * wt) / det
        self.c0 = c0 if c0 > 0 else t_mean / (1.0 + 10.0 * T_mean)
        if c0 <= 0:
            return 10.0
        return min(max(c1 / c0, 0.1 * p), 10.0)
