"""The speculative decode step the scheduler runs instead of a plain decode step.

  draft    the drafter proposes each running request's draft, cut by its grammar and its
           length limits, its length picked by the adaptive policy (0: none): n-gram lookups
           (ngram_drafter.py) or a draft model's chain (standalone.py, eagle3.py)
  verify   no draft anywhere: the plain decode step (the scheduler's own code, unchanged).
           Otherwise one extend forward over [last token + drafts] of every request
           (verify.py) and one acceptance pass over all rows (rejection.py)
  append   per request, the kept tokens go through the same per-token code as plain decoding
           (grammar, stop tokens / strings / regex, lengths, jump-forward, logprobs); the first
           finish or splice ends the request's list, and what follows is dropped
  free     KV slots of the tokens not kept go back to the allocator in the same step: request
           b keeps the slots of the m_b tokens it appended (its kv_len grows by m_b), so the
           accounting free + tree + owned == capacity holds after every step
One device -> host sync per verify (tokens and accept counts together); a draft model adds one
for its drafts (standalone.py). A failure in drafting or an out-of-memory in the verify: see
isolation.py.
"""

from __future__ import annotations

import time
from typing import Optional

import torch

from radixlm.runtime.request import Req
from radixlm.runtime.speculative import grammar_drafts, isolation
from radixlm.runtime.speculative.adaptive import AdaptivePolicy
from radixlm.runtime.speculative.spec_config import SpecConfig
from radixlm.runtime.speculative.tree import DraftTree
from radixlm.runtime.speculative.tree_verify import build_tree_verify, verify_tree, write_paths
from radixlm.runtime.speculative.verify import build_verify, verify

STAT_KEYS = ("spec_verify_steps", "spec_verify_reqs", "spec_verify_tokens", "spec_draft_tokens",
             "spec_accepted_tokens", "spec_draft_failures", "spec_verify_ooms")


