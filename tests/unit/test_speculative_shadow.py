"""Shadow drafts (speculative/shadow.py) where skipped steps overlap (a GPU), driven through the
NgramSpeculator's own wants_verify / idle_work / draft on a stand-in scheduler: drafts that are
never accepted cost no verify and only a few lookups per step, and a request whose drafts start
passing makes the speculator verify within a bounded number of steps.

The stand-in runs no model: a plain step appends each request's next "true" token, a fake clock
advances a fixed step time (the policy's timings and the shadows' host budget read it)."""

from __future__ import annotations

import math
import random
from types import SimpleNamespace

import pytest

from radixlm.runtime.speculative import ngram_drafter, shadow
from radixlm.runtime.speculative.spec_config import SpecConfig

MAX_DRAFT = 7
PLAIN_S = 0.0067  # a batch-64 step of the 8B shape on an H200


class Clock:
    def __init__(self):
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


class FakeReq:
    """What the n-gram drafter reads of a request; `truth(i)` is its i-th output token."""

    def __init__(self, prompt: list[int], truth, max_new: int = 10_000):
        self.origin_input_ids, self.truth = prompt, truth
        self.output_ids: list[int] = []
        self.jumps, self.grammar, self.mm, self.spec_draft = 0, None, None, None
        self.max_new = max_new

    def vocab_input_ids(self) -> list[int]:
        return self.origin_input_ids

    @property
    def seqlen(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)

    def remaining_new_tokens(self) -> int:
        return self.max_new - len(self.output_ids)


@pytest.fixture
def clock(monkeypatch):
    c = Clock()
    monkeypatch.setattr(ngram_drafter, "time", c)
    monkeypatch.setattr(shadow, "time", c)
    return c


def _speculator(running: list) -> tuple:
    sched = SimpleNamespace(device=SimpleNamespace(type="cuda"), running=running,
                            args=SimpleNamespace(disable_overlap_schedule=False),
                            stats={"forward_steps": 0}, context_len=1 << 20,
                            runner=SimpleNamespace(graph_runner=None, row_invariant_max=None))
    cfg = SpecConfig("NGRAM", MAX_DRAFT, True, 1, 6, 65536)
    return ngram_drafter.NgramSpeculator(cfg, sched), sched


def _step(spec, sched, clock) -> tuple[bool, int]:
    """One decode step as the scheduler runs it. Returns (verified, drafted requests): a step
    the policy wants runs the critical-path lookups (`draft`); one whose drafts it keeps would
    verify (the test stops there); otherwise a plain step, overlapped, with idle_work."""
    sched.stats["forward_steps"] += 1
    if spec.wants_verify(sched):
        drafts = spec.draft(sched, list(sched.running))
        if any(drafts):
            return True, sum(map(bool, drafts))
        spec.policy.observe_step(len(sched.running), PLAIN_S)  # its plain step, not overlapped
    for r in sched.running:
        r.output_ids.append(r.truth(len(r.output_ids)))
    if not spec.wants_verify(sched):  # (the decision made: the step in flight overlaps)
        spec.idle_work(sched)
    clock.now += PLAIN_S
    return False, 0


def _counting_propose(monkeypatch, propose) -> list:
    calls = []

    def counted(own, shared, max_len):
        calls.append(1)
        return propose(own, shared, max_len)

    monkeypatch.setattr(ngram_drafter, "propose", counted)
    return calls


