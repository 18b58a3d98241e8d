"""Sampler, SamplingBatchInfo and token_logprobs on the CPU."""

from __future__ import annotations

import pytest
import torch

from radixlm.runtime.request import Req
from radixlm.runtime.sampling import logprobs as logprobs_mod
from radixlm.runtime.sampling.logprobs import token_logprobs
from radixlm.runtime.sampling.sampler import Sampler
from radixlm.runtime.sampling.sampling_batch_info import SamplingBatchInfo
from radixlm.runtime.sampling_params import SamplingParams

V = 64
EOS = 7


def make_req(i=0, prompt=(1, 2, 3), output=(), **params) -> Req:
    r = Req(f"r{i}", list(prompt), SamplingParams(**params), eos_token_ids=(EOS,))
    r.output_ids = list(output)
    return r


def sample(logits, reqs, **kw):
    info = SamplingBatchInfo.from_reqs(reqs, logits.shape[1], "cpu")
    return Sampler()(logits.clone(), info, reqs, **kw)


def rand_logits(b, v=V, seed=0):
    return torch.randn(b, v, generator=torch.Generator().manual_seed(seed)) * 3


# --- greedy-equivalent settings -----------------------------------------------------------------
@pytest.mark.parametrize("params", [
    dict(temperature=0.0),
    dict(temperature=1.0, top_k=1),
    dict(temperature=1.0, top_p=1e-6),
    dict(temperature=1.0, min_p=1.0),
    dict(temperature=5.0, top_k=3, top_p=1e-6, min_p=0.5),
])
def test_greedy_equivalents(params):
    logits = rand_logits(16)
    reqs = [make_req(i, **params) for i in range(16)]
    for seed in range(3):
        torch.manual_seed(seed)
        assert torch.equal(sample(logits, reqs).next_token_ids, logits.argmax(-1))


def test_mixed_greedy_and_sampled_rows():
    logits = rand_logits(8)
    reqs = [make_req(i, temperature=0.0 if i % 2 == 0 else 1.5) for i in range(8)]
    out = sample(logits, reqs).next_token_ids
    assert out.shape == (8,) and out.dtype == torch.int64
    assert torch.equal(out[0::2], logits[0::2].argmax(-1))


# --- distributions ------------------------------------------------------------------------------
def chi_square(tokens: torch.Tensor, expected_probs: torch.Tensor) -> float:
    n = tokens.numel()
    observed = torch.bincount(tokens, minlength=expected_probs.numel()).double()
    expected = expected_probs.double() * n
    assert observed[expected == 0].sum() == 0, "sampled a token outside the support"
    support = expected > 0
    return float(((observed[support] - expected[support]) ** 2 / expected[support]).sum())


def test_temperature_distribution():
    row = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2])
    n, t = 40000, 0.7
    torch.manual_seed(1234)
    out = sample(row.expand(n, -1), [make_req(0, temperature=t)] * n).next_token_ids
    # df = 7: P(chi2 > 35) < 1e-5, so a correct sampler essentially never fails this
    assert chi_square(out, torch.softmax(row / t, -1)) < 35


def test_top_k_top_p_distribution():
    row = torch.tensor([3.0, 2.5, 2.0, 1.0, 0.5, 0.0, -1.0, -2.0])
    n = 40000
    torch.manual_seed(99)
    reqs = [make_req(0, temperature=1.0, top_k=5, top_p=0.8)] * n  # unseeded: sharing is fine
    out = sample(row.expand(n, -1), reqs).next_token_ids
    # Reference: top-5 renormalized, then the fewest tokens reaching 0.8 of that mass.
    p = torch.softmax(row, -1)
    p[5:] = 0
    p = p / p.sum()
    cum = p.cumsum(0)
    keep = int((cum < 0.8).sum()) + 1
    p[keep:] = 0
    assert chi_square(out, p / p.sum()) < 35


def test_seeded_request_sampled_repeatedly_follows_distribution():
    row = torch.tensor([1.0, 0.0, -1.0, 0.5])
    req = make_req(0, temperature=1.0, seed=7)
    info = SamplingBatchInfo.from_reqs([req], 4, "cpu")
    out = torch.stack([Sampler()(row.view(1, -1).clone(), info, [req]).next_token_ids[0]
                       for _ in range(4000)])
    assert chi_square(out, torch.softmax(row, -1)) < 30  # df = 3


