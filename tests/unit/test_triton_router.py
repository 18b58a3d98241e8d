"""DeepSeek's expert choice kernel (layers/triton_router.py) under Triton's interpreter against
the router's torch path (models/deepseek_moe.Router): V2's greedy and group-limited choices, V3's
bias-corrected grouped sigmoid with normalized weights; ids come out ascending, weights with them."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from triton_interpreter import import_interpreted  # tests/unit is on sys.path

(tr,) = import_interpreted("radixlm.runtime.layers.triton_router",
                           gpu_tests="tests/gpu/test_gpu_mla.py")
from radixlm.runtime.models.deepseek_moe import Router  # noqa: E402

HID = 32


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _router(n_exp, k, method, n_group=None, topk_group=None, scaling=1.0, norm=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = Router.__new__(Router)
    nn.Module.__init__(r)
    r.n_experts, r.top_k, r.scaling, r.norm_topk = n_exp, k, scaling, norm
    r.sigmoid = method == "noaux_tc"
    r.method, r.n_group, r.topk_group = method, n_group, topk_group
    r.weight = nn.Parameter(torch.randn(n_exp, HID, generator=g))
    if r.sigmoid:
        r.register_buffer("e_score_correction_bias", torch.randn(n_exp, generator=g) * 0.1)
    return r


@pytest.mark.parametrize("n_exp,k,method,n_group,topk_group,scaling,norm", [
    (64, 6, "greedy", None, None, 1.0, False),  # V2-Lite
    (16, 4, "group_limited_greedy", 4, 2, 16.0, False),  # V2's grouped choice
    (64, 8, "noaux_tc", 8, 4, 2.5, True),  # V3
    (20, 3, "greedy", None, None, 1.0, False),  # experts padded to 32 lanes
], ids=["v2lite", "v2-groups", "v3", "20-experts"])
def test_kernel_chooses_as_torch(n_exp, k, method, n_group, topk_group, scaling, norm):
    r = _router(n_exp, k, method, n_group, topk_group, scaling, norm)
    x = torch.randn(9, HID, generator=torch.Generator().manual_seed(5))
    ref_ids, ref_w = r(x)
    r.kernel_on_cpu = True
    ids, w = r(x)
    assert ids.dtype == torch.int64 and w.dtype == torch.float32 and ids.shape == (9, k)
    assert torch.all(ids[:, 1:] > ids[:, :-1])  # ascending: HF's order of addition
    ref_ids, perm = ref_ids.sort(dim=-1)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(w, ref_w.gather(1, perm), atol=1e-6, rtol=1e-5)
    if n_group:  # the groups did change the choice somewhere (else this case tests greedy)
        logits = x @ r.weight.T
        plain = (logits.sigmoid() + r.e_score_correction_bias) if r.sigmoid else logits
        assert not torch.equal(plain.topk(k, dim=-1)[1].sort(dim=-1)[0], ids)
