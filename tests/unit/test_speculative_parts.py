"""Speculative decoding's parts without a model: the rejection sampler keeps the target's
distribution (chi-square on a tiny vocabulary, every sampling parameter on) for point-mass
(n-gram) and dense (draft model) drafts, the n-gram indexes and the flags (the adaptive policy's
parts: test_speculative_adaptive.py)."""

from __future__ import annotations

import argparse
import collections
import os
import random

import pytest
import torch

from radixlm.runtime.config import ServerArgs
from radixlm.runtime.request import Req
from radixlm.runtime.sampling.sampler import Sampler
from radixlm.runtime.sampling.sampling_batch_info import SamplingBatchInfo
from radixlm.runtime.sampling_params import SamplingParams
from radixlm.runtime.speculative import spec_config
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


def test_ngram_tables_built_in_numpy_equal_the_token_by_token_ones(monkeypatch):
    from radixlm.runtime.speculative import ngram
    from radixlm.runtime.speculative.ngram import roll

    def shared_reference(table, tokens, start, lo, hi, k):  # SharedIndex.add, a token at a time
        suffix = suffix_hashes(tokens[:start], hi)
        for i in range(start, len(tokens)):
            for n in range(lo, len(suffix) + 1):
                table[suffix[n - 1]] = tuple(tokens[i : i + k])
                table.move_to_end(suffix[n - 1])
            suffix = roll(suffix, tokens[i], hi)

    rng = random.Random(0)
    for _ in range(60):
        lo = rng.randint(1, 3)
        hi = rng.randint(lo, 7)
        vocab = rng.choice([3, 50000])
        parts = [[rng.randrange(vocab) for _ in range(rng.choice([0, 1, 5, 63, 64, 65, 300]))]
                 for _ in range(3)]
        vector = OwnIndex([], lo, hi)
        monkeypatch.setattr(ngram, "VECTOR_MIN", 10 ** 9)
        scalar = OwnIndex([], lo, hi)
        for part in parts:  # (a prompt, then outputs appended in chunks)
            monkeypatch.setattr(ngram, "VECTOR_MIN", 10 ** 9)
            scalar.extend(part)
            monkeypatch.undo()
            vector.extend(part)
            assert (vector.tokens, vector.table, vector.suffix) == (
                scalar.tokens, scalar.table, scalar.suffix)
        tokens = [t for p in parts for t in p]
        start = rng.randint(0, len(tokens))
        shared = SharedIndex(lo, hi, 4, capacity=10 ** 6)
        shared.add(tokens, start)
        ref = collections.OrderedDict()
        shared_reference(ref, tokens, start, lo, hi, 4)
        assert list(shared.table.items()) == list(ref.items())  # the LRU order too