def test_top_k_restricts_support():
    logits = rand_logits(1, seed=3).expand(5000, -1)
    torch.manual_seed(0)
    out = sample(logits, [make_req(i, temperature=2.0, top_k=5) for i in range(5000)])
    allowed = set(logits[0].topk(5).indices.tolist())
    assert set(out.next_token_ids.tolist()) == allowed


def test_min_p_restricts_support():
    row = torch.log(torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05]))
    torch.manual_seed(0)
    out = sample(row.expand(4000, -1), [make_req(i, min_p=0.3) for i in range(4000)])
    assert set(out.next_token_ids.tolist()) == {0, 1, 2}  # p >= 0.3 * 0.4


# --- seeds --------------------------------------------------------------------------------------
def run_steps(reqs, seeded_row, steps=12):
    """Decode `steps` times with per-step logits; return the seeded row's tokens."""
    info = SamplingBatchInfo.from_reqs(reqs, V, "cpu")
    got = []
    for step in range(steps):
        logits = torch.randn(len(reqs), V)  # global RNG: differs with batch size, on purpose
        logits[seeded_row] = rand_logits(1, seed=100 + step)[0]
        out = Sampler()(logits, info, reqs)
        got.append(int(out.next_token_ids[seeded_row]))
    return got


def test_seeded_request_is_batch_independent():
    alone = run_steps([make_req(0, temperature=1.3, seed=42)], 0)
    torch.manual_seed(5)
    batch = [make_req(i, temperature=1.0) for i in range(6)]
    batch[3] = make_req(3, temperature=1.3, seed=42)
    assert run_steps(batch, 3) == alone
    assert run_steps([make_req(0, temperature=1.3, seed=42)], 0) == alone  # reproducible
    assert run_steps([make_req(0, temperature=1.3, seed=43)], 0) != alone  # and seed-dependent


# --- penalties and masks ------------------------------------------------------------------------
def reference_penalties(logits, reqs):
    out = logits.clone()
    for i, r in enumerate(reqs):
        p = r.sampling_params
        for t in set(r.origin_input_ids) | set(r.output_ids):
            x = out[i, t]
            out[i, t] = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
        for t in set(r.output_ids):
            c = r.output_ids.count(t)
            out[i, t] -= p.frequency_penalty * c + p.presence_penalty
    return out


def penalty_reqs():
    return [
        make_req(0, prompt=[1, 2, 3], output=[4, 4, 5], frequency_penalty=0.5),
        make_req(1, prompt=[9, 10], output=[9, 11, 11, 11], presence_penalty=1.5),
        make_req(2, prompt=[20, 21, 22], output=[23, 20], repetition_penalty=1.7),
        make_req(3, prompt=[5], output=[5, 6], frequency_penalty=-0.4, presence_penalty=0.3,
                 repetition_penalty=0.8),
        make_req(4, prompt=[30], output=[30, 31]),  # no penalty: untouched
    ]


def test_penalties_match_reference():
    reqs = penalty_reqs()
    logits = rand_logits(len(reqs))
    info = SamplingBatchInfo.from_reqs(reqs, V, "cpu")
    got = logits.clone()
    info.apply_penalties_and_masks(got)
    torch.testing.assert_close(got, reference_penalties(logits, reqs))
    assert torch.equal(got[4], logits[4])


def test_update_counts_match_rebuild():
    reqs = penalty_reqs()
    info = SamplingBatchInfo.from_reqs(reqs, V, "cpu")
    for step in range(3):
        ids = torch.tensor([4, 12, 20, 5 + step, 30])
        info.update(ids)
        for r, t in zip(reqs, ids.tolist()):
            r.output_ids.append(t)
    rebuilt = SamplingBatchInfo.from_reqs(reqs, V, "cpu")
    assert torch.equal(info.output_counts[:4], rebuilt.output_counts[:4])  # row 4: no penalty
    logits = rand_logits(len(reqs))
    got = logits.clone()
    info.apply_penalties_and_masks(got)
    torch.testing.assert_close(got, reference_penalties(logits, reqs))


def test_no_penalty_tensors_unless_needed():
    info = SamplingBatchInfo.from_reqs([make_req(0, output=[1, 2]), make_req(1)], V, "cpu")
    assert info.output_counts is None and info.prompt_seen is None and info.stop_mask is None