class Speculator:
    """The step every drafter shares. A subclass proposes the drafts (`draft`: already cut by
    the adaptive policy, the grammar and the length limits), may give the distributions they
    were drawn from (`draft_probs`; None: point masses), hears how many of each request's
    drafts were accepted (`settle`) and when a request stops holding KV (`on_finish`,
    `on_retract`). A request's drafting state is `req.spec_draft`, with `.record` (its
    Acceptance) and `.match` (the adaptive policy's bucket)."""

    def __init__(self, cfg: SpecConfig, sched):
        self.cfg = cfg
        self.policy = AdaptivePolicy(cfg.adaptive, sched.device.type,  # a skipped step overlaps:
                                     overlap=(sched.device.type == "cuda"
                                              and not sched.args.disable_overlap_schedule))
        # wants_verify's decision, its step, when it was made and for how many requests
        self._decided, self._wants, self._decided_at, self._batch = None, True, 0.0, 0
        self.stats = sched.stats
        self.undo: list = []  # what a failed draft() undoes (isolation.py)
        self.failures: list = []  # (req, exception, where): failed in drafting, failed after it
        for key in STAT_KEYS:
            sched.stats[key] = 0

    def wants_verify(self, sched) -> bool:
        """Whether this decode step goes through `step` (lookups, maybe a verify); False: the
        scheduler runs its plain step, overlapped where it can. Decided once per step (the
        scheduler may ask twice: before chaining and before its decode)."""
        key = sched.stats["forward_steps"]
        if self._decided != key:
            now = time.perf_counter()
            if self._decided == key - 1 and not self._wants and self._batch == len(sched.running):
                self.policy.observe_fast(self._batch, now - self._decided_at)  # a skipped step
            self._decided, self._decided_at, self._batch = key, now, len(sched.running)
            cap = sched.runner.row_invariant_max
            if cap is not None and len(sched.running) >= cap:
                # the plain step already takes the most rows whose arithmetic is each row's
                # alone (GGUF blocks): a verify's extra rows would go to another kernel (the
                # dense rows' GEMM, whose sums depend on the row count) and change tokens.
                # No verify, so no lookups either
                self._wants = False
            else:
                self._wants = self.policy.wants_verify(
                    [r.spec_draft and r.spec_draft.record for r in sched.running])
        return self._wants

    def step(self, sched) -> list[Req]:
        """One decode step of sched.running (which ensure_decode_memory gave a slot each)."""
        t0 = time.perf_counter()
        reqs = list(sched.running)
        drafts = [[] for _ in reqs]
        if self.wants_verify(sched):  # (the requests whose drafting failed have left the batch)
            reqs, drafts = isolation.draft_batch(self, sched, reqs)
            if not reqs:
                return []
        tokens = len(reqs) + sum(len(d) for d in drafts)
        # every drafter chose within verify_rows (the plain step's arithmetic: see there)
        cap = sched.runner.row_invariant_max
        assert cap is None or tokens <= max(cap, len(reqs)), (tokens, cap)
        if tokens > len(reqs) and sched.allocator.available_size() < tokens:
            # never evict cached prefixes for guesses
            drafts, tokens = [[] for _ in reqs], len(reqs)
        ooms = sched.stats["spec_verify_ooms"]
        if tokens == len(reqs):
            done = self.no_draft_step(sched, reqs)
        else:
            done = self._verify(sched, reqs, drafts)
        if sched.stats["spec_verify_ooms"] != ooms:  # (its time is no verify's cost)
            return done
        # the target's part of the step: a draft model's forwards are timed on their own
        self.policy.observe_step(tokens, time.perf_counter() - t0 - self.draft_elapsed(),
                                 len(reqs) if tokens > len(reqs) else None)
        return done

    def no_draft_step(self, sched, reqs: list[Req]) -> list[Req]:
        """The step of `reqs` (== sched.running) without drafts: the scheduler's plain decode."""
        step = sched._launch_decode(reqs)
        done = [] if step is None else sched._complete_decode(step)  # None: an OOM failed them
        self.settle(reqs, [0] * len(reqs))
        return done

    def draft_failed(self, req: Req, exc: BaseException, where: str) -> None:
        """`req`'s own drafting raised: it fails once the batch's drafting is done."""
        self.failures.append((req, exc, where))

    def drop_draft(self) -> None:
        """Forget this step's drafts (the verify will not run): what a drafter keeps for it."""

    # --- what a drafter provides ------------------------------------------------------------------
    def draft(self, sched, reqs: list[Req]) -> list[list[int]]:
        raise NotImplementedError

    def device_drafts(self, reqs: list[Req]) -> Optional[torch.Tensor]:
        """(B, >= K) the drafts of `reqs` (the verify's order) on the device, when the host
        lists from `draft` hold their lengths only (values >= 0, read for grammar rows only:
        a drafter with a grammar request gives those true values); None: the lists are true."""
        return None

    def draft_probs(self, plan) -> Optional[torch.Tensor]:
        """(R, V) q of each verify row's draft (row order of `plan`), or None: point masses."""
        return None

    def draft_elapsed(self) -> float:
        """Seconds of this step spent in a draft model (read after the step's sync)."""
        return 0.0

    def settle(self, reqs: list[Req], accepted: list[int]) -> None:
        """After the step: `accepted[i]` drafts of reqs[i] were kept (finished ones included)."""

    def on_finish(self, req: Req) -> None:
        req.spec_draft = None

    def after_extend(self, fb, reqs: list[Req]) -> None:
        """After the scheduler's extend forward of `reqs` (fb's order; kv_len counts the new
        rows): EAGLE-3 keeps the target features of those rows (fb.aux_hidden)."""

    def after_verify(self, fb, plan, kept: list[int], paths: list[list[int]]) -> None:
        """After a verify: request plan.reqs[b] kept the KV of rows paths[b][:kept[b]] (-1:
        it finished or its output was rewritten)."""

    def idle_work(self, sched) -> None:
        """Host work to do while a step is in flight (the scheduler calls it after completing
        the step before): nothing by default."""

    def on_retract(self, req: Req) -> None:
        """The request gave its KV back (retraction, or a jump-forward that rewrites it)."""

    def check_integrity(self, sched) -> None:
        """Assert the drafter's own accounting (a draft model's KV pool)."""

    # --- the verify -------------------------------------------------------------------------------
    def _verify(self, sched, reqs: list[Req], drafts: list[list[int]]) -> list[Req]:
        order = sorted(range(len(reqs)), key=lambda i: not drafts[i])  # drafts first (stable)
        breqs = [reqs[i] for i in order]
        bdrafts = [drafts[i] for i in order]
        rows = len(reqs) + sum(map(len, drafts))
        # as decode rows where a graph replays them, and always on the CPU: there each row then
        # computes exactly what a plain decode step computes (the kernels' rows do not depend
        # on the rows beside them), where the extend kernel sums in another order (bf16:
        # different tokens in about half the copy benchmark's requests)
        as_decode = sched.runner.replays_decode_graph(rows) or sched.device.type == "cpu"
        tree = any(isinstance(d, DraftTree) for d in bdrafts)  # (always decode rows)
        if tree:
            fb, plan = build_tree_verify(breqs, order, bdrafts, sched.req_pool, sched.allocator,
                                         sched.device)
        else:
            fb, plan = build_verify(breqs, order, bdrafts, sched.req_pool, sched.allocator,
                                    sched.device, self.device_drafts(breqs), as_decode=as_decode)
        try:
            logits = sched.runner.forward(fb)  # (R, V) float32
            sched.stats["forward_steps"] += 1
            mask = grammar_drafts.masker(breqs, bdrafts, plan.offsets, plan.num_rows,
                                         sched.masks, self.draft_failed)
            lp_reqs = [r for r in reqs if r.return_logprob]
            top_n = max((r.top_logprobs_num for r in lp_reqs), default=0)
            if tree:
                res = verify_tree(logits, plan, sched.running_info, sched.sampler, mask,
                                  bool(lp_reqs), top_n)
                write_paths(plan, res.paths, sched.req_pool)  # (before a finish caches them)
            else:
                res = verify(logits, plan, sched.running_info, sched.sampler, mask,
                             bool(lp_reqs), top_n, self.draft_probs(plan))
        except torch.cuda.OutOfMemoryError as e:  # again without drafts, or the batch fails
            if sched.args.tp_size > 1:  # the other ranks are in the same collective
                raise
            return isolation.verify_oom(self, sched, reqs, plan, e)
        masked_out = {id(r): (e, f"the verify ({where})") for r, e, where in self.failures}
        self.failures = []

        kept_kv = [-1] * len(breqs)  # per batch row b: KV rows it keeps (-1: gone)
        free: list[int] = []  # rows of plan.slots whose tokens were not kept
        keep: set[int] = set()
        kept_rows, kept_toks, counts = [], [], [0] * len(reqs)
        accepted = [0] * len(reqs)
        stats = sched.stats
        stats["spec_verify_steps"] += 1
        for b, req in enumerate(breqs):
            k, off = len(bdrafts[b]), plan.offsets[b]
            state = req.spec_draft  # (a finish below hands it to on_finish)
            path = res.paths[b]  # the rows of its tokens; those of its kept KV: path[:m]
            if id(req) in masked_out:  # its grammar's masks failed: all of its rows go back
                free.extend(range(off, off + k + 1))
                sched._fail_request(req, *masked_out[id(req)])
                continue
            try:
                m, alive = _append(sched, req, res.tokens[b], plan.kv_lens[b], res.logprobs, path)
            except Exception as e:  # its own tokens' handling: it fails alone (isolation.py)
                # rows path[:m] lie inside its kv_len, which the failure frees; the rest of its
                # rows are this step's to free, as after a finish
                m = req.kv_len - plan.kv_lens[b]
                free.extend(_unkept(off, k, path[:m]))
                sched._fail_request(req, e, "processing its verified tokens")
                continue
            free.extend(_unkept(off, k, path[:m]))
            i = order[b]
            counts[i] = m
            accepted[i] = res.accepted[b]
            kept_rows += [i] * m
            kept_toks += res.tokens[b][:m]
            if alive:
                keep.add(i)
                kept_kv[b] = m
            if k:  # (a tree's trial: its depth, as deep as a chain of that length)
                depth = bdrafts[b].depth if isinstance(bdrafts[b], DraftTree) else k
                self.policy.record(state.record, state.match, depth, res.accepted[b])
                req.spec_verify_steps += 1
                req.spec_verify_tokens += m
                stats["spec_verify_reqs"] += 1
                stats["spec_verify_tokens"] += m
                stats["spec_draft_tokens"] += k
                stats["spec_accepted_tokens"] += res.accepted[b]
        self.after_verify(fb, plan, kept_kv, res.paths)
        if free:
            free.sort()
            # (plan.slots: what alloc() returned, never written: no copy needed)
            sched.allocator.free(_rows_of(plan.slots, free), copy=False)
        sched.running_info.advance(kept_rows, kept_toks, counts)
        sched._retire(reqs, keep)
        self.settle(reqs, accepted)
        return reqs


