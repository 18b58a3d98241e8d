"""Fault isolation on the speculative step: the scheduler's rules (scheduler/isolation.py) for
drafting and the verify.

Drafting, where the failing request is known: an exception in one request's n-gram lookup (its
own index, the shared table's proposal, the grammar's cut `grammar_drafts.truncate`), in its
matcher along a draft model's or EAGLE-3 head's chain (`grammar_drafts.ChainGrammar`), or in its
matcher while its verify rows are masked (`grammar_drafts.masker`) fails that request alone
(500, "internal error in drafting (...)"); the others draft and verify on. The drafter records
it (`Speculator.draft_failed`) and the step fails it once the drafting is done: inside a chain
the request's rows are still in the batch's tensors, and its draft KV is only all accounted for
after the chain (its finish then frees it). Its KV goes back as on the plain path.

Bookkeeping outside a step's drafting, lost without a request to fail (logged and counted in
`spec_draft_failures`): an EAGLE-3 head's projection of the target's features after an extend or
a verify (those requests' pending rows go; their drafts start afresh), a finished output joining
NGRAM's shared table, NGRAM's indexing of a prompt while a step is in flight (the index goes; the
next lookup builds it again, and fails the request if it raises again).

Drafting, batched: a draft model's or EAGLE-3 head's chain runs its forwards (and builds its
tensors, picks its lengths) for the whole batch, so an exception there names no request. The
step then runs without drafts (the plain decode step; with EAGLE-3 a verify of the last tokens),
after undoing what the chain took: the drafter registers its undo actions as it takes slots
and moves its states (`Speculator.undo`: a draft model's pool slots and per-request lengths, a
head's pending feature rows, the matchers' walks). The failure is logged with its traceback and
counted (`spec_draft_failures`; a CUDA out-of-memory also in `oom_steps`). The tokens are
those of the clean run (drafts only decide how many tokens a step keeps); an exception that
comes back every step keeps the batch on plain steps, one error logged per step.

The verify: a CUDA out-of-memory in its forward or its acceptance (the sampler over all R rows)
hands the verify's R slots back, empties the allocator's cache, counts `oom_steps` and
`spec_verify_ooms`, and runs the step again without drafts: B rows instead of R, what the plain
decode step would have run. When that runs out of memory too (or the verify had no drafts to
drop), the batch fails with 503 and the scheduler goes on, as on the plain path. Other
exceptions in the verify forward stay fatal, as in the plain forward: they name no request.
With tensor parallelism an OOM stays fatal (the other ranks are in the same collective).
"""

from __future__ import annotations

import copy
import logging
from typing import Callable

import torch

from radixlm.runtime.request import Req

logger = logging.getLogger(__name__)


def draft_batch(spec, sched, reqs: list[Req]) -> tuple[list[Req], list[list[int]]]:
    """`spec.draft` for `reqs` (== sched.running). Returns the requests that go on (== the
    running batch after it) and their drafts: [] each after a batched failure; the requests
    whose own drafting failed have failed and left the batch."""
    spec.undo, spec.failures = [], []
    try:
        drafts = spec.draft(sched, reqs)
    except Exception as e:
        for undo in reversed(spec.undo):
            undo()
        spec.drop_draft()
        logger.error("drafting failed for a batch of %d requests (%s); this step runs without "
                     "drafts", len(reqs), ", ".join(r.rid for r in reqs[:8]),
                     exc_info=(type(e), e, e.__traceback__))
        sched.stats["spec_draft_failures"] += 1
        if isinstance(e, torch.cuda.OutOfMemoryError):  # (the draft's forwards are the big part)
            sched.stats["oom_steps"] += 1
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        drafts = [[] for _ in reqs]
    spec.undo = []
    left = fail_recorded(spec, sched, "drafting")
    if len(left) == len(reqs):
        return reqs, drafts
    alive = {id(r) for r in left}
    keep = [i for i, r in enumerate(reqs) if id(r) in alive]
    return [reqs[i] for i in keep], [drafts[i] for i in keep]


def snapshot(objs: list, *attrs: str) -> Callable[[], None]:
    """An undo action that puts `attrs` of each of `objs` back as they are now."""
    saved = [(o, [copy.copy(getattr(o, a)) for a in attrs]) for o in objs]

    def restore() -> None:
        for o, values in saved:
            for a, v in zip(attrs, values):
                setattr(o, a, v)
    return restore


def drafting_lost(spec, exc: BaseException, what: str) -> None:
    """A drafter's own bookkeeping raised outside a step's drafting and `what` is lost: only
    later drafts are poorer (a draft decides how many tokens a step keeps, never which)."""
    logger.error("speculative decoding lost %s; decoding goes on", what,
                 exc_info=(type(exc), exc, exc.__traceback__))
    spec.stats["spec_draft_failures"] += 1


def fail_recorded(spec, sched, stage: str) -> list[Req]:
    """Fail the requests `spec.failures` holds (each once) and take them out of the running
    batch. Returns the running batch."""
    failures, spec.failures = spec.failures, []
    gone = set()
    for req, exc, where in failures:
        if id(req) not in gone:
            gone.add(id(req))
            sched._fail_request(req, exc, f"{stage} ({where})")
    if gone:
        sched._drop_from_running(gone)
    return list(sched.running)


def verify_oom(spec, sched, reqs: list[Req], plan, exc: BaseException) -> list[Req]:
    """After a CUDA out-of-memory in the verify of `reqs` (its forward or acceptance): the
    step again without drafts; without drafts already, the batch fails (503)."""
    sched.allocator.free(plan.slots)  # written only by the failed verify
    spec.drop_draft()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    reqs = fail_recorded(spec, sched, "the verify")  # (a matcher that raised while masking)
    if not reqs:
        return []
    if not any(plan.drafts):  # the plain path's treatment: counted and logged there
        sched._fail_batch_oom(reqs, exc, "the verify forward")
        return []
    logger.error("CUDA out of memory in the verify of %d requests (%d rows); the step runs "
                 "again without drafts", len(reqs), plan.num_rows,
                 exc_info=(type(exc), exc, exc.__traceback__))
    sched.stats["oom_steps"] += 1
    sched.stats["spec_verify_ooms"] += 1
    return spec.no_draft_step(sched, reqs)