def test_min_new_tokens_blocks_eos():
    reqs = [make_req(0, temperature=0.0, min_new_tokens=3),
            make_req(1, temperature=0.0),
            make_req(2, temperature=0.0, min_new_tokens=3, ignore_eos=True),
            make_req(3, temperature=0.0, min_new_tokens=5, stop_token_ids=[9], output=[1, 1, 1])]
    info = SamplingBatchInfo.from_reqs(reqs, V, "cpu")
    logits = torch.zeros(4, V)
    logits[:, EOS] = 10.0  # eos is everyone's favourite ...
    logits[:, 9] = 9.0  # ... then 9 (a stop token of row 3) ...
    logits[:, 11] = 1.0  # ... then 11
    steps = [Sampler()(logits.clone(), info, reqs).next_token_ids.tolist() for _ in range(4)]
    assert [s[0] for s in steps] == [9, 9, 9, EOS]
    assert [s[1] for s in steps] == [EOS] * 4
    assert [s[2] for s in steps] == [EOS] * 4  # ignore_eos: eos is not a stop token
    assert [s[3] for s in steps] == [11, 11, EOS, EOS]  # 3 of its 5 tokens already out
    assert info.stop_mask is None  # dropped once every row reached its minimum


def test_vocab_mask_applies_for_one_step():
    logits = rand_logits(2)
    reqs = [make_req(i, temperature=0.0) for i in range(2)]
    info = SamplingBatchInfo.from_reqs(reqs, V, "cpu")
    mask = torch.zeros(2, V, dtype=torch.bool)
    mask[0, 5] = mask[1, [6, 8]] = True
    info.vocab_mask = mask
    out = Sampler()(logits.clone(), info, reqs).next_token_ids
    assert out[0] == 5 and out[1] == (6 if logits[1, 6] > logits[1, 8] else 8)
    assert info.vocab_mask is None


# --- filter / merge -----------------------------------------------------------------------------
def effective(info: SamplingBatchInfo) -> dict:
    """The info's per-row state with absent (B, V) tensors replaced by their neutral values."""
    B = len(info)
    z = lambda dtype, fill: torch.full((B, V), fill, dtype=dtype)  # noqa: E731
    d = {n: getattr(info, n) for n in SamplingBatchInfo._ROW_TENSORS}
    counts = info.output_counts if info.output_counts is not None else z(torch.float32, 0)
    # rows without any penalty never read their counts
    penalized = [a or b for a, b in zip(info.flags.freq_or_presence, info.flags.repetition)]
    d["output_counts"] = counts * torch.tensor(penalized, dtype=torch.float32).view(-1, 1)
    d["prompt_seen"] = info.prompt_seen if info.prompt_seen is not None else z(torch.bool, False)
    active = info.min_tokens_left is not None and info.need_min_tokens
    d["min_left"] = info.min_tokens_left if active else torch.zeros(B, dtype=torch.int64)
    d["stop_mask"] = (info.stop_mask & (d["min_left"] > 0).view(-1, 1)) if active else z(torch.bool, False)
    for flag in ("is_all_greedy", "need_top_k", "max_top_k", "need_top_p", "need_min_p",
                 "need_penalties", "need_repetition", "seeded_rows", "need_min_tokens"):
        d[flag] = getattr(info, flag)
    return d


def test_filter_and_merge_match_from_reqs():
    a = [make_req(0, temperature=0.0, frequency_penalty=0.3),
         make_req(1, temperature=0.8, top_k=10, min_new_tokens=4),
         make_req(2, temperature=1.2, top_p=0.9, seed=3, prompt=[4, 5]),
         make_req(3, temperature=1.0, repetition_penalty=1.3, prompt=[6, 7, 8]),
         make_req(4, temperature=0.5, min_p=0.1, min_new_tokens=2, presence_penalty=0.7)]
    b = [make_req(5, temperature=0.0, min_new_tokens=3, output=[1]),
         make_req(6, temperature=1.0, repetition_penalty=0.9, prompt=[3, 3], output=[12, 13])]
    info_a = SamplingBatchInfo.from_reqs(a, V, "cpu")
    torch.manual_seed(0)
    for _ in range(2):  # a few decode steps before the batch changes
        ids = Sampler()(rand_logits(len(a)), info_a, a).next_token_ids
        for r, t in zip(a, ids.tolist()):
            r.output_ids.append(t)

    keep = [4, 1, 2]
    info_a.filter(keep)
    a = [a[i] for i in keep]
    assert_same(effective(info_a), effective(SamplingBatchInfo.from_reqs(a, V, "cpu")))

    info_b = SamplingBatchInfo.from_reqs(b, V, "cpu")
    info_b.update(torch.tensor([2, 14]))
    for r, t in zip(b, [2, 14]):
        r.output_ids.append(t)
    info_a.merge(info_b)
    merged = a + b
    assert_same(effective(info_a), effective(SamplingBatchInfo.from_reqs(merged, V, "cpu")))

    for _ in range(3):  # and it keeps working (min-token counters run out mid-way)
        ids = Sampler()(rand_logits(len(merged)), info_a, merged).next_token_ids
        for r, t in zip(merged, ids.tolist()):
            r.output_ids.append(t)
        assert_same(effective(info_a), effective(SamplingBatchInfo.from_reqs(merged, V, "cpu")))

    info_a.filter([])
    assert len(info_a) == 0 and info_a.is_all_greedy


