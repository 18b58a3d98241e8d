"""Speculative decoding's parts without a model: the rejection sampler keeps the target's
distribution (chi-square on a tiny vocabulary, every sampling parameter on) for point-mass
(n-gram) and dense (draft model) drafts, the n-gram indexes, the adaptive policy (a draft
model's forwards priced in) and the flags."""

from __future__ import annotations

import argparse
import os

import pytest
import torch

from radixlm.runtime.config import ServerArgs
from radixlm.runtime.request import Req
from radixlm.runtime.sampling.sampler import Sampler
from radixlm.runtime.sampling.sampling_batch_info import SamplingBatchInfo
from radixlm.runtime.sampling_params import SamplingParams
from radixlm.runtime.speculative import spec_config
from radixlm.runtime.speculative.adaptive import Acceptance, AdaptivePolicy
from radixlm.runtime.speculative.step_cost import CostModel
from radixlm.runtime.speculative.ngram import OwnIndex, SharedIndex, propose, suffix_hashes
from radixlm.runtime.speculative.rejection import accept_rows
from radixlm.server.cli_args import add_server_args

V = 8
# chi-square 0.9999 quantiles by degrees of freedom: a correct sampler fails 1 in 10^4 seeds
CHI2_9999 = {1: 15.14, 2: 18.42, 3: 21.11, 4: 23.51, 5: 25.75, 6: 27.86, 7: 29.88}


def _req(output_ids, **params) -> Req:
    sp = SamplingParams(**params)
    sp.verify(V)
    req = Req("r", [1, 2, 3], sp)
    req.output_ids = list(output_ids)
    return req


def test_rejection_sampling_keeps_the_target_distribution():
    torch.manual_seed(0)
    logits = torch.tensor([2.0, 1.5, 1.0, 0.4, 0.0, -0.5, -1.0, 2.6])
    # penalties on the output so far, a bias, temperature and all three cuts
    req = _req([7, 7, 0], temperature=0.8, top_k=4, top_p=0.97, min_p=0.03,
               frequency_penalty=0.5, presence_penalty=0.1, logit_bias={"3": 1.0})
    base = SamplingBatchInfo.from_reqs([req], V, "cpu")
    ref = logits.view(1, -1).clone()
    base.take([0]).apply_penalties_and_masks(ref)
    p = Sampler().filtered_probs(ref, base)[0]
    p = p / p.sum()  # the plain sampler's distribution
    support = p > 0
    assert 3 <= int(support.sum()) < V  # the cuts removed something, several tokens remain

    per_draft = 4000
    drafts = torch.arange(-1, V).repeat_interleave(per_draft)  # -1: no draft (the bonus row)
    info = base.take([0] * drafts.numel())
    accept, token = accept_rows(logits.expand(drafts.numel(), V).clone(), info,
                                [req] * drafts.numel(), drafts, Sampler())
    emitted = torch.where(accept, drafts, token)
    assert not accept[drafts < 0].any()
    for d in range(-1, V):
        counts = torch.bincount(emitted[drafts == d], minlength=V).double()
        assert counts[~support].sum() == 0, f"draft {d}: a token outside top-k/top-p/min-p"
        expected = p[support].double() * per_draft
        chi2 = float(((counts[support] - expected) ** 2 / expected).sum())
        assert chi2 < CHI2_9999[int(support.sum()) - 1], (d, chi2, counts.tolist())


def test_greedy_rows_accept_exactly_the_argmax():
    logits = torch.tensor([[0.0, 3.0, 1.0, 0.0, 0, 0, 0, 0]] * 3
                          + [[5.0, 0.0, 1.0, 0.0, 0, 0, 0, 0]])
    reqs = [_req([], temperature=0.0)] * 3 + [_req([], temperature=1.0, top_k=1)]
    info = SamplingBatchInfo.from_reqs(reqs, V, "cpu")
    accept, token = accept_rows(logits, info, reqs, torch.tensor([1, 2, -1, 0]), Sampler())
    assert accept.tolist() == [True, False, False, True]
    assert token[:3].tolist() == [1, 1, 1]


def test_own_index_drafts_what_followed_the_suffix_and_survives_a_rewrite():
    own = OwnIndex([5, 6, 7, 8, 9, 5, 6], min_n=1, max_n=3)
    shared = SharedIndex(1, 3, 4, capacity=100)
    assert propose(own, shared, 4) == ([7, 8, 9, 5], 2)  # (5, 6) -> 7 8 9 ...
    own.sync([7], jumps=0)  # the output: 7 -> suffix (5, 6, 7) seen before
    assert propose(own, shared, 2) == ([8, 9], 3)
    own.sync([7, 1], jumps=0)
    assert propose(own, shared, 3) == ([], 0)  # 1 never occurred before
    own.sync([3, 4], jumps=1)  # a jump-forward rewrote the whole output
    assert own.tokens == [5, 6, 7, 8, 9, 5, 6, 3, 4] and own.n_out == 2


