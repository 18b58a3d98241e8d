"""Shared-prefix (cascade) decode attention: grouping from the radix tree, the merged result equal
to plain decode attention for every backend that has the ranged ops, and an engine whose decode
steps run through prefix groups giving the same greedy tokens as plain decode."""

from __future__ import annotations

import pytest
import torch

from radixlm.runtime.attention import shared_prefix
from radixlm.runtime.attention.shared_prefix import PrefixGrouper, find_prefix_groups
from radixlm.runtime.attention.torch_native import TorchNativeAttention
from radixlm.runtime.executor.forward_batch import ForwardBatch, ForwardMode
from radixlm.runtime.mem_cache.kv_pool import KVPool
from radixlm.runtime.mem_cache.radix_cache import TreeNode

SCALE = 0.125


class FakeReq:
    def __init__(self, rid, row, node, depth, kv_len):
        self.rid, self.req_pool_idx, self.last_node, self.kv_len = rid, row, node, kv_len
        self.prefix_indices = torch.zeros(depth, dtype=torch.int64)


def chain(parent, n):
    node = TreeNode(tuple(range(n)), None, parent)
    parent.children[len(parent.children)] = node
    return node


def test_grouping_picks_deepest_node_shared_by_two_or_more():
    root = TreeNode()
    system = chain(root, 300)  # depth 300: shared by all
    fewshot = chain(system, 200)  # depth 500: shared by requests 0-2
    leaves = [chain(fewshot, 10) for _ in range(3)] + [chain(system, 40) for _ in range(2)]
    depths = [510, 510, 510, 340, 340]
    lonely = chain(chain(root, 50), 500)  # shares nothing with anyone
    reqs = [FakeReq(f"r{i}", 10 + i, leaf, d, d + 20) for i, (leaf, d) in
            enumerate(zip(leaves, depths))] + [FakeReq("x", 20, lonely, 550, 560)]
    g = find_prefix_groups(reqs, torch.device("cpu"), min_shared=128)
    assert g.shared_lens_cpu == [500, 300] and g.group_sizes_cpu == [3, 2]
    assert g.rows.tolist() == [0, 1, 2, 3, 4] and g.qo_indptr.tolist() == [0, 3, 5]
    assert g.rep_pool_indices.tolist() == [10, 13]
    assert g.kv_start.tolist() == [500, 500, 500, 300, 300, 0]
    assert g.saved_tokens == 2 * 500 + 300
    # a short shared prefix is not worth a group
    assert find_prefix_groups(reqs[3:], torch.device("cpu"), min_shared=400) is None


def test_grouper_keeps_plan_while_batch_unchanged_and_applies_threshold():
    root = TreeNode()
    shared = chain(root, 1000)
    reqs = [FakeReq(f"r{i}", i, chain(shared, 5), 1005, 1010) for i in range(4)]
    grouper = PrefixGrouper(torch.device("cpu"))
    plan = grouper.plan(reqs)
    assert plan is not None and plan.saved_tokens == 3000
    assert grouper.plan(reqs) is plan  # same batch: no replanning
    assert grouper.plan(reqs[:3]) is not plan
    # requests that have grown far past the prefix: the saving falls under the threshold
    for r in reqs:
        r.kv_len = 20000
    assert grouper.plan(reqs) is None