@pytest.mark.parametrize("lazy", [False, True])
def test_keep_first_matches_filter_of_a_prefix(lazy):
    """keep_first(n) (a draft chain's rows as its shallower requests stop: no index copy) is
    filter(list(range(n))): the same effective tensors and flags, lazy takes too, and later
    steps keep matching."""
    reqs = [make_req(0, temperature=0.8, top_k=10, min_new_tokens=4, frequency_penalty=0.3),
            make_req(1, temperature=0.0, repetition_penalty=1.3, prompt=[6, 7, 8]),
            make_req(2, temperature=1.2, top_p=0.9, seed=3, prompt=[4, 5]),
            make_req(3, temperature=0.5, min_p=0.1, min_new_tokens=2, presence_penalty=0.7)]
    base = SamplingBatchInfo.from_reqs(reqs, V, "cpu")
    base.update(torch.tensor([1, 2, 3, 4]))
    for n in (3, 1):
        a, b = base.take([0, 1, 2, 3], lazy=lazy), base.take([0, 1, 2, 3])
        a.keep_first(n)
        b.filter(list(range(n)))
        assert_same(effective(a), effective(b))
        a.update(torch.arange(n) + 5)
        b.update(torch.arange(n) + 5)
        assert_same(effective(a), effective(b))


def assert_same(got: dict, want: dict):
    assert got.keys() == want.keys()
    for k in got:
        if isinstance(got[k], torch.Tensor):
            assert torch.equal(got[k], want[k]), k
        else:
            assert got[k] == want[k], k


# --- logprobs -----------------------------------------------------------------------------------
def test_sampler_logprobs_are_raw_log_softmax():
    reqs = penalty_reqs()  # penalties and temperature must not leak into the logprobs
    for r in reqs:
        r.sampling_params.temperature = 0.7
    reqs[0].sampling_params.temperature = 0.0
    logits = rand_logits(len(reqs))
    info = SamplingBatchInfo.from_reqs(reqs, V, "cpu")
    out = Sampler()(logits.clone(), info, reqs, return_logprob=True, top_logprobs_num=4)
    ref = torch.log_softmax(logits, -1)
    torch.testing.assert_close(out.logprobs, ref.gather(1, out.next_token_ids.view(-1, 1)).view(-1))
    vals, ids = ref.topk(4, -1)
    torch.testing.assert_close(out.top_logprobs_vals, vals)
    assert torch.equal(out.top_logprobs_ids, ids)


def test_token_logprobs_prompt(monkeypatch):
    monkeypatch.setattr(logprobs_mod, "_CHUNK_ROWS", 7)  # several chunks and a ragged last one
    input_ids = torch.randint(0, V, (30,))
    logits = rand_logits(29)  # position i scores token i + 1
    chosen, vals, ids = token_logprobs(logits, input_ids[1:], 3)
    ref = torch.log_softmax(logits, -1)
    torch.testing.assert_close(chosen, ref.gather(1, input_ids[1:].view(-1, 1)).view(-1))
    torch.testing.assert_close(vals, ref.topk(3, -1).values)
    assert torch.equal(ids, ref.topk(3, -1).indices)
    c16, _, _ = token_logprobs(logits.bfloat16(), input_ids[1:], 0)
    assert c16.dtype == torch.float32
    torch.testing.assert_close(c16, torch.log_softmax(logits.bfloat16().float(), -1)
                               .gather(1, input_ids[1:].view(-1, 1)).view(-1))
    assert token_logprobs(logits, input_ids[1:], 0)[1].shape == (29, 0)