def test_shared_index_drafts_another_requests_answer_within_its_capacity():
    shared = SharedIndex(1, 2, 3, capacity=6)
    shared.add([1, 2, 3, 4, 5, 6], start=3)  # prompt 1 2 3, output 4 5 6
    assert len(shared.table) <= 6
    own = OwnIndex([9, 2, 3], min_n=1, max_n=2)
    assert propose(own, shared, 3) == ([4, 5, 6], 2)  # (2, 3) continued by the output
    shared.add([7, 8, 9, 10, 11, 12, 13, 14], start=1)
    assert len(shared.table) == 6  # the oldest n-grams went first
    assert suffix_hashes([2, 3], 2)[1] not in shared.table
    assert propose(own, shared, 3) == ([], 0)


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


def test_flags_resolve_as_sglang_and_refuse_what_is_not_built():
    cfg = spec_config.resolve(ServerArgs(speculative_algorithm="ngram"))
    assert (cfg.algorithm, cfg.max_draft, cfg.adaptive) == ("NGRAM", 7, True)
    cfg = spec_config.resolve(ServerArgs(speculative_algorithm="NGRAM", speculative_num_steps=3,
                                         speculative_num_draft_tokens=8))
    assert cfg.max_draft == 3  # a chain of 3 steps verifies 4 tokens (SGLang adjusts too)
    assert spec_config.resolve(ServerArgs()) is None
    refused = [(dict(speculative_algorithm="EAGLE"), "speculative_algorithm=EAGLE"),
               (dict(speculative_algorithm="EAGLE3"), "speculative_draft_model_path"),
               (dict(speculative_algorithm="STANDALONE"), "STANDALONE"),
               (dict(speculative_algorithm="NGRAM", speculative_eagle_topk=4),
                "speculative_eagle_topk"),
               (dict(speculative_algorithm="NGRAM", speculative_draft_model_path="x"),
                "speculative_draft_model_path"),
               (dict(speculative_algorithm="NGRAM", speculative_num_draft_tokens=1),
                "speculative_num_draft_tokens"),
               (dict(speculative_num_steps=3), "speculative_num_steps")]
    for kw, name in refused:
        with pytest.raises(ValueError, match=name):
            spec_config.resolve(ServerArgs(**kw))
    parser = argparse.ArgumentParser()
    add_server_args(parser)
    ns = parser.parse_args(["--speculative-algorithm", "NGRAM", "--no-speculative-adaptive",
                            "--speculative-num-draft-tokens", "5"])
    assert (ns.speculative_algorithm, ns.speculative_adaptive,
            ns.speculative_num_draft_tokens) == ("NGRAM", False, 5)
    assert parser.parse_args(["--speculative-adaptive"]).speculative_adaptive is True


def test_server_reports_spec_meta_and_metrics():
    """The server path: a scheduler update's verify counts reach meta_info, the scheduler's
    stats reach /metrics."""
    from radixlm.server.io_struct import GenerateReqInput, ReqUpdate, TextUpdate
    from radixlm.server.metrics import ServerMetrics
    from radixlm.server.tokenizer_manager import ReqState, TokenizerManager

    tm = TokenizerManager.__new__(TokenizerManager)  # only its result bookkeeping is used
    tm.weight_version, tm.tokenizer, tm.metrics = "default", None, None
    state = ReqState(GenerateReqInput(text="x"), prompt_len=3)
    up = ReqUpdate("r", [5, 6, 7, 8], 4, {"type": "length", "length": 4}, 3, 0,
                   spec_verify_steps=2, spec_verify_tokens=3)
    tm._apply(state, TextUpdate("r", "", up), 0.0)
    meta = tm.result("r", state)["meta_info"]
    assert meta["spec_verify_steps"] == 2 and meta["spec_accept_length"] == 1.5
    off = ReqState(GenerateReqInput(text="x"), prompt_len=3)
    tm._apply(off, TextUpdate("r", "", ReqUpdate("r", [5], 1, None, 3, 0)), 0.0)
    assert "spec_verify_steps" not in tm.result("r", off)["meta_info"]
    text = ServerMetrics().render({"spec_verify_steps": 10, "spec_verify_reqs": 16,
                                   "spec_verify_tokens": 40}).decode()
    assert 'sglang:spec_accept_length{model_name="default"} 2.5' in text
    assert "radixlm:spec_verify_steps 10.0" in text
    legacy = ServerMetrics(names="radixlm").render({"spec_verify_steps": 10, "spec_verify_reqs":
                                                    16, "spec_verify_tokens": 40}).decode()
    assert "radixlm:spec_accept_length 2.5" in legacy and "sglang:" not in legacy


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