def _rows_of(t: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """t[rows] for ascending `rows`, as slices when they form few runs (a batch-1 verify frees
    one run): a view costs no host -> device copy of the index, nor an indexing kernel."""
    runs = [0] + [i for i in range(1, len(rows)) if rows[i] != rows[i - 1] + 1] + [len(rows)]
    if len(runs) > 5:  # more than 4 runs: one index copy and one gather are cheaper
        return t[torch.tensor(rows, device=t.device)]
    parts = [t[rows[a]: rows[b - 1] + 1] for a, b in zip(runs, runs[1:])]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def draft_room(req: Req, max_draft: int, context_len: int) -> int:
    """Draft tokens a verify may add: it appends up to k + 1 tokens, within max_new_tokens and
    the context."""
    return max(0, min(max_draft, req.remaining_new_tokens() - 1, context_len - req.seqlen - 1))


def verify_rows(sched):
    """The most tokens a verify may compute: the decode graphs' rows where there are graphs (a
    verify past them runs eagerly: 10x a plain step at batch 64 on an H200), and at most the
    rows whose arithmetic is each row's alone (a GGUF model's direct kernel on the CPU:
    `runner.row_invariant_max`); else no limit. A batch already at that many requests drafts
    nothing."""
    graphs = sched.runner.graph_runner
    limits = [n for n in (graphs.max_bs if graphs is not None else None,
                          sched.runner.row_invariant_max) if n is not None]
    return min(limits) if limits else None


def _unkept(off: int, k: int, kept: list[int]) -> list[int]:
    """A request's rows off .. off + k without the `kept` ones."""
    keep = set(kept)
    return [r for r in range(off, off + k + 1) if r not in keep]


def _append(sched, req: Req, tokens: list[int], kv_len: int, logprobs, rows: list[int]):
    """Append a verify's tokens to `req` one by one through the plain decoding code; the first
    that finishes the request (or splices a jump-forward) is the last. Token j came from logits
    row rows[j]. Returns (tokens kept m, still running). Before token j, kv_len covers [.., last,
    d_1..d_j]: a finish or splice hands exactly that KV to the tree, and the step's slots of
    rows other than rows[:m] are the caller's to free."""
    for j, tok in enumerate(tokens):
        req.kv_len = kv_len + 1 + j
        if logprobs is not None:
            logprobs.append(req, rows[j])
        if not sched._append_token(req, tok):
            return j + 1, False
    return len(tokens), True

