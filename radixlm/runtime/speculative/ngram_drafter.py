"""NGRAM: drafts looked up in n-gram tables (ngram.py), verified by the shared step
(worker.Speculator): each request's own index of its prompt and output, and one table of the
finished requests' outputs.

Each request's lookup is its own work: an exception in it (its index, the shared table's
proposal, the grammar's cut `grammar_drafts.truncate`) fails that request alone
(speculative/isolation.py); the others draft on. Its bookkeeping outside a lookup (indexing
while a step is in flight, the shared table) loses what raised, logged and counted.
"""

from __future__ import annotations

import time

from radixlm.runtime.request import Req
from radixlm.runtime.speculative import grammar_drafts, isolation
from radixlm.runtime.speculative.adaptive import Acceptance
from radixlm.runtime.speculative.ngram import OwnIndex, SharedIndex, propose
from radixlm.runtime.speculative.shadow import ShadowDrafts
from radixlm.runtime.speculative.spec_config import SpecConfig
from radixlm.runtime.speculative.worker import Speculator, draft_room, verify_rows

LOOKUP_BUILD = 256  # prompt tokens a lookup indexes (~0.2 ms) before it gives up for the step
IDLE_BUDGET_S = 0.0015  # host time `idle_work` spends per overlapped step
MAX_PENDING_FINISHED = 256  # finished outputs waiting for the shared table (oldest dropped)


class DraftState:
    """A request's n-gram drafting state (`Req.spec_draft`): its index and acceptance record."""

    __slots__ = ("own", "record", "match")

    def __init__(self, req: Req, cfg: SpecConfig, lazy: bool = False):
        self.own = OwnIndex(req.vocab_input_ids(), cfg.min_match, cfg.max_match, lazy)
        self.record = Acceptance()
        self.match = 0  # suffix length of the current draft's match


class NgramSpeculator(Speculator):
    """Where a skipped step overlaps (a GPU), the n-gram tables are built off the critical path:
    a request's prompt is indexed by `idle_work` while a step is in flight (a lookup indexes
    at most LOOKUP_BUILD tokens and drafts nothing until its prompt is done), and a finished
    request's output joins the shared table there too. Elsewhere both happen when needed.
    There, with the adaptive policy, drafts are also scored there without verifies (shadow.py);
    while no draft could pay (`policy.quiet`) only those few requests' prompts are indexed."""

    def __init__(self, cfg: SpecConfig, sched):
        super().__init__(cfg, sched)
        self.shared = SharedIndex(cfg.min_match, cfg.max_match, cfg.max_draft, cfg.capacity)
        self.lazy = self.policy.fast_skips
        self.finished: list[tuple[list[int], int]] = []  # (prompt + output, prompt length)
        self.shadow = ShadowDrafts() if self.lazy and cfg.adaptive else None
        if self.shadow is not None:
            self.policy.use_shadows()

    def idle_work(self, sched) -> None:
        """Index what the next lookups need, for at most IDLE_BUDGET_S (a step is in flight)."""
        deadline = time.perf_counter() + IDLE_BUDGET_S
        while self.finished and time.perf_counter() < deadline:
            self._share(self.finished.pop(0))
        if self.shadow is not None:
            self.shadow.score(self.policy, sched.running)
            self.shadow.look_up(sched.running,
                                lambda r, t: self._shadow_lookup(r, sched.context_len, t),
                                deadline)
            if self.policy.quiet:
                return
        for req in sched.running:
            if time.perf_counter() >= deadline:
                return
            try:
                if req.spec_draft is None:
                    req.spec_draft = DraftState(req, self.cfg, lazy=True)
                own = req.spec_draft.own
                while not own.ready and time.perf_counter() < deadline:
                    own.build(64)
            except Exception as e:  # (a step is in flight: the lookup fails it if it recurs)
                req.spec_draft = None
                isolation.drafting_lost(self, e, f"the prompt index of request {req.rid}")

    def draft(self, sched, reqs: list[Req]) -> list[list[int]]:
        drafts = []
        for req in reqs:  # a lookup that raises fails its request only (after the drafting)
            try:
                drafts.append(self._lookup(req, sched.context_len))
            except Exception as e:
                self.draft_failed(req, e, "its n-gram lookup")
                drafts.append(None)
        ok = [i for i, d in enumerate(drafts) if d is not None]
        ks = self.policy.choose([reqs[i].spec_draft.record for i in ok],
                                [len(drafts[i]) for i in ok],
                                [reqs[i].spec_draft.match for i in ok], verify_rows(sched))
        out = [[] for _ in reqs]
        for i, k in zip(ok, ks):
            out[i] = drafts[i][:k]
        return out

    def _shadow_lookup(self, req: Req, context_len: int, deadline: float):
        """(draft, match length) for a shadow (its prompt indexed first, 64 tokens at a time),
        None when the deadline comes first."""
        try:
            if req.spec_draft is None:
                req.spec_draft = DraftState(req, self.cfg, lazy=True)
            own = req.spec_draft.own
            while not own.ready:
                if time.perf_counter() >= deadline:
                    return None
                own.build(64)
            return self._lookup(req, context_len), req.spec_draft.match
        except Exception as e:  # (a step is in flight: the lookup fails it if it recurs)
            req.spec_draft = None
            isolation.drafting_lost(self, e, f"the shadow draft of request {req.rid}")
            return None

    def on_retract(self, req: Req) -> None:
        if self.shadow is not None:
            self.shadow.drop(req)

    def on_finish(self, req: Req) -> None:
        """A request is done: its output's n-grams join the shared table; its index goes."""
        if self.shadow is not None:
            self.shadow.drop(req)
        state = req.spec_draft
        if state is None:
            return
        own = state.own
        prompt = own.prompt if own.prompt is not None else own.tokens[: own.n_prompt]
        item = (prompt + list(req.output_ids), own.n_prompt)
        req.spec_draft = None
        if not self.lazy:
            self._share(item)
            return
        self.finished.append(item)
        if len(self.finished) > MAX_PENDING_FINISHED:
            self.finished.pop(0)

    def _share(self, item: tuple[list[int], int]) -> None:
        """A finished output's n-grams into the shared table (lost, logged, if that raises)."""
        try:
            self.shared.add(*item)
        except Exception as e:
            isolation.drafting_lost(self, e, "a finished output's n-grams")

    def _lookup(self, req: Req, context_len: int) -> list[int]:
        state = req.spec_draft
        if state is None:
            state = req.spec_draft = DraftState(req, self.cfg, self.lazy)
        if not state.own.ready:
            state.own.build(LOOKUP_BUILD)
            if not state.own.ready:  # the rest next step (or in idle_work)
                state.match = 0
                return []
        state.own.sync(req.output_ids, req.jumps)
        # a verify appends up to k + 1 tokens: within max_new_tokens and the context
        draft, state.match = propose(state.own, self.shared, draft_room(req, self.cfg.max_draft,
                                                                        context_len))
        return grammar_drafts.truncate(req, draft)
