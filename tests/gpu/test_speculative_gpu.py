"""On a CUDA GPU, fp32: speculative decoding (NGRAM, STANDALONE) gives plain decoding's greedy
tokens with the triton backend (plain steps from CUDA graphs), drafts are accepted, the KV
accounting holds, and the rejection sampler keeps the target distribution on the device. Run
with `pytest -m gpu tests/gpu`."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

V = 8


def _generate(path, **kw):
    import radixlm

    gen = torch.Generator().manual_seed(5)
    # repeated patterns: a random model falls into repetitions that n-grams draft
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() * 4 for n in (5, 8, 11, 17)]
    eng = radixlm.Engine(model_path=path, device="cuda", dtype="float32", skip_tokenizer_init=True,
                         max_total_tokens=8192, context_length=1024, attention_backend="triton",
                         **kw)
    try:
        outs = eng.generate(input_ids=prompts, sampling_params={
            "temperature": 0, "max_new_tokens": 40, "ignore_eos": True})
        stats = eng.get_stats()
        eng.wait_idle()
        eng.check_integrity()
    finally:
        eng.shutdown()
    return [o["output_ids"] for o in outs], stats


def test_greedy_matches_plain_decoding(tiny_llama_path):
    ref, _ = _generate(tiny_llama_path)
    for adaptive in (False, True):
        got, stats = _generate(tiny_llama_path, speculative_algorithm="NGRAM",
                               speculative_adaptive=adaptive)
        assert got == ref
        if not adaptive:
            assert stats["spec_accepted_tokens"] > 0


def test_standalone_greedy_matches_plain_decoding(tiny_llama_path):
    """A draft model (the target itself: every draft accepted) on the device: its chain's
    decode forwards run through its own runner (CUDA graphs), its pool and table are its own."""
    ref, _ = _generate(tiny_llama_path)
    got, stats = _generate(tiny_llama_path, speculative_algorithm="STANDALONE",
                           speculative_draft_model_path=tiny_llama_path,
                           speculative_adaptive=False)
    assert got == ref
    assert stats["spec_accepted_tokens"] == stats["spec_draft_tokens"] > 0


def test_standalone_trees_greedy_matches_plain_decoding(tiny_llama_path):
    """The same draft drafting trees (top-k 2, 2 steps, all 6 nodes): its beams run on scratch
    rows of its own req_to_token through its runner (decode graphs), the target verifies them
    on its scratch rows; a verify accepts a depth-2 path wherever two tokens are left (fp32
    near-ties aside)."""
    ref, _ = _generate(tiny_llama_path)
    got, stats = _generate(tiny_llama_path, speculative_algorithm="STANDALONE",
                           speculative_draft_model_path=tiny_llama_path,
                           speculative_adaptive=False, speculative_eagle_topk=2,
                           speculative_num_steps=2, speculative_num_draft_tokens=7)
    assert got == ref
    assert stats["spec_accepted_tokens"] > 1.5 * stats["spec_verify_reqs"] > 0


DEV = "cuda"


def _sampling_case():
    """One request sampled with temperature, top-k 4, top-p and min-p over V = 8 logits on the
    device: (req, logits (V,), its sampling rows, p: the filtered distribution on the host)."""
    from radixlm.runtime.request import Req
    from radixlm.runtime.sampling.sampler import Sampler
    from radixlm.runtime.sampling.sampling_batch_info import SamplingBatchInfo
    from radixlm.runtime.sampling_params import SamplingParams

    torch.manual_seed(0)
    sp = SamplingParams(temperature=0.8, top_k=4, top_p=0.97, min_p=0.03)
    sp.verify(V)
    req = Req("r", [1, 2, 3], sp)
    logits = torch.tensor([2.0, 1.5, 1.0, 0.4, 0.0, -0.5, -1.0, 2.6], device=DEV)
    base = SamplingBatchInfo.from_reqs([req], V, DEV)
    p = Sampler().filtered_probs(logits.view(1, -1).clone(), base.take([0]))[0]
    return req, logits, base, (p / p.sum()).cpu()


def _assert_follows(emitted: torch.Tensor, p: torch.Tensor, what) -> None:
    """The emitted tokens (host) never leave p's support and pass a chi-square test against p."""
    support = p > 0
    counts = torch.bincount(emitted, minlength=V).double()
    assert counts[~support].sum() == 0
    expected = p[support].double() * emitted.numel()
    chi2 = float(((counts[support] - expected) ** 2 / expected).sum())
    assert chi2 < 21.11, (what, chi2)  # df 3 (top_k 4), p = 1e-4


def test_rejection_sampling_on_the_device():
    from radixlm.runtime.sampling.sampler import Sampler
    from radixlm.runtime.speculative.rejection import accept_rows

    req, logits, base, p = _sampling_case()
    per_draft = 4000
    drafts = torch.arange(-1, V, device=DEV).repeat_interleave(per_draft)
    n = drafts.numel()
    accept, token = accept_rows(logits.expand(n, V).clone(), base.take([0] * n), [req] * n,
                                drafts, Sampler())
    emitted = torch.where(accept, drafts, token).cpu()
    drafts = drafts.cpu()
    for d in range(-1, V):
        _assert_follows(emitted[drafts == d], p, d)


def test_tree_acceptance_on_the_device():
    """Multi-candidate acceptance of a node's children (speculative/tree.py) on the device: the
    emitted token follows p whichever children are tried."""
    from radixlm.runtime.sampling.sampler import Sampler
    from radixlm.runtime.speculative.tree import accept_tree_rows

    req, logits, base, p = _sampling_case()
    n = 20000
    for children in ([7, 0], [3, 5, 1], [0, 1, 2, 3, 4, 5, 6, 7]):
        kids = torch.tensor(children + [-1] * (V - len(children)), device=DEV).expand(n, V)
        choice, token = accept_tree_rows(logits.expand(n, V).clone(), base.take([0] * n),
                                         [req] * n, kids.contiguous(), Sampler())
        picked = kids.gather(1, choice.clamp(min=0).view(-1, 1)).view(-1)
        _assert_follows(torch.where(choice >= 0, picked, token).cpu(), p, children)
