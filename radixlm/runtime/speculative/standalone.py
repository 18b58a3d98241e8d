"""STANDALONE: drafts from a smaller model with the target's vocabulary (`--speculative-draft-
model-path`), verified by the shared step (worker.Speculator).

One step of the draft chain, batched over the drafting requests (F of them, sorted by their
draft length k_i, longest first, so the requests still drafting at depth j are a prefix):
  1. catch-up extend: each request computes, on the draft, the tokens whose draft KV it lacks:
     its whole prompt after admission (the target's cache hits too: the draft has no tree),
     the correction / bonus token and the last accepted draft after a verify, what mixed
     prefill steps decoded. At most `chunked_prefill_size` such tokens per step (a request
     past that budget catches up over several steps and drafts once it has). Its last row
     per request gives q_1 and d_1.
  2. depth j = 2..max k: one decode forward of d_{j-1} for the requests with k_i >= j -> q_j, d_j.
q_j is the draft's distribution processed with the request's own sampling parameters, the
drafts before it counted as output (rejection.sample_draft), and masked by its grammar (the
matcher walks the drafts on the host and is rolled back); a chain is cut after a stop token or
the grammar's end (nothing after them can be kept). The verify accepts d_j with
min(1, p/q_j) and resamples from max(0, p - q_j) (rejection.py). After it (`settle`), the
draft keeps the KV of its inputs the verify accepted; the rest is freed in the same step.

Draft trees (`--speculative-eagle-topk` > 1): after the catch-up, draft_tree.py's beams on
scratch rows of the draft's req_to_token, their KV freed after the drafting (the next
catch-up computes the tokens the verify kept); one more sync (the tree's shape).
Host syncs: the verify's only; the drafts stay on the device (verify.build_verify reads them
there), unless a drafting request has a grammar (its matcher walks each depth's drafts on the
host: one sync per depth). The draft forwards are timed apart: the adaptive policy prices a
chain (on a GPU that time is their launch, the sync being the verify's).
"""

from __future__ import annotations

import time
from typing import Optional

import torch

from radixlm.runtime.constrained.grammar import MaskBuffer
from radixlm.runtime.executor.forward_batch import ForwardBatch, ForwardMode
from radixlm.runtime.executor.host_staging import staged
from radixlm.runtime.request import Req
from radixlm.runtime.speculative import grammar_drafts, isolation
from radixlm.runtime.speculative.draft_runner import DraftKV, build_draft_runner
from radixlm.runtime.speculative.draft_tree import Beams, draft_trees, prune_trees, tree_sizes
from radixlm.runtime.speculative.rejection import sample_draft
from radixlm.runtime.speculative.spec_config import SpecConfig
from radixlm.runtime.speculative.worker import Speculator, draft_room, verify_rows