def test_rejection_with_a_draft_distribution_keeps_the_target_distribution():
    """Drafts drawn from a dense q (sample_draft, the draft's processing), accepted with
    min(1, p/q), rejections resampled from max(0, p - q): the emitted tokens follow p. q differs
    from p everywhere and keeps tokens p's cuts removed (a wrong residual, e.g. p itself or
    p without the draft token, fails the chi-square by hundreds)."""
    from radixlm.runtime.speculative.rejection import sample_draft

    torch.manual_seed(0)
    sp = SamplingParams(temperature=0.8, top_k=6, top_p=0.97, frequency_penalty=0.4,
                        logit_bias={"3": 0.7})
    sp.verify(V)
    req = Req("r", [1, 2], sp)
    req.output_ids = [7, 0]
    base = SamplingBatchInfo.from_reqs([req], V, "cpu")
    target = torch.tensor([2.0, 1.5, 1.0, 0.4, 0.0, -0.5, -1.0, 2.6])
    draft_logits = torch.tensor([0.5, 2.0, 1.8, -0.3, 1.2, 0.9, -2.0, 1.0])

    def processed(logits):
        x = logits.view(1, -1).clone()
        info = base.take([0])
        info.apply_penalties_and_masks(x)
        probs = Sampler().filtered_probs(x, info)[0]
        return probs / probs.sum()

    p, q_ref = processed(target), processed(draft_logits)
    assert ((q_ref > 0) & (p == 0)).any() and ((p > 0) & (q_ref == 0)).any()
    n = 60000
    rows = [req] * n
    draft, q = sample_draft(draft_logits.expand(n, V).clone(), base.take([0] * n), rows, Sampler())
    assert torch.allclose(q[0], q_ref)
    accept, token = accept_rows(target.expand(n, V).clone(), base.take([0] * n), rows, draft,
                                Sampler(), q)
    emitted = torch.where(accept, draft, token)
    # acceptance rate: sum_x min(p(x), q(x))
    assert abs(accept.double().mean() - torch.minimum(p, q_ref).sum()) < 0.01
    support = p > 0
    counts = torch.bincount(emitted, minlength=V).double()
    assert counts[~support].sum() == 0
    expected = p[support].double() * n
    chi2 = float(((counts[support] - expected) ** 2 / expected).sum())
    assert chi2 < CHI2_9999[int(support.sum()) - 1], (chi2, counts.tolist(), p.tolist())


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


def test_draft_memory_estimate_matches_the_checkpoint(tmp_path):
    """On a GPU the target's KV budget leaves room for the draft's weights and pool
    (ModelRunner._draft_share): the weight estimate from the config is the checkpoint's size."""
    from safetensors.torch import load_file
    from tiny_models import write_tiny_llama

    from radixlm.runtime.speculative.draft_budget import draft_memory

    path = write_tiny_llama(str(tmp_path / "draft"), vocab=256, heads=4, kv_heads=2, tied=False)
    args = ServerArgs(speculative_algorithm="STANDALONE", speculative_draft_model_path=path)
    bpt, weights = draft_memory(args, torch.bfloat16)
    w = load_file(os.path.join(path, "model.safetensors"))
    assert weights == 2 * sum(t.numel() for k, t in w.items() if "norm" not in k)
    assert bpt == 2 * 2 * 2 * 16 * 2  # K and V, 2 layers, 2 KV heads of 16, bf16


def test_a_lazily_built_index_equals_the_eager_one():
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, 20, (700,), generator=g).tolist()
    eager = OwnIndex(prompt, 1, 6)
    lazy = OwnIndex(prompt, 1, 6, lazy=True)
    shared = SharedIndex(1, 6, 5, 1000)
    assert not lazy.ready and lazy.build(256) == 256 and not lazy.ready
    while not lazy.ready:
        lazy.build(64)
    assert lazy.build(64) == 0
    out = torch.randint(0, 20, (40,), generator=g).tolist()
    for idx in (eager, lazy):
        idx.sync(out, 0)
    assert (lazy.tokens, lazy.table, lazy.suffix) == (eager.tokens, eager.table, eager.suffix)
    assert propose(lazy, shared, 5) == propose(eager, shared, 5)
