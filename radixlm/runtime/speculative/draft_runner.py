"""A draft model's runner and its KV: a second ModelRunner (weights, KV pool, req -> token table)
and, per request, the draft's KV of the request's own tokens.

No radix tree on the draft side: a request's draft KV is its own, computed by the draft itself
(what the target served from its cache the draft computes: the catch-up, standalone.py), and
freed when the request finishes, is retracted or has its output rewritten (jump-forward).

Per request (`DraftState`, kept in `Req.spec_draft`): a row of the draft's req_to_token and
`kv_len`, the slots that row holds, positions [0, kv_len) of the request's tokens. During a
step the last `chain` of them are the draft inputs d_1..d_{k-1} (positions base .. base + k - 2,
base = the request's length); `keep` drops those the verify rejected.
Accounting (`check_integrity`): free slots + sum of the live states' kv_len == capacity.

Memory: the pool holds as many tokens as the target's plus one chain per running request, so
running requests fit even when their prefixes are shared on the target side (the tree) and not
here; should they not, the drafter releases the KV of requests not drafting this step first.
"""

from __future__ import annotations

from typing import Optional

import torch

from radixlm.runtime.distributed import parallel_state
from radixlm.runtime.executor.model_runner import ModelRunner
from radixlm.runtime.request import Req
from radixlm.runtime.speculative.adaptive import Acceptance
from radixlm.runtime.speculative.draft_budget import draft_config, draft_load_format, pool_tokens


class DraftState:
    """A request's draft-model state: its draft KV row and its acceptance record."""

    __slots__ = ("row", "kv_len", "record", "match", "base", "chain")

    def __init__(self, row: int):
        self.row = row
        self.kv_len = 0
        self.record = Acceptance()
        self.match = 1  # (the adaptive policy's bucket: one bucket for model drafts)
        self.base: Optional[int] = None  # this step: the request's length when it drafted
        self.chain = 0  # this step: draft inputs held past base


def build_draft_runner(args, target: ModelRunner, per_request: int,
                       spare_rows: int = 0) -> ModelRunner:
    """The draft model's runner. Refuses a draft whose vocabulary differs from the target's (its
    token ids would mean other text). Its pool: the target's tokens plus `per_request` draft
    inputs per running request (see the module docstring); `spare_rows` scratch rows of its
    req_to_token for a draft tree's beams."""
    path = args.speculative_draft_model_path
    cfg = draft_config(args)
    if cfg.vocab_size != target.model_config.vocab_size:
        raise ValueError(f"speculative_draft_model_path: the draft model's vocabulary "
                         f"({cfg.vocab_size} tokens) differs from the target's "
                         f"({target.model_config.vocab_size}); a draft must share the target's "
                         "tokenizer")
    capacity = pool_tokens(target.capacity, args, per_request)
    # under tensor parallelism too the draft is whole and runs on rank 0 alone, the scheduler's
    # rank: its forwards are not sent to the other ranks, which only run the target's batches
    # (the verify's among them). Every rank's budget set the draft's share aside
    # (ModelRunner._draft_share), so the target's pools still hold the same slots.
    draft_args = args.replace(model_path=path, load_format=draft_load_format(args),
                              tokenizer_path=None, tp_size=1, nnodes=1, node_rank=0,
                              max_total_tokens=capacity, context_length=target.context_len,
                              speculative_algorithm=None, speculative_draft_model_path=None,
                              speculative_num_steps=None, speculative_num_draft_tokens=None,
                              speculative_eagle_topk=None)
    return ModelRunner(draft_args, tp=parallel_state.SINGLE, spare_rows=spare_rows)


class DraftKV:
    """The draft's per-request KV over the draft runner's pool (see the module docstring)."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.allocator = runner.allocator
        self.req_pool = runner.req_to_token_pool
        self.rt = self.req_pool.req_to_token  # (rows + 1, context + 1) int64
        self.live: dict[int, Req] = {}  # id(req) -> req, the requests holding a DraftState

    def state(self, req: Req) -> DraftState:
        st = req.spec_draft
        if st is None:
            row = self.req_pool.alloc()
            assert row is not None, "one draft row per running request"
            st = req.spec_draft = DraftState(row)
            self.live[id(req)] = req
        return st

    def free_size(self) -> int:
        return self.allocator.available_size()

    def release(self, req: Req) -> None:
        """Free all of the request's draft KV and its row."""
        st = req.spec_draft
        if st is None:
            return
        if st.kv_len:
            self.allocator.free(self.rt[st.row, : st.kv_len].clone())
        self.req_pool.free(st.row)
        req.spec_draft = None
        self.live.pop(id(req), None)

    def keep(self, states: list[DraftState], lengths: list[int]) -> None:
        """Shrink each state to its first lengths[i] positions (one free for all)."""
        rows, cols = [], []
        for st, n in zip(states, lengths):
            if n < st.kv_len:
                rows += [st.row] * (st.kv_len - n)
                cols += range(n, st.kv_len)
                st.kv_len = n
        if rows:
            dev = self.rt.device
            self.allocator.free(self.rt[torch.tensor(rows, device=dev),
                                        torch.tensor(cols, device=dev)])

    def check_integrity(self, running: list[Req]) -> None:
        held = sum(r.spec_draft.kv_len for r in self.live.values())
        free, cap = self.allocator.available_size(), self.allocator.capacity
        assert free + held == cap, (
            f"draft KV leak: free {free} + held by requests {held} != capacity {cap}")
        ids = {id(r) for r in running}
        assert all(i in ids for i in self.live), "draft KV held by a request that is not running"
        assert self.req_pool.available_size() == self.req_pool.max_reqs - len(self.live), (
            "draft req_to_token rows leaked")
