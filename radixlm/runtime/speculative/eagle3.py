"""EAGLE3: drafts from an EAGLE-3 head (`--speculative-draft-model-path`, eagle3_model.py) that
reads the target's features, verified by the shared step (worker.Speculator).

The head's KV: one layer, one slot per target slot (its pool is indexed by the target's slots,
reached through the target's req_to_token), so it has no allocator, tree or rows of its own.
The head's row for position p is (token x_{p+1}, g_p = fc(target features at p)), stored at
the target's slot of position p. A cached prefix (radix hit) brings the head's rows with the
target's slots; the row of its last cached position was computed with whatever token followed
it then (and one never computed is stale memory): only the drafts' quality depends on them.

Per request (`Eagle3State`, Req.spec_draft): the head's rows not computed yet, positions
[start, start + n), as g rows (n, H). Every target forward adds its rows: an extend (prefill
chunks, mixed decodes) through `after_extend`, a verify through `after_verify` (the rows whose
KV the request kept). The target captures its features (fb.aux_hidden) only when EAGLE3 is on
(ModelRunner.capture_layers; also inside its decode CUDA graphs, which a verify replays).

One step of drafting, batched over the running requests:
  1. catch-up: each request's pending rows (at most `chunked_prefill_size` in all), an extend,
     or decode rows of seq_len position + 1 through the head's graphs where they fit; the last
     row of a request (position kv_len - 1, token: its last one) gives d_1 and the head's
     pre-norm output o_1.
  2. depth j = 2..k: one decode forward of (d_{j-1}, o_{j-1}) at position kv_len + j - 2, its
     K/V in a slot taken from the target's free slots and freed after the chain (the verify's
     features recompute those rows for real).
q_j: the head's logits placed into the target vocabulary (column d + d2t[d]; 0 probability
elsewhere) and processed like the target's p (rejection.sample_draft); chains are cut by
grammars and stop tokens as for a draft model (standalone.py's `_collect`).
Under tensor parallelism the head runs on rank 0 with the target's whole embedding (kept there
by ModelRunner) and the target's hidden states, which every rank holds whole.
Draft trees (--speculative-eagle-topk > 1): draft_tree.py, the head's beams on scratch rows of
the target's req_to_token. Not built: targets whose forward is not llama.py's (Gemma, LLaVA).
"""

from __future__ import annotations

import time
from typing import Optional

import torch

from radixlm.runtime.attention.base import AttentionSpec
from radixlm.runtime.attention.registry import create_attention_backend
from radixlm.runtime.executor.forward_batch import ForwardBatch, ForwardMode
from radixlm.runtime.executor.host_staging import staged
from radixlm.runtime.mem_cache.kv_pool import KVPool
from radixlm.runtime.models.llama import LlamaForCausalLM
from radixlm.runtime.request import Req
from radixlm.runtime.speculative import eagle3_config, grammar_drafts, isolation
from radixlm.runtime.speculative.adaptive import Acceptance, AdaptivePolicy
from radixlm.runtime.speculative.eagle3_graphs import HeadGraphRunner
from radixlm.runtime.speculative.eagle3_model import build_head
from radixlm.runtime.speculative.draft_tree import (Beams, draft_trees, prune_trees,
                                                     tree_sizes)
from radixlm.runtime.speculative.spec_config import SpecConfig
from radixlm.runtime.speculative.standalone import StandaloneSpeculator, _tokens
from radixlm.runtime.speculative.worker import Speculator, draft_room, verify_rows


class Eagle3State:
    """A request's head rows not computed yet: positions [start, start + n), g rows (n, H)."""

    __slots__ = ("start", "rows", "n", "record", "match")

    def __init__(self, start: int):
        self.start, self.rows, self.n = start, [], 0
        self.record = Acceptance()
        self.match = 1  # (the adaptive policy's bucket: one for model drafts)

    def reset(self, start: int) -> None:
        self.start, self.rows, self.n = start, [], 0

    def add(self, start: int, g: torch.Tensor) -> None:
        """Rows at positions [start, start + len(g)); a gap drops what was pending."""
        if start != self.start + self.n:
            self.reset(start)
        self.rows.append(g)
        self.n += g.shape[0]

    def take(self, n: int) -> torch.Tensor:
        """The first n pending rows (n, H), removed."""
        g = self.rows[0] if len(self.rows) == 1 else torch.cat(self.rows)
        self.rows = [g[n:]] if n < g.shape[0] else []
        self.start += n
        self.n -= n
        return g[:n]


