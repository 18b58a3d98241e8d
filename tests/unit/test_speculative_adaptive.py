"""The adaptive speculation policy's parts (speculative/adaptive.py, step_cost.py): the step-cost
line, where drafts pay, the verify's learned overhead, skipped steps and probes."""

from __future__ import annotations

from radixlm.runtime.speculative.adaptive import Acceptance, AdaptivePolicy
from radixlm.runtime.speculative.step_cost import CostModel


def test_cost_model_recovers_the_per_token_cost():
    cm = CostModel(prior_ratio=0.5)
    assert cm.ratio() == 0.5  # no data: the prior
    for i in range(60):
        T = 1 + i % 8
        cm.observe(T, 0.020 + 0.002 * T)
    assert abs(cm.ratio() - 0.1) < 0.01
    # then many plain steps of a large batch whose few tokens of spread happen to slope the
    # wrong way (the machine's load drifting while requests finish): the slope learned over the
    # whole range holds (a fit forgetting by time gave 0.04 here)
    for i in range(200):
        T = 28 + i % 5
        cm.observe(T, (0.020 + 0.002 * T) * (1.2 - 0.05 * (T - 28)))
    assert 0.07 < cm.ratio() < 0.14
    flat = CostModel(prior_ratio=0.05)
    for _ in range(60):  # T never varies: the prior keeps deciding the split
        flat.observe(4, 0.030)
    assert abs(flat.ratio() - 0.05) < 0.01


def _records(succ: float, trials: float, n: int) -> list:
    recs = [Acceptance() for _ in range(n)]
    for r in recs:
        r.succ, r.trials = succ, trials
    return recs


def test_adaptive_drafts_where_it_pays():
    pol = AdaptivePolicy(adaptive=True, device_type="cpu")
    for _ in range(40):  # a token costs a tenth of the fixed cost: c1 / c0 = 0.1
        for T in (1, 4, 8):
            pol.observe_step(T, 0.05 * (1 + 0.1 * T))
    assert pol.choose(_records(40, 42, 1), [7], [4]) == [7]  # good drafts, batch 1: all
    assert pol.choose(_records(0, 40, 1), [7], [4]) == [0]  # failing drafts: plain decode
    assert pol.choose(_records(40, 42, 1), [0], [0]) == [0]  # nothing found
    # a batch of 64 where a token costs 0.5 of the fixed cost: only near-certain tokens
    busy = AdaptivePolicy(adaptive=True, device_type="cpu")
    for _ in range(40):
        for T in (64, 70, 80):
            busy.observe_step(T, 0.05 * (1 + 0.5 * T))
    ks = busy.choose(_records(6, 10, 64), [7] * 64, [4] * 64)
    assert sum(ks) == 0
    assert busy.hopeless([None] * 64) and not busy.hopeless(_records(60, 61, 64))
    assert not pol.hopeless([None])  # (the step then skips even the lookups)
    assert AdaptivePolicy(False, "cpu").choose(_records(0, 40, 2), [3, 5], [1, 1]) == [3, 5]


def test_tree_depths_are_priced_by_their_rows():
    """A draft tree of depth j takes rows(j) verify rows: within the step's rows with adaptivity
    off; with it on, a depth that adds many rows must pay for all of them."""
    rows = [0, 2, 6, 6].__getitem__  # top-k 2, 6 nodes at most
    fixed = AdaptivePolicy(False, "cpu")
    assert fixed.choose(_records(0, 40, 2), [3, 3], [1, 1], 2 + 10, rows) == [3, 1]
    pol = AdaptivePolicy(adaptive=True, device_type="cpu")
    for _ in range(40):  # a row costs a fifth of the fixed cost
        for T in (1, 4, 8):
            pol.observe_step(T, 0.05 * (1 + 0.2 * T))
    assert pol.choose(_records(40, 42, 1), [3], [1]) == [3]  # a chain: 3 rows pay
    deep = pol.choose(_records(40, 42, 1), [3], [1], None, [0, 2, 30, 60].__getitem__)
    assert deep == [1]  # the second level's 28 rows do not


