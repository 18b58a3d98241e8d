"""Speculative decoding: drafts, one verify forward, exact acceptance.

The scheduler's decode step calls `speculator.step(sched)` (worker.py) instead of its plain
decode when `--speculative-algorithm` is set and `speculator.wants_verify(sched)` (the adaptive
policy: False runs the scheduler's plain step, overlapped on a GPU); everything else (admission, chunked and mixed
prefill, retraction, jump-forward, finishing) is the scheduler's own code.

  spec_config.py     the SGLang flags, resolved and checked (refusals name the flag)
  worker.py          the step every drafter shares (Speculator): draft -> verify -> append
                     through the plain per-token code -> free
  isolation.py       a failure in drafting fails its request (or the step runs without drafts);
                     an out-of-memory in the verify runs the step again without drafts
  ngram_drafter.py   NGRAM (NgramSpeculator): per request, a lookup in the n-gram tables
  ngram.py           NGRAM drafts: the request's own n-gram index and the finished requests' table
  standalone.py      STANDALONE drafts: a draft model's batched chain (catch-up extend, then one
                     decode per depth), q processed as the target's p, its KV kept / freed
  draft_runner.py    the draft model's ModelRunner (own weights, KV pool, req -> token table)
                     and each request's draft KV (no tree; freed on finish / retract / jump)
  draft_budget.py    the draft's config, pool tokens and bytes (the GPU budget's share)
  eagle3.py          EAGLE3 drafts: an EAGLE-3 head's chain over the target's captured features,
                     its one-layer KV indexed by the target's slots
  draft_tree.py      draft trees (top-k > 1) of a draft model or an EAGLE-3 head: the draft's
                     beams, each on a scratch req_to_token row holding its path
  eagle3_model.py    the head (fc, one decoder layer, d2t vocabulary map) and its checkpoint
  eagle3_config.py   the head's config, the target layers it reads, its memory
  adaptive.py        per step, whether to look drafts up at all (skipped steps, probes) and
                     how many draft tokens each request verifies (0: plain decode): the
                     verify's overhead and a draft model's forwards priced in
  step_cost.py       the step-cost line c0 + c1 * T it fits online
  shadow.py          NGRAM on a GPU: drafts scored against the tokens plain (overlapped) steps
                     produced, the evidence that turns verifies on (no probes)
  grammar_drafts.py  drafts cut by the grammar, per-row grammar masks
  verify.py          the verify batch (an extend of [last + drafts] per request, or a decode
                     batch of one row per token where a CUDA graph takes it) and acceptance
  rejection.py       per row: greedy argmax or rejection sampling, min(1, p/q) and
                     max(0, p - q), with q a draft model's distribution or an n-gram point mass
  tree.py            a draft tree's shape, its best nodes, multi-candidate acceptance per node
  tree_verify.py     a tree's verify as decode rows, each node on a scratch req_to_token row

Invariants (tested in tests/unit/test_speculative*.py): greedy output equals plain decoding's
(fp32); sampled tokens follow the target distribution; after every step free + tree + owned ==
capacity (the rejected drafts' slots are freed in the step that computed them), and for a draft
model's own pool free + held by running requests == capacity; grammar, stop strings/regex,
logprobs and abort see exactly the tokens kept.
Not yet: n-gram trees, overlap of a verifying step (only skipped steps overlap).
Under tensor parallelism a draft model or an EAGLE-3 head runs whole on rank 0.

`create(args, sched)` returns the scheduler's speculator, or None when speculation is off.
"""

from __future__ import annotations

from radixlm.runtime.speculative.spec_config import SpecConfig, resolve


def create(args, sched):
    cfg: SpecConfig = resolve(args)
    if cfg is None:
        return None
    if cfg.algorithm == "EAGLE3":
        from radixlm.runtime.speculative.eagle3 import Eagle3Speculator

        return Eagle3Speculator(cfg, sched)
    if cfg.algorithm == "STANDALONE":
        from radixlm.runtime.speculative.standalone import StandaloneSpeculator

        return StandaloneSpeculator(cfg, sched)
    from radixlm.runtime.speculative.ngram_drafter import NgramSpeculator

    return NgramSpeculator(cfg, sched)
