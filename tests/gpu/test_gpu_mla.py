"""On a CUDA GPU: DeepSeek (MLA + MoE) decode in CUDA graphs.
- tiny V2-Lite-shaped and V3-shaped random checkpoints (tests/unit/test_model_parity_deepseek's
  CASES), fp32 and bf16: greedy tokens with CUDA graphs on == graphs off == HF transformers (HF
  in the same dtype on the same GPU), and the graphs were replayed;
- the Triton MLA decode kernel compiled (rank 512 + rope 64, 16 and 128 heads, every split
  count, bf16 and fp32) against a torch reference, and captured in a CUDA graph and replayed
  on new lengths;
- the Triton grouped experts (layers/triton_moe.py) at V2-Lite's expert shapes (64 experts,
  top-6, hidden 2048, intermediate 1408) against per-expert torch GEMMs, and captured in a
  graph and replayed on a new routing; greedy tokens with them on == off.
Run: `pytest -q -m gpu tests/gpu/test_gpu_mla.py` (about 2 minutes on an H100)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "unit"))
import arch_parity as ap  # noqa: E402
from test_model_parity_deepseek import CASES, MAX_NEW, prompts  # noqa: E402

pytestmark = pytest.mark.gpu
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@pytest.fixture(autouse=True)
def _compiled():
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("TRITON_INTERPRET=1: these tests are for the compiled kernels")


@pytest.fixture(scope="module", params=["v2-lite", "v3"])
def checkpoint(request, tmp_path_factory):
    cls, config = CASES[request.param]
    path = tmp_path_factory.mktemp(request.param)
    ap.save_tiny(cls, config(), path)
    return str(path), cls


def hf_greedy_cuda(cls, path, ids_list, dtype):
    """HF's tokens on the GPU. Loaded with from_pretrained in `dtype`, which keeps the router's
    weight (and V3's score-correction bias) in fp32 as radixlm does (`.to(bf16)` would not)."""
    model = cls.from_pretrained(path, dtype=dtype, attn_implementation="eager").to("cuda").eval()
    outs = []
    for ids in ids_list:
        x = torch.tensor([ids], device="cuda")
        with torch.no_grad():
            y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=MAX_NEW,
                               min_new_tokens=0, do_sample=False, eos_token_id=None,
                               pad_token_id=0)
        outs.append(y[0, len(ids):].tolist())
    del model
    torch.cuda.empty_cache()
    return outs


def _tokens(path, dtype, graphs: bool, ids):
    eng = ap.make_engine(path, device="cuda", dtype=dtype, attention_backend="auto",
                         disable_cuda_graph=not graphs, cuda_graph_max_bs=16)
    try:
        runner = eng.runner
        assert runner.attention_backend_name == "mla_triton"
        assert (runner.graph_runner is not None) == graphs
        outs = ap.generate(eng, ids, MAX_NEW)  # 5 prompts: bucket 8
        one = ap.generate(eng, ids[2:3], MAX_NEW)  # bucket 1, prompt from the cache
        if graphs:
            assert runner.graph_runner.replays >= 2 * (MAX_NEW - 1)
        eng.wait_idle()
        eng.check_integrity()
        return [o["output_ids"] for o in outs], one[0]["output_ids"]
    finally:
        eng.shutdown()


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_graphs_on_equal_off_equal_hf(checkpoint, dtype):
    path, cls = checkpoint
    ids = prompts()
    ref = hf_greedy_cuda(cls, path, ids, DTYPES[dtype])
    off, off_one = _tokens(path, dtype, False, ids)
    on, on_one = _tokens(path, dtype, True, ids)
    assert on == off, "CUDA graphs changed greedy tokens"
    assert on_one == off_one == on[2]
    if dtype == "float32":
        assert on == ref, "radixlm != HF transformers"
    else:  # bf16: other kernels round differently; a near-tie may flip a late token (H200: the
        # V3 shape's request 1 at token 8 of 8), so each request's first half must agree
        half = MAX_NEW // 2
        assert [o[:half] for o in on] == [r[:half] for r in ref], "radixlm != HF transformers"


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_triton_experts_on_equal_off(checkpoint, graphs, monkeypatch):
    """RADIXLM_DISABLE_TRITON_MOE's path (per-expert cuBLAS loop eagerly, every expert on every
    token inside a capture) gives the Triton grouped experts' greedy tokens (fp32)."""
    from radixlm.runtime.layers import triton_moe

    path, _ = checkpoint
    ids = prompts()
    on = _tokens(path, "float32", graphs, ids)
    monkeypatch.setattr(triton_moe, "ENABLED", False)
    assert _tokens(path, "float32", graphs, ids) == on