def make_batch(dtype, gen, group_sizes=(3, 1, 4), shared=(70, 0, 150), own=(5, 40, 1, 9, 17)):
    """A decode batch whose requests share prefixes slot for slot (as the radix tree makes them).
    Returns (pool, req_to_token, fb, qkv, groups)."""
    hq, hkv, d = 9, 3, 64
    own = list(own) + [7] * 10
    lens, prefixes, rows = [], [], []
    r2t = torch.zeros(2 * sum(group_sizes) + 2, 512, dtype=torch.int64)
    next_slot, i = 1, 0
    reqs_meta = []  # (row, shared len of its group or 0)
    for size, sh in zip(group_sizes, shared):
        prefix = torch.arange(next_slot, next_slot + sh)
        next_slot += sh
        for _ in range(size):
            n = sh + own[i]
            row = 2 * i + 1
            r2t[row, :sh] = prefix
            r2t[row, sh:n] = torch.arange(next_slot, next_slot + own[i])
            next_slot += own[i]
            lens.append(n)
            rows.append(row)
            reqs_meta.append((row, sh if size > 1 else 0))
            i += 1
    pool = KVPool(next_slot, 1, hkv, d, dtype, "cpu")
    pool.k_buffers[0] = torch.randn(next_slot + 1, hkv, d, generator=gen).to(dtype)
    pool.v_buffers[0] = torch.randn(next_slot + 1, hkv, d, generator=gen).to(dtype)
    b = len(lens)
    loc = torch.tensor([r2t[rows[j], lens[j] - 1] for j in range(b)])
    qkv = [torch.randn(b, h, d, generator=gen).to(dtype) for h in (hq, hkv, hkv)]
    fb = ForwardBatch(mode=ForwardMode.DECODE, input_ids=torch.zeros(b, dtype=torch.int64),
                      positions=torch.tensor(lens) - 1, out_cache_loc=loc,
                      req_pool_indices=torch.tensor(rows), seq_lens=torch.tensor(lens),
                      logits_indices=torch.arange(b), seq_lens_cpu=list(lens))
    # groups as find_prefix_groups would build them (rows of groups with >1 member)
    grows, indptr, reps, glens, sizes, kv_start = [], [0], [], [], [], []
    j = 0
    for size, sh in zip(group_sizes, shared):
        if size > 1:
            grows += list(range(j, j + size))
            indptr.append(len(grows))
            reps.append(rows[j])
            glens.append(sh)
            sizes.append(size)
        kv_start += [sh if size > 1 else 0] * size
        j += size
    t = torch.tensor
    groups = shared_prefix.PrefixGroups(
        rows=t(grows), qo_indptr=t(indptr), rep_pool_indices=t(reps), shared_lens=t(glens),
        zeros=torch.zeros(len(reps), dtype=torch.int64), kv_start=t(kv_start),
        max_group=max(sizes), shared_lens_cpu=glens, group_sizes_cpu=sizes, saved_tokens=0)
    return pool, r2t, fb, qkv, groups


def cascade_vs_plain(backend_cls, dtype, **kw):
    gen = torch.Generator().manual_seed(0)
    pool, r2t, fb, qkv, groups = make_batch(dtype, gen)
    ref_backend = TorchNativeAttention(pool, r2t, SCALE)
    ref_backend.init_forward_metadata(fb)
    ref = ref_backend.forward(*qkv, 0, fb)  # plain decode over every key
    backend = backend_cls(pool, r2t, SCALE, max_batch_size=16, max_context_len=512, **kw)
    fb.prefix_groups = groups
    backend.init_forward_metadata(fb)
    out = backend.forward(*qkv, 0, fb)
    return out, ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_torch_reference_cascade_equals_plain_decode(dtype):
    out, ref = cascade_vs_plain(TorchNativeAttention, dtype)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


def test_merge_states_with_an_empty_side():
    o = torch.randn(2, 3, 4)
    lse = torch.randn(2, 3)
    empty_lse = torch.full((2, 3), float("-inf"))
    torch.testing.assert_close(shared_prefix.merge_states(o, lse, torch.zeros_like(o), empty_lse), o)


def test_engine_greedy_identical_with_prefix_groups(make_engine, tiny_chat_path, integrity):
    """Requests sharing a long cached prefix decode through prefix groups (the reference ranged
    ops of torch_native, forced on) with the same greedy tokens as plain decode. The grouping is
    the scheduler's and the attention's, not the model's: the tiny random chat model serves."""
    system = "You are a careful assistant. " * 40  # ~250 tokens shared by every request
    prompts = [system + f"Question {i}: name a colour and a number." for i in range(6)]
    params = {"temperature": 0, "max_new_tokens": 24}
    # torch_native plans no groups by itself: `plain` runs plain decode attention
    plain = make_engine(attention_backend="torch_native", model_path=tiny_chat_path)
    assert plain.scheduler.prefix_grouper is None
    want = [o["output_ids"] for o in plain.generate(prompts, params)]
    grouped = make_engine(attention_backend="torch_native", model_path=tiny_chat_path)
    sched = grouped.scheduler
    sched.prefix_grouper = PrefixGrouper(sched.device, min_shared=64, min_saved_fraction=0.0)
    grouped.generate(prompts[0], {"max_new_tokens": 1})  # the prefix is cached first
    got = [o["output_ids"] for o in grouped.generate(prompts, params)]
    assert got == want
    assert sched.stats["shared_prefix_steps"] > 0
    integrity(plain)
    integrity(grouped)