def _plain_and_verify_steps(pol, plain_s: float, verify_s: float, n: int = 30) -> None:
    for _ in range(n):  # batch 1: plain steps, and verifies of 3 tokens that cost verify_s
        pol.observe_step(1, plain_s)
        pol.observe_step(3, verify_s, batch=1)


def test_verify_overhead_is_learned_and_paid_for():
    # a GPU: the line's prior says 2 more tokens cost 2%; the verifies cost 35% more
    pol = AdaptivePolicy(adaptive=True, device_type="cuda")
    _plain_and_verify_steps(pol, 0.004, 0.0054)
    assert 0.2 < pol.ov < 0.45, pol.ov
    assert pol.choose(_records(0, 6, 1), [7], [4]) == [0]  # ~20% drafts pay less than that
    assert pol.choose(_records(40, 42, 1), [7], [4]) == [7]  # a near-certain one pays
    for _ in range(30):  # drafts that fail: no draft could pay, the lookups stop
        pol.record(Acceptance(), 4, 2, 0)
    assert pol.hopeless([None])
    # the first verify at a batch of 64 measures the overhead: it is kept as small as a probe
    from radixlm.runtime.speculative import adaptive

    big = AdaptivePolicy(adaptive=True, device_type="cuda")
    big.observe_step(64, 0.007)
    assert sum(big.choose(_records(40, 42, 64), [7] * 64, [4] * 64)) == adaptive.PROBE_ROWS
    big.observe_step(64 + adaptive.PROBE_ROWS, 0.009, batch=64)
    assert big.ov_measured and sum(big.choose(_records(40, 42, 64), [7] * 64, [4] * 64)) > 16
    # where verifies cost what the line says, no overhead is learned
    flat = AdaptivePolicy(adaptive=True, device_type="cuda")
    _plain_and_verify_steps(flat, 0.004, 0.004 * 1.03 / 1.01)
    assert flat.ov < 0.02


def test_hopeless_steps_probe_with_a_growing_interval():
    from radixlm.runtime.speculative import adaptive

    pol = AdaptivePolicy(adaptive=True, device_type="cuda")
    for _ in range(40):
        pol.observe_step(64, 0.007)
        pol.record(Acceptance(), 1, 2, 0)  # match length 1 only: the others take the pool's rate
    assert pol.hopeless([None] * 64)

    def steps_to_probe():
        for n in range(1, 2 * adaptive.PROBE_MAX):
            if pol.wants_verify([None] * 64):
                assert pol.probing
                return n
        raise AssertionError("no probe")

    first = steps_to_probe()
    assert first == adaptive.PROBE_MIN
    ks = pol.choose([Acceptance()] * 64, [7] * 64, [4] * 64, max_tokens=100)
    assert max(ks) == adaptive.PROBE_TOKENS and sum(ks) == adaptive.PROBE_ROWS
    ks = pol.choose([Acceptance()] * 64, [7] * 64, [4] * 64, max_tokens=70)
    assert sum(ks) == 70 - 64  # within the graphs' rows
    pol.record(Acceptance(), 4, 2, 0)
    pol.observe_step(100, 0.009, batch=64)  # the probe found nothing: wait twice as long
    assert steps_to_probe() == 2 * first
    pol.choose([Acceptance()] * 64, [7] * 64, [4] * 64)
    pol.record(Acceptance(), 4, 2, 2)  # this one was accepted: probe soon again
    pol.observe_step(192, 0.009, batch=64)
    assert pol.probe_interval == adaptive.PROBE_MIN


def test_probes_wait_long_enough_to_cost_at_most_their_budget():
    from radixlm.runtime.speculative import adaptive

    pol = AdaptivePolicy(adaptive=True, device_type="cuda")
    for _ in range(40):
        pol.observe_step(64, 0.010)
        pol.record(Acceptance(), 1, 2, 0)
    pol.ov, pol.ov_measured = 1.5, True  # a verify costs 1.5 plain steps more
    skipped = 0
    while not pol.wants_verify([None] * 64):
        skipped += 1
    assert pol.probing and skipped + 1 == 150  # 1.5 / PROBE_BUDGET (0.01), not PROBE_MIN
    cheap = AdaptivePolicy(adaptive=True, device_type="cuda")
    for _ in range(40):
        cheap.observe_step(1, 0.004)
        cheap.record(Acceptance(), 1, 2, 0)
    cheap.ov, cheap.ov_measured = 0.1, True  # 10 steps' budget: PROBE_MIN holds
    skipped = 0
    while not cheap.wants_verify([None]):
        skipped += 1
    assert skipped + 1 == adaptive.PROBE_MIN