def test_never_accepted_drafts_at_batch_64_cost_no_verify_and_few_lookups(clock, monkeypatch):
    rng = random.Random(0)
    # as benchmarks/speculative.py --drafts random: drafts of random ids claimed as long matches
    calls = _counting_propose(monkeypatch, lambda own, shared, n: (
        [rng.randrange(1 << 20) for _ in range(n)], own.max_n))
    running = [FakeReq([rng.randrange(1000) for _ in range(300)],
                       lambda i, s=rng.randrange(1 << 30): (s + 7919 * i) % 1000)
               for _ in range(64)]
    spec, sched = _speculator(running)
    steps, verified, worst = 128, 0, 0
    for _ in range(steps):
        before = len(calls)
        v, _ = _step(spec, sched, clock)
        verified += v
        worst = max(worst, len(calls) - before)
    assert verified / steps < 0.01  # (none: no draft was ever seen to pass)
    assert worst <= shadow.SHADOW_ROWS  # lookups per step: the shadows' few, never the batch
    assert len(calls) <= steps * shadow.SHADOW_ROWS
    # ... and the shadows did score drafts: their failures are on the requests' records
    assert spec.shadow.lookups >= 64 and sum(r.spec_draft.record.trials > 0 for r in running) > 32
    assert spec.policy.quiet and not spec.policy.ov_measured  # off throughout, no verify


def test_a_copying_request_is_verified_within_a_bounded_number_of_steps(clock, monkeypatch):
    """63 requests whose text never repeats (lookups find nothing) run for 96 steps; then one
    that copies its prompt joins just behind the shadows' turn. Its drafts are looked up within
    ceil(64 / SHADOW_ROWS) steps, scored over SHADOW_SPAN steps, and the next step verifies."""
    calls = _counting_propose(monkeypatch, ngram_drafter.propose)
    fresh = iter(range(10_000, 1 << 30))
    running = [FakeReq(list(range(1000 * j, 1000 * j + 50)), lambda i, f=fresh: next(f))
               for j in range(63)]
    spec, sched = _speculator(running)
    for _ in range(96):
        assert _step(spec, sched, clock) == (False, 0)
    assert len(calls) <= 96 * shadow.SHADOW_ROWS
    rng = random.Random(1)
    text = [rng.randrange(500_000, 600_000) for _ in range(200)]
    copier = FakeReq(text, lambda i: text[i % len(text)])
    c = spec.shadow.cursor % len(running)  # it joins just behind the turn: looked up last
    running.insert(c, copier)
    spec.shadow.cursor = c + 1
    bound = math.ceil(len(running) / shadow.SHADOW_ROWS) + shadow.SHADOW_SPAN + 1
    for n in range(1, bound + 1):
        verified, drafted = _step(spec, sched, clock)
        if verified:
            break
    else:
        raise AssertionError(f"no verify within {bound} steps of the copier's arrival")
    assert n > shadow.SHADOW_SPAN and drafted >= 1  # (it took the shadow's scoring, not luck)
    assert copier.spec_draft.record.succ >= shadow.SHADOW_SPAN


def test_shadows_in_the_scheduler_keep_greedy_tokens_and_find_copies(engine, make_engine,
                                                                     integrity):
    """The real scheduler with its overlap schedule forced on the CPU (a skipped step's plain
    step then runs split in launch and complete, idle_work between, as on a GPU) and the
    speculator in its GPU mode (shadows): the same tokens as plain decoding, and the copying
    prompts are found by shadows and verified (a run of drafts never passing verifies none)."""
    from radixlm.runtime.speculative.adaptive import AdaptivePolicy
    from tests.unit.test_speculative import CODE, DOC, LIST

    eng = make_engine(speculative_algorithm="NGRAM")

    def gpu_mode():
        sched = eng.scheduler
        sched.overlap = True
        spec = sched.spec
        spec.policy = AdaptivePolicy(True, "cuda", overlap=True)
        spec.lazy, spec.shadow = True, shadow.ShadowDrafts()
        spec.policy.use_shadows()

    eng._call_in_loop(gpu_mode)
    prompts = [LIST, CODE, DOC, "Tell me a story about a cat."] * 2
    params = {"temperature": 0, "max_new_tokens": 48}
    off = engine.generate(prompts, params)
    on = eng.generate(prompts, params)
    assert [o["output_ids"] for o in on] == [o["output_ids"] for o in off]
    stats = eng.get_stats()
    assert eng.scheduler.spec.shadow.lookups > 0 and stats["spec_verify_steps"] > 0
    assert stats["spec_accepted_tokens"] > stats["spec_verify_reqs"]  # > 1 a verify: copies
    integrity(eng)
    integrity(engine)
