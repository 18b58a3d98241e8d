"""Shadow drafts: n-gram drafts scored against the tokens plain decoding produced, no verify run.

Where a skipped step overlaps (a GPU), the policy's "off" steps run the scheduler's plain step
overlapped, and the speculator's `idle_work` runs on the host while that step is in flight. There
a few requests per step (SHADOW_ROWS, taken in turn through the batch) look their draft up; the
draft is kept and, over the next steps, compared with the tokens the plain steps append. Its
matched prefix is what a verify of it would have accepted: greedy, a verify keeps a draft token
iff it is the target's argmax, which is the token the plain step appends; sampling, a point-mass
draft token x is kept with probability p(x), the chance that the plain step samples x, so the
count has the verify's distribution. The outcome enters the policy's records as a verify's does
(AdaptivePolicy.record_shadow), and a verify runs only once some draft was seen to pass.

Why: learning that drafts fail by verifying them costs the device time a verify takes. At batch
64 on an H200 (8B shape) a verify of 16 rows cost about 2 plain steps over a plain step, and
the lookups before it and the plain step it was measured against could not overlap: with drafts
that were never accepted that was 3.6% of a 128-token run. A shadow costs host time inside a
step in flight and nothing on the device.
Bound: a running request whose prompt is indexed is looked up within ceil(B / SHADOW_ROWS) off
steps, and its draft scored as soon as a token differs from it or SHADOW_SPAN tokens matched. Prompts
are indexed in the same turn, within the step's host budget (the worker's IDLE_BUDGET_S).
"""

from __future__ import annotations

import time

SHADOW_ROWS = 4  # requests looked up per off step (each a suffix lookup, ~20 us in Python)
# draft tokens a shadow scores: its outcome is known SHADOW_SPAN steps after the lookup at the
# latest, so a copy that starts is verified a few steps later, not a full draft's length
SHADOW_SPAN = 4


class ShadowDrafts:
    """The pending shadow drafts of one speculator and the turn of the next lookups."""

    def __init__(self):
        # id(req) -> [req, draft, match length, output length at the lookup, jumps then]
        self.pending: dict[int, list] = {}
        self.cursor = 0  # index into the running batch of the next request to look up
        self.lookups = 0  # shadow lookups made (tests count them)

    def drop(self, req) -> None:
        """The request finished or gave its KV back: its draft is not scored."""
        self.pending.pop(id(req), None)

    def score(self, policy, running: list) -> None:
        """Score the pending drafts against the tokens appended since their lookups
        (`running`: the batch, whose records the policy weighs when a draft passed)."""
        for key in list(self.pending):
            req, draft, match, start, jumps = self.pending[key]
            if req.jumps != jumps or req.spec_draft is None:  # rewritten output, or done
                del self.pending[key]
                continue
            out = req.output_ids[start : start + len(draft)]
            m = 0
            while m < len(out) and out[m] == draft[m]:
                m += 1
            if m == len(out) and m < len(draft):
                continue  # every token so far matched; the rest are still to come
            del self.pending[key]
            recs = [r.spec_draft and r.spec_draft.record for r in running] if m else []
            policy.record_shadow(req.spec_draft.record, match, len(draft), m, recs)

    def look_up(self, running: list, lookup, deadline: float) -> None:
        """Look up the drafts of the next SHADOW_ROWS requests without one pending, in turn
        through `running`. `lookup(req, deadline)` gives (draft, match length), or None when the
        deadline came before the request's prompt was indexed: the turn stays with it (the
        next off step goes on indexing it)."""
        n = len(running)
        if not n:
            return
        self.cursor %= n
        done = 0
        for _ in range(n):
            if done >= SHADOW_ROWS or time.perf_counter() >= deadline:
                return
            req = running[self.cursor]
            if id(req) not in self.pending:
                found = lookup(req, deadline)
                if found is None:
                    return
                done += 1
                self.lookups += 1
                draft, match = found
                if draft:
                    self.pending[id(req)] = [req, draft[:SHADOW_SPAN], match,
                                             len(req.output_ids), req.jumps]
            self.cursor = (self.cursor + 1) % n