def _kernel_case(lens, h, dtype, seed=0):
    r, dr = 512, 64
    g = torch.Generator(device="cuda").manual_seed(seed)
    cap = sum(lens) + 4
    buf = torch.randn(cap + 1, r + dr, generator=g, device="cuda").to(dtype)
    rt = torch.zeros(2 * len(lens) + 2, max(lens) + 8, dtype=torch.int64, device="cuda")
    perm = torch.randperm(cap, generator=g, device="cuda") + 1
    at = 0
    for i, n in enumerate(lens):
        rt[2 * i + 1, :n] = perm[at:at + n]
        at += n
    q = torch.randn(len(lens), h, r + dr, generator=g, device="cuda").to(dtype)
    idx = torch.arange(1, 2 * len(lens), 2, device="cuda")
    return q, buf, rt, idx, torch.tensor(lens, device="cuda")


def _reference(q, buf, rt, idx, seq_lens, scale):
    out = []
    for i, (row, n) in enumerate(zip(idx.tolist(), seq_lens.tolist())):
        lat = buf[rt[row, :n]].float()
        out.append((q[i].float() @ lat.T * scale).softmax(-1) @ lat[:, :512])
    return torch.stack(out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("h", [16, 128])
def test_kernel_matches_reference_every_split(dtype, h):
    from radixlm.runtime.attention import triton_mla_decode as k

    q, buf, rt, idx, seq_lens = _kernel_case([1, 17, 300, 2049, 64], h, dtype)
    ref = _reference(q, buf, rt, idx, seq_lens, 0.05)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    for splits in (1, 2, 4, 8, 16):
        out = k.decode(q, buf, rt, idx, seq_lens, 512, 0.05, splits=splits)
        torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol, msg=f"splits {splits}")
    auto = k.decode(q, buf, rt, idx, seq_lens, 512, 0.05)  # the split count serving picks
    torch.testing.assert_close(auto.float(), ref, atol=tol, rtol=tol)


def test_kernel_in_a_cuda_graph_replays_new_lengths():
    from radixlm.runtime.attention import triton_mla_decode as k

    q, buf, rt, idx, seq_lens = _kernel_case([40, 900, 3], 128, torch.bfloat16)
    splits = k.num_splits(3, 128, torch.device("cuda"))
    scratch = torch.empty(k.scratch_numel(3, 128, 512, splits), device="cuda")
    out = torch.empty(3, 128, 512, dtype=torch.bfloat16, device="cuda")
    k.decode(q, buf, rt, idx, seq_lens, 512, 0.05, out=out, scratch=scratch, splits=splits)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        k.decode(q, buf, rt, idx, seq_lens, 512, 0.05, out=out, scratch=scratch, splits=splits)
    seq_lens.copy_(torch.tensor([7, 512, 3], device="cuda"))
    q.normal_()
    graph.replay()
    ref = _reference(q, buf, rt, idx, seq_lens, 0.05)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


def _moe_case(t, dtype, n_exp=64, k=6, hid=2048, inter=1408, seed=0):
    """DeepSeek-V2-Lite's routed-expert shapes; idx ascending per token, fp32 weights."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    gu = (torch.randn(n_exp, 2 * inter, hid, generator=g, device="cuda") * 0.02).to(dtype)
    dn = (torch.randn(n_exp, hid, inter, generator=g, device="cuda") * 0.02).to(dtype)
    x = torch.randn(t, hid, generator=g, device="cuda").to(dtype)
    w, idx = torch.rand(t, n_exp, generator=g, device="cuda").topk(k, dim=-1)
    idx, perm = idx.sort(dim=-1)
    return x, gu, dn, idx, w.gather(1, perm)


def _moe_reference(x, gu, dn, idx, w):
    """HF's per-expert module math (torch GEMMs in the model dtype), summed in slot order."""
    inter = gu.shape[1] // 2
    contrib = torch.zeros(idx.shape + (x.shape[1],), dtype=x.dtype, device=x.device)
    for e in idx.unique().tolist():
        tok, slot = (idx == e).nonzero(as_tuple=True)
        gate, up = torch.nn.functional.linear(x[tok], gu[e]).split(inter, dim=-1)
        y = torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, dn[e])
        contrib[tok, slot] = (y * w[tok, slot, None]).to(x.dtype)
    out = contrib[:, 0]
    for j in range(1, idx.shape[1]):
        out = out + contrib[:, j]
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("t", [1, 8, 128, 600])
def test_triton_moe_matches_per_expert_gemms(dtype, t):
    from radixlm.runtime.layers import triton_moe

    x, gu, dn, idx, w = _moe_case(t, dtype)
    got = triton_moe.experts(x, gu, dn, idx, w)
    ref = _moe_reference(x, gu, dn, idx, w)
    tol = 3e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(got, ref, atol=tol, rtol=tol)


def test_triton_moe_in_a_cuda_graph_follows_new_routing():
    from radixlm.runtime.layers import triton_moe

    x, gu, dn, idx, w = _moe_case(16, torch.bfloat16)
    triton_moe.experts(x, gu, dn, idx, w)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = triton_moe.experts(x, gu, dn, idx, w)
    x2, _, _, idx2, w2 = _moe_case(16, torch.bfloat16, seed=1)
    x.copy_(x2)
    idx.copy_(idx2)
    w.copy_(w2)
    graph.replay()
    torch.testing.assert_close(out, _moe_reference(x, gu, dn, idx, w), atol=3e-2, rtol=3e-2)