class Eagle3Speculator(StandaloneSpeculator):
    def __init__(self, cfg: SpecConfig, sched):
        Speculator.__init__(self, cfg, sched)
        # no step is skipped (wants_verify), so none overlaps: the policy prices verifies
        # against the zero-draft verifies, and caps nothing while it waits for an overlapped one
        self.policy = AdaptivePolicy(cfg.adaptive, sched.device.type, overlap=False)
        runner, args = sched.runner, sched.args
        if type(runner.model).forward is not LlamaForCausalLM.forward or not runner.capture_layers:
            raise ValueError(f"speculative_algorithm=EAGLE3: the target "
                             f"{type(runner.model).__name__} does not expose its layers' hidden "
                             "states (Llama-family targets do)")
        e = eagle3_config.resolve(args, runner.model_config)
        embed = (runner.whole_embedding if runner.whole_embedding is not None  # (under TP)
                 else runner.model.embed_tokens.weight)
        self.head = build_head(e, cfg.draft_model_path, eagle3_config.load_format(args),
                               embed, runner.dtype, runner.device, runner.context_len, args.seed)
        c = e.model
        self.pool = KVPool(runner.capacity, 1, c.num_kv_heads, c.head_dim, runner.dtype,
                           runner.device)
        self.rt = runner.req_to_token_pool.req_to_token  # the target's: the head's slots too
        # its decode rows: the drafting requests', or a tree's beams (a scratch row each)
        rows = max(args.max_running_requests, len(runner.req_to_token_pool.spare_rows))
        self.backend = create_attention_backend(
            runner.attention_backend_name, self.pool, self.rt,
            AttentionSpec(scale=c.head_dim ** -0.5), device=runner.device,
            max_batch_size=rows + 1, max_context_len=runner.context_len + 1)
        self._init_chain(sched)
        # the chain's decode steps replay CUDA graphs where the target's decode does
        self.graphs: Optional[HeadGraphRunner] = None
        if runner.graph_runner is not None and getattr(self.backend, "supports_cuda_graph", False):
            max_bs = min(runner.graph_runner.max_bs, rows)
            self.graphs = HeadGraphRunner(self, runner, max_bs, sched.vocab_size)

    # --- the target's features in ---------------------------------------------------------------
    def after_extend(self, fb, reqs: list[Req]) -> None:
        if fb.aux_hidden is None:
            return
        try:
            g = self.head.project(fb.aux_hidden)  # (T, H)
        except Exception as e:
            return self._lost(reqs, e, "after an extend")
        off = 0
        for req, start, n in zip(reqs, fb.extend_prefix_lens_cpu, fb.extend_lens_cpu):
            self._state(req).add(start, g[off : off + n])
            off += n

    def after_verify(self, fb, plan, kept: list[int], paths: list[list[int]]) -> None:
        try:
            g = self.head.project(fb.aux_hidden)  # (R, H), rows of plan
        except Exception as e:
            return self._lost(plan.reqs, e, "after a verify")
        for b, req in enumerate(plan.reqs):
            if kept[b] > 0 and not req.finished:
                rows = paths[b][: kept[b]]  # (a chain's: consecutive, taken as a view)
                g_b = (g[rows[0] : rows[-1] + 1] if rows[-1] - rows[0] == len(rows) - 1
                       else g[torch.tensor(rows, device=g.device)])
                self._state(req).add(plan.kv_lens[b], g_b)

    def _lost(self, reqs: list[Req], exc: BaseException, when: str) -> None:
        """The features of `reqs`' new rows are lost: their pending rows go (drafts afresh)."""
        isolation.drafting_lost(self, exc, f"the head's features of {len(reqs)} requests {when}")
        for req in reqs:
            req.spec_draft = None

    def _state(self, req: Req) -> Eagle3State:
        if req.spec_draft is None:
            req.spec_draft = Eagle3State(req.kv_len)
        return req.spec_draft

    # --- the step -------------------------------------------------------------------------------
    def wants_verify(self, sched) -> bool:
        """Always: a plain decode step would give the head no features of its token."""
        return True

    def step(self, sched) -> list[Req]:
        t0 = time.perf_counter()
        reqs, drafts = isolation.draft_batch(self, sched, list(sched.running))
        if not reqs:  # (each failed in its own drafting)
            return []
        tokens = len(reqs) + sum(map(len, drafts))
        ooms = sched.stats["spec_verify_ooms"]
        done = self._verify(sched, reqs, drafts)  # (with no drafts: a verify of last tokens)
        if sched.stats["spec_verify_ooms"] != ooms:  # (its time is no verify's cost)
            return done
        self.policy.observe_step(tokens, time.perf_counter() - t0 - self.draft_elapsed(),
                                 len(reqs) if tokens > len(reqs) else None)
        return done

    def no_draft_step(self, sched, reqs: list[Req]) -> list[Req]:
        """A verify of the last tokens: a plain decode would give the head no features."""
        return self._verify(sched, reqs, [[] for _ in reqs])

    def draft(self, sched, reqs: list[Req]) -> list[list[int]]:
        t0 = time.perf_counter()
        self._q, self._q_rows, self._grid, self._grid_row = None, {}, None, {}
        self._timing = None
        states = [self._state(r) for r in reqs]
        cfg = self.cfg
        rooms = [draft_room(r, cfg.steps, sched.context_len) for r in reqs]
        ks = self.policy.choose([s.record for s in states], rooms, [1] * len(reqs),
                                verify_rows(sched), cfg.tree_rows if cfg.topk > 1 else None)
        self._nodes = (tree_sizes(cfg, len(sched.req_pool.spare_rows), verify_rows(sched), ks)
                       if cfg.topk > 1 else ks)
        drafting = sum(k - 1 for k in ks if k) * cfg.topk  # (the head's own rows)
        if sched.allocator.available_size() < len(reqs) + sum(self._nodes) + drafting:
            ks = [0] * len(reqs)  # (the verify's slots, and the drafting's before them)
        chain, catch = self._plan(reqs, states, ks)
        if not catch:
            return [[] for _ in reqs]
        drafts, forwards = self._run(sched, reqs, states, ks, chain, catch)
        steady = sum(catch.values()) <= 2 * len(catch)  # (as standalone.py prices a chain)
        self._timing = (time.perf_counter() - t0, forwards, steady, None)
        return drafts

    def _plan(self, reqs, states, ks) -> tuple[list[int], dict[int, int]]:
        """(chain: the requests that draft, longest k first; catch: request -> pending rows it
        computes now), within the catch-up budget. A request drafts once its rows reach its
        last token (position kv_len - 1)."""
        budget = self.catchup_budget
        chain, catch = [], {}
        for i in sorted(range(len(reqs)), key=lambda i: -ks[i]):
            st, req = states[i], reqs[i]
            if st.start + st.n != req.kv_len:  # rows missing past them: start afresh
                st.reset(req.kv_len)
                continue
            if not st.n or not budget:
                continue
            catch[i] = min(st.n, budget)
            budget -= catch[i]
            if ks[i] and catch[i] == st.n:
                chain.append(i)
        return chain, catch

    def _forward(self, fb: ForwardBatch, g: torch.Tensor):
        fb.attn_backend = self.backend
        self.backend.init_forward_metadata(fb)
        return self.head(fb, g)

    def _run(self, sched, reqs, states, ks, chain, catch):
        dev = sched.device
        # extend order: multi-row catch-ups first, one-row ones last (the backends' decode tail)
        entries = sorted(catch, key=lambda i: catch[i] == 1)
        ids, rows, pos, ends, g = [], [], [], {}, []
        for i in entries:
            st, req, n = states[i], reqs[i], catch[i]
            ids += _tokens(req, st.start + 1, st.start + n + 1)  # row p's token: x_{p+1}
            rows += [req.req_pool_idx] * n
            pos += range(st.start, st.start + n)
            ends[i] = len(pos) - 1
        pre_lens = [states[i].start for i in entries]
        self.undo.append(isolation.snapshot(states, "start", "rows", "n"))  # (a failed chain)
        for i in entries:
            g.append(states[i].take(catch[i]))
        F = len(chain)
        logit_order = chain + [i for i in entries if i not in chain]  # the chain's rows first
        # one copy (through a pinned buffer on CUDA: a blocking copy would wait for the GPU)
        # of the catch-up's rows, and the chain's pool rows, first positions and a tree's
        # scratch rows (a beam's each)
        beams = F * self.cfg.topk if self.cfg.topk > 1 else 0
        host = staged(
            ids + rows + pos + [reqs[i].req_pool_idx for i in entries]
            + [p + catch[i] for p, i in zip(pre_lens, entries)] + [ends[i] for i in logit_order]
            + [reqs[i].req_pool_idx for i in chain] + [reqs[i].kv_len for i in chain]
            + chain + sched.req_pool.spare_rows[:beams], dev)
        T, E = len(ids), len(entries)
        (d_ids, d_rows, d_pos, e_rows, e_lens, e_last, c_rows, c_base, c_info,
         c_spare) = torch.split(host, [T, T, T, E, E, E, F, F, F, beams])
        slots, g = self.rt[d_rows, d_pos], torch.cat(g)
        if self.graphs is not None and T <= self.graphs.max_bs:
            # each row as a decode row of seq_len position + 1: every row's K/V is in the pool
            # before any attention runs, so row p sees rows <= p, as in the extend. One graph
            # replay instead of the eager head (0.84 ms a step at batch 1 on an H200, ~0.2 of
            # it the GPU's)
            fb = ForwardBatch(
                mode=ForwardMode.DECODE, input_ids=d_ids, positions=d_pos, out_cache_loc=slots,
                req_pool_indices=d_rows, seq_lens=d_pos + 1,
                logits_indices=torch.arange(T, device=dev), seq_lens_cpu=[p + 1 for p in pos])
            logits, out = self.graphs.run(fb, g)  # (T, V), (T, H): the graph's buffers
            last = e_last[:F]
            logits, out = logits[last], out[last]  # (F, V), (F, H) copies, in chain order
        else:
            fb = ForwardBatch(
                mode=ForwardMode.EXTEND, input_ids=d_ids, positions=d_pos, out_cache_loc=slots,
                req_pool_indices=e_rows, seq_lens=e_lens, logits_indices=e_last,
                seq_lens_cpu=[p + catch[i] for p, i in zip(pre_lens, entries)],
                extend_prefix_lens_cpu=pre_lens, extend_lens_cpu=[catch[i] for i in entries],
                num_decode_tail=sum(1 for i in entries if catch[i] == 1))
            normed, out = self._forward(fb, g)  # (E, H) each, in logit_order
            logits = (self.head.to_target(self.head.logits(normed[:F]), sched.vocab_size)
                      if F else None)
            out = out[:F]
        forwards = 1
        if not F:
            return [[] for _ in reqs], forwards
        chain_k = [ks[i] for i in chain]
        creqs = [reqs[i] for i in chain]
        if self.cfg.topk > 1:
            beams = Beams(self.cfg.topk, self.rt, sched.allocator, self._beam_forward)
            trees, n = draft_trees(beams, c_rows, c_base, [r.kv_len for r in creqs],
                                   c_spare, chain_k, [self._nodes[i] for i in chain], logits,
                                   out)
            self.stats["spec_draft_forwards"] += forwards + n
            return prune_trees(self, reqs, chain, trees), forwards + n
        n_temp = sum(k - 1 for k in chain_k)  # the chain's own K/V, past each kv_len
        temp = sched.allocator.alloc(n_temp) if n_temp else None
        assert temp is not None or not n_temp, "draft() checked the free slots"
        try:
            return self._chain(sched, creqs, reqs, chain, chain_k, c_rows, c_base, c_info,
                               logits, out, temp, forwards)
        finally:  # (the verify computes those positions for real; a failed chain frees too)
            if temp is not None:
                sched.allocator.free(temp)

    def _beam_forward(self, fb: ForwardBatch, g: torch.Tensor):
        """A tree's beams: (logits (B, V) in the target's vocabulary, pre-norm outputs (B, H)),
        through the head's graphs where they take the batch."""
        if self.graphs is not None and self.graphs.can_run(fb):
            return self.graphs.run(fb, g)
        normed, out = self._forward(fb, g)
        return self.head.to_target(self.head.logits(normed), self.vocab), out

    def _chain(self, sched, creqs, reqs, chain, chain_k, c_rows, base, c_info, first, out,
               temp, forwards):
        """Depths 1..k of the chain from the catch-up's last rows: first (F, V) their logits in
        the target's vocabulary (depth 1's), out (F, H) their pre-norm outputs; base (F,) the
        first draft positions (kv_len); c_info (F,) their sampling rows (`chain`) on the
        device."""
        dev, V, depth = sched.device, sched.vocab_size, max(chain_k)
        # (the rows' index already on the device: a blocking copy here would wait for the
        # catch-up's forward; lazy: a greedy chain reads none of the sampling tensors)
        info = sched.running_info.take(chain, index=c_info, lazy=True)
        grammar = grammar_drafts.ChainGrammar(creqs, self.masks, self.draft_failed)
        self.undo.append(grammar.rollback)
        toks, qs, used = [], [], 0
        for j in range(1, depth + 1):
            active = sum(1 for k in chain_k if k >= j)
            if j > 1:  # (d_{j-1}, o_{j-1}) at position kv_len + j - 2
                if active < len(info):
                    info.keep_first(active)  # (the deepest requests come first)
                p = base[:active] + (j - 2)
                slots = temp[used : used + active]
                used += active
                self.rt[c_rows[:active], p] = slots
                fb = ForwardBatch(
                    mode=ForwardMode.DECODE, input_ids=toks[-1][:active], positions=p,
                    out_cache_loc=slots, req_pool_indices=c_rows[:active], seq_lens=p + 1,
                    logits_indices=torch.arange(active, device=dev),
                    seq_lens_cpu=[r.kv_len + j - 1 for r in creqs[:active]])
                forwards += 1
                if self.graphs is not None and self.graphs.can_run(fb):
                    # (a copy: sampling edits logits in place and q may be a view of them,
                    # while the graph's buffer is rewritten at the next depth)
                    logits, out = self.graphs.run(fb, out[:active])
                    logits = logits.clone()
                else:
                    normed, out = self._forward(fb, out[:active])
                    logits = self.head.to_target(self.head.logits(normed), V)
            else:
                logits = first  # (active, V)
            self._sample_step(logits, grammar, info, creqs, active, sched, toks, qs)
        self.stats["spec_draft_forwards"] += forwards
        return self._collect(reqs, chain, chain_k, toks, qs, grammar), forwards

    # --- the aftermath --------------------------------------------------------------------------
    def settle(self, reqs: list[Req], accepted: list[int]) -> None:
        """Nothing: the chain's K/V went with its slots; after_verify brought the kept rows."""

    def on_finish(self, req: Req) -> None:
        req.spec_draft = None

    def on_retract(self, req: Req) -> None:
        req.spec_draft = None

    def check_integrity(self, sched) -> None:
        """The head holds no slots of its own (the target's accounting covers the chain's)."""
        for req in sched.running:
            st: Optional[Eagle3State] = req.spec_draft
            assert st is None or st.start + st.n <= req.kv_len, "head rows past the request"