def test_lookups_that_find_nothing_stop_until_a_probe():
    from radixlm.runtime.speculative import adaptive

    pol = AdaptivePolicy(adaptive=True, device_type="cuda")
    for _ in range(adaptive.DRY_STEPS):
        assert pol.wants_verify([None] * 4)
        assert pol.choose([Acceptance()] * 4, [0] * 4, [0] * 4) == [0] * 4
    skipped = 0
    while not pol.wants_verify([None] * 4):
        skipped += 1
    assert pol.probing and skipped == adaptive.PROBE_MIN - 1
    pol.choose([Acceptance()] * 4, [0] * 4, [0] * 4)  # the probe found nothing either
    assert pol.probe_interval == 2 * adaptive.PROBE_MIN
    while not pol.wants_verify([None] * 4):
        pass
    pol.observe_step(4, 0.005)
    assert pol.choose([Acceptance()] * 4, [3, 0, 0, 0], [2, 0, 0, 0]) == [2, 0, 0, 0]
    pol.record(Acceptance(), 2, 2, 1)
    pol.observe_step(6, 0.006, batch=4)
    assert pol.wants_verify([None] * 4) and not pol.probing  # it was accepted: lookups resume
    fresh = AdaptivePolicy(adaptive=True, device_type="cuda")
    assert fresh.choose([Acceptance()], [5], [3]) == [0]  # no plain step of batch 1 yet: one first


def test_declined_lookups_skip_only_where_a_skipped_step_overlaps():
    from radixlm.runtime.speculative import adaptive

    for fast_skips in (True, False):
        pol = AdaptivePolicy(adaptive=True, device_type="cuda", overlap=fast_skips)
        pol.observe_step(1, 0.004)
        pol.ov = 0.3  # verifies cost 30% more than a plain step
        for _ in range(adaptive.DRY_STEPS):
            assert pol.wants_verify([None])
            assert pol.choose(_records(0, 6, 1), [5], [2]) == [0]  # ~20%: declined
        assert pol.wants_verify([None]) is not fast_skips


def test_adaptive_prices_the_draft_forwards():
    """A draft forward's cost counts: at batch 1 with c1 / c0 = 0.1 and a 90% acceptance, a
    draft costing 5% of a target step drafts its whole chain, one costing as much as the
    target step drafts nothing (and the step skips drafting: hopeless)."""
    def policy(draft_share: float) -> AdaptivePolicy:
        pol = AdaptivePolicy(adaptive=True, device_type="cpu")
        for _ in range(40):
            for t in (1, 4, 8):
                pol.observe_step(t, 0.05 * (1 + 0.1 * t))
        pol.observe_draft(3, 3 * 0.05 * draft_share)
        return pol

    rec = Acceptance()
    rec.succ, rec.trials = 36.0, 40.0
    assert policy(0.05).choose([rec], [3], [1]) == [3]
    assert policy(1.0).choose([rec], [3], [1]) == [0]
    assert policy(1.0).hopeless([rec]) and not policy(0.05).hopeless([rec])


def test_one_good_request_cannot_pay_a_big_batchs_verify_overhead():
    """hopeless() sums the requests' chain bounds against B * ov: at batch 64 with a verify
    costing 2 plain steps more, one request whose drafts nearly always pass (~20 tokens a chain
    at most) cannot pay the 128 steps' worth, so the lookups stop; 64 such requests can, and at
    batch 1 the one can."""
    pol = AdaptivePolicy(adaptive=True, device_type="cuda")
    for _ in range(40):
        pol.observe_step(64, 0.007)
        pol.record(Acceptance(), 4, 2, 0)  # the global rate: ~0
    pol.ov, pol.ov_measured = 2.0, True
    good = _records(40, 42, 1)[0]
    assert pol.hopeless([good] + [None] * 63)
    assert not pol.hopeless(_records(40, 42, 64))
    assert not pol.hopeless([good])