class StandaloneSpeculator(Speculator):
    def __init__(self, cfg: SpecConfig, sched):
        super().__init__(cfg, sched)
        self.kv = DraftKV(build_draft_runner(
            sched.args, sched.runner, cfg.draft_inputs(),
            cfg.spare_rows(sched.args.max_running_requests)))
        self.runner = self.kv.runner
        self._init_chain(sched)

    def _init_chain(self, sched) -> None:
        """The chain's per-step state (eagle3.py's head shares it and `_collect`)."""
        self.vocab = sched.vocab_size
        self.masks = MaskBuffer(sched.vocab_size)
        size = sched.chunked_prefill_size
        self.catchup_budget = size if size > 0 else 1 << 62
        self._q: Optional[torch.Tensor] = None  # (N, V) this step's q rows, all depths
        self._q_rows: dict[int, list[int]] = {}  # id(req) -> its q rows, depth 1..k
        self._grid: Optional[torch.Tensor] = None  # (F + 1, depth) this step's drafts
        self._grid_row: dict[int, int] = {}  # id(req) -> its row of _grid
        self._timing: Optional[tuple] = None  # (host s, forwards, steady, CUDA events)
        self.stats = sched.stats
        self.stats["spec_draft_forwards"] = 0
        self.stats["spec_draft_kv_short"] = 0  # steps the draft pool could not hold every chain

    # --- the draft chain --------------------------------------------------------------------------
    @staticmethod
    def _sample_step(logits, grammar, info, creqs, active: int, sched, toks: list, qs: list):
        """One chain step's tokens from its draft logits (active, V): grammar masks, the
        requests' sampling, their grammars walked; appends the tokens and their q to the chain."""
        grammar.mask(logits, active)
        tok, q = sample_draft(logits, info, creqs[:active], sched.sampler)
        info.update(tok)
        grammar.walk(tok, active)
        toks.append(tok)
        qs.append(q)

    def draft(self, sched, reqs: list[Req]) -> list[list[int]]:
        t0 = time.perf_counter()
        self._q, self._q_rows, self._grid, self._grid_row = None, {}, None, {}
        self._timing = None
        states = [self.kv.state(r) for r in reqs]
        cfg = self.cfg
        rooms = [draft_room(r, cfg.steps, sched.context_len) for r in reqs]
        ks = self.policy.choose([s.record for s in states], rooms, [1] * len(reqs),
                                verify_rows(sched), cfg.tree_rows if cfg.topk > 1 else None)
        self._nodes = ks
        if cfg.topk > 1:  # (scratch rows: the target's for the verify, the draft's for beams)
            spare = min(len(sched.req_pool.spare_rows), len(self.kv.req_pool.spare_rows))
            self._nodes = tree_sizes(cfg, spare, verify_rows(sched), ks)
        if not any(ks) or sched.allocator.available_size() < len(reqs) + sum(self._nodes):
            return [[] for _ in reqs]  # (the verify's target slots are never evicted for)
        chain, catch = self._plan(reqs, states, ks)
        drafts = [[] for _ in reqs]
        if chain or catch:
            events = None
            if sched.device.type == "cuda":  # the chain's device time, read after the sync
                events = (torch.cuda.Event(enable_timing=True),
                          torch.cuda.Event(enable_timing=True))
                events[0].record()
            drafts, forwards = self._run(sched, reqs, states, ks, chain, catch)
            if events is not None:
                events[1].record()
            # the per-forward price from steady steps only (a token or two of catch-up each): a
            # prompt's catch-up is a one-off, like its prefill, not the cost of a chain step
            steady = sum(catch.values()) <= 2 * len(catch)
            self._timing = (time.perf_counter() - t0, forwards, steady, events)
        return drafts

    def draft_elapsed(self) -> float:
        """The chain's seconds: host time on the CPU; on CUDA its device time between two
        events (the drafts are not synced; the verify's sync has passed them by now)."""
        if self._timing is None:
            return 0.0
        seconds, forwards, steady, events = self._timing
        self._timing = None
        if events is not None:
            seconds = max(seconds, events[0].elapsed_time(events[1]) / 1e3)
        if steady:
            self.policy.observe_draft(forwards, seconds)
        return seconds

    def _plan(self, reqs, states, ks) -> tuple[list[int], dict[int, int]]:
        """(chain: the requests that draft, longest k first; catch: request -> draft tokens it
        computes this step), within the catch-up budget and the draft pool's room."""
        budget = self.catchup_budget
        chain, catch = [], {}
        for i in sorted((i for i in range(len(reqs)) if ks[i]), key=lambda i: -ks[i]):
            lag = reqs[i].seqlen - states[i].kv_len  # >= 1: the last token is never computed
            if lag <= budget:
                chain.append(i)
                catch[i] = lag
                budget -= lag
            elif budget > 0:  # a long prompt: part of it now, the draft later
                catch[i] = budget
                budget = 0
        # (a chain's inputs past the catch-up; a tree's: top-k beams a level below the first)
        need = lambda: sum(catch.values()) + self.cfg.topk * sum(  # noqa: E731
            ks[i] - 1 for i in chain)
        if need() > self.kv.free_size():  # the idle requests' draft KV goes first
            self.stats["spec_draft_kv_short"] += 1
            for i, req in enumerate(reqs):
                if i not in catch:
                    self.kv.release(req)
            states[:] = [self.kv.state(r) for r in reqs]
        while need() > self.kv.free_size() and catch:  # then the shortest drafts
            last = chain.pop() if chain else next(reversed(catch))
            catch.pop(last, None)
        return chain, catch

    def _run(self, sched, reqs, states, ks, chain, catch) -> list[list[int]]:
        kv, dev = self.kv, sched.device
        # extend order: multi-token catch-ups first, one-token ones last (a decode tail)
        entries = sorted(catch, key=lambda i: catch[i] == 1)
        n_catch = sum(catch.values())
        chain_k = [ks[i] for i in chain]
        F, depth = len(chain), max(chain_k, default=1)
        tree = self.cfg.topk > 1
        if tree:  # (the beams' inputs: draft_tree.py's own slots and scratch rows)
            depth = 1
        slots = kv.allocator.alloc(n_catch + sum(k - 1 for k in chain_k) * (not tree))
        assert slots is not None, "_plan fitted the draft pool"
        # a failed chain (isolation.py) frees the slots it took and puts the states back
        self.undo += [lambda: kv.allocator.free(slots),
                      isolation.snapshot(states, "kv_len", "base", "chain")]
        ids, rows, pos, ends = [], [], [], {}
        for i in entries:
            st, req = states[i], reqs[i]
            start, n = st.kv_len, catch[i]
            ids += _tokens(req, start, start + n)
            rows += [st.row] * n
            pos += range(start, start + n)
            ends[i] = len(pos) - 1
        grid = []  # (F, depth - 1) indices into `slots` of each chain's inputs d_1 .. d_{k-1}
        for i, k in zip(chain, chain_k):
            if tree:
                break
            base = reqs[i].seqlen
            grid.append([len(pos) + j for j in range(k - 1)] + [0] * (depth - k))
            rows += [states[i].row] * (k - 1)
            pos += range(base, base + k - 1)
        E = len(entries)
        beams = F * self.cfg.topk if tree else 0
        flat = staged(ids + rows + pos + [states[i].row for i in entries]
                      + [states[i].kv_len + catch[i] for i in entries]
                      + [ends[i] for i in chain + [i for i in entries if i not in chain]]
                      + [states[i].row for i in chain] + [reqs[i].seqlen for i in chain]
                      + sum(grid, []) + chain + kv.req_pool.spare_rows[:beams], dev)
        N, T = n_catch, len(pos)
        parts = torch.split(flat, [N, T, T, E, E, E, F, F, F * (depth - 1), F, beams])
        (d_ids, d_rows, d_pos, e_rows, e_lens, e_last, c_rows, c_base, c_grid, c_info,
         c_spare) = parts
        kv.rt[d_rows, d_pos] = slots
        fb = ForwardBatch(
            mode=ForwardMode.EXTEND, input_ids=d_ids, positions=d_pos[:N],
            out_cache_loc=slots[:N], req_pool_indices=e_rows, seq_lens=e_lens,
            logits_indices=e_last,
            seq_lens_cpu=[states[i].kv_len + catch[i] for i in entries],
            extend_prefix_lens_cpu=[states[i].kv_len for i in entries],
            extend_lens_cpu=[catch[i] for i in entries],
            num_decode_tail=sum(1 for i in entries if catch[i] == 1))
        for i in entries:
            states[i].kv_len += catch[i]
        logits = self.runner.forward(fb)[:F]  # (F, V): the chain's q_1 rows
        forwards = 1
        if not F:  # catch-ups only (a long prompt's next part)
            return [[] for _ in reqs], forwards
        if tree:  # (the draft keeps none of the beams' KV: its next catch-up computes the
            # tokens the verify kept)
            forward = lambda fb, _: (self.runner.forward(fb), None)  # noqa: E731
            trees, n = draft_trees(Beams(self.cfg.topk, kv.rt, kv.allocator, forward),
                                   c_rows, c_base, [reqs[i].seqlen for i in chain], c_spare,
                                   chain_k,
                                   [self._nodes[i] for i in chain], logits, None)
            self.stats["spec_draft_forwards"] += forwards + n
            return prune_trees(self, reqs, chain, trees), forwards + n
        c_grid = c_grid.view(F, depth - 1)
        creqs = [reqs[i] for i in chain]
        # (the rows' index already on the device: a blocking copy here would wait for the
        # catch-up's forward; lazy: a greedy chain reads none of the sampling tensors)
        info = sched.running_info.take(chain, index=c_info, lazy=True)
        grammar = grammar_drafts.ChainGrammar(creqs, self.masks, self.draft_failed)
        self.undo.append(grammar.rollback)
        toks, qs = [], []
        for j in range(1, depth + 1):
            active = sum(1 for k in chain_k if k >= j)
            if j > 1:  # the decode of d_{j-1} at position base + j - 2
                if active < len(info):
                    info.keep_first(active)  # (the deepest requests come first)
                p = c_base[:active] + (j - 2)
                fb = ForwardBatch(
                    mode=ForwardMode.DECODE, input_ids=toks[-1][:active], positions=p,
                    out_cache_loc=slots[c_grid[:active, j - 2]],
                    req_pool_indices=c_rows[:active], seq_lens=p + 1,
                    logits_indices=torch.arange(active, device=dev),
                    seq_lens_cpu=[reqs[i].seqlen + j - 1 for i in chain[:active]])
                logits = self.runner.forward(fb)
                forwards += 1
            self._sample_step(logits, grammar, info, creqs, active, sched, toks, qs)
        self.stats["spec_draft_forwards"] += forwards
        for i, k in zip(chain, chain_k):  # the chain's inputs are held until settle
            states[i].base, states[i].chain = reqs[i].seqlen, k - 1
            states[i].kv_len += k - 1
        return self._collect(reqs, chain, chain_k, toks, qs, grammar), forwards

    def _collect(self, reqs, chain, chain_k, toks, qs, grammar) -> list[list[int]]:
        """The drafts: on the device (F, depth) for the verify, no sync; on the host only when
        a grammar walked them (then also cut after a grammar's end or a stop token), else
        their lengths (placeholder values). And the q rows each request's drafts came from."""
        if not chain:
            return [[] for _ in reqs]
        grammar.rollback()
        F, depth = len(chain), len(toks)
        grid = toks[0].new_zeros(F + 1, depth)  # (F + 1, depth); row F: for no draft
        for j, t in enumerate(toks):
            grid[: t.shape[0], j] = t
        self._grid, self._grid_row = grid, {id(reqs[i]): a for a, i in enumerate(chain)}
        flat = grammar.host  # every chain row's drafts, depth by depth (None: no grammar)
        drafts = [[] for _ in reqs]
        offs = [0]
        for t in toks:
            offs.append(offs[-1] + t.shape[0])
        for a, (i, k) in enumerate(zip(chain, chain_k)):
            if flat is None:
                drafts[i] = [0] * k
                continue
            d = [flat[offs[j] + a] for j in range(min(k, grammar.cut[a]))]
            stops = reqs[i].stop_token_ids  # a stop token ends the request: nothing after counts
            cut = next((j + 1 for j, t in enumerate(d) if t in stops), len(d))
            drafts[i] = d[:cut]
        if any(q is not None for q in qs):
            dense = [q if q is not None else torch.zeros(t.shape[0], self.vocab, device=t.device)
                     for q, t in zip(qs, toks)]
            self._q = torch.cat(dense)  # (sum of active rows per depth, V)
            for a, i in enumerate(chain):
                self._q_rows[id(reqs[i])] = [offs[j] + a for j in range(len(drafts[i]))]
        return drafts

    def drop_draft(self) -> None:
        self._q, self._q_rows, self._grid, self._grid_row = None, {}, None, {}

    # --- the verify's view and the aftermath ------------------------------------------------------
    def device_drafts(self, reqs: list[Req]) -> Optional[torch.Tensor]:
        if self._grid is None:
            return None
        F = self._grid.shape[0] - 1
        index = [self._grid_row.get(id(r), F) for r in reqs]
        # (B, depth); the index staged: a blocking copy would wait for the chain's forwards
        out = self._grid[staged(index, self._grid.device)]
        self._grid, self._grid_row = None, {}
        return out

    def draft_probs(self, plan) -> Optional[torch.Tensor]:
        if self._q is None:
            return None
        dst, src = [], []
        for b, req in enumerate(plan.reqs):
            rows = self._q_rows.get(id(req), [])[: len(plan.drafts[b])]
            dst += range(plan.offsets[b], plan.offsets[b] + len(rows))
            src += rows
        out = self._q.new_zeros(plan.num_rows, self._q.shape[1])  # (R, V); last rows: none
        dev = self._q.device
        out[torch.tensor(dst, device=dev)] = self._q[torch.tensor(src, device=dev)]
        self._q, self._q_rows = None, {}
        return out

    def settle(self, reqs: list[Req], accepted: list[int]) -> None:
        """Keep the draft KV of the inputs the verify accepted (last, d_1..d_n): positions up to
        base + min(n, k - 1); the correction / bonus token is computed at the next catch-up."""
        states, lengths = [], []
        for req, n in zip(reqs, accepted):
            st = req.spec_draft
            if st is None or st.base is None:
                continue
            states.append(st)
            lengths.append(st.base + min(n, st.chain))
            st.base, st.chain = None, 0
        self.kv.keep(states, lengths)

    def on_finish(self, req: Req) -> None:
        self.kv.release(req)

    def on_retract(self, req: Req) -> None:
        self.kv.release(req)

    def check_integrity(self, sched) -> None:
        self.kv.check_integrity(sched.running)


def _tokens(req: Req, start: int, end: int) -> list[int]:
    """The request's tokens [start, end) as vocab ids (image pseudo ids -> the image token)."""
    prompt = req.vocab_input_ids()
    n = len(prompt)
    if start >= n:
        return req.output_ids[start - n : end - n]
    return prompt[start:end] + req.output_ids[: max(0, end - n)]
