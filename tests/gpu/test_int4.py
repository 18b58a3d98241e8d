"""Int4 weight-only layers on CUDA (layers/int4_linear.py, layers/triton_int4.py,
models/int4_checkpoint.py): the Triton GEMV / GEMM against the dequantized fp64 reference, the
layer (act-order, bias) eager and inside a CUDA graph, and tiny int4 Llama checkpoints (AWQ, GPTQ,
compressed-tensors, tests/unit/int4_ckpt.py) through the Engine against the same model with the
dequantized weights as a plain bf16 checkpoint, decode in CUDA graphs and eager; plus a hook
running benchmarks/int4_decode.py's tiny configuration. The check_* functions also run under
Triton's interpreter on the CPU (tests/unit/test_triton_int4.py).
Run with `pytest -m gpu tests/gpu/test_int4.py` (~1 min).

Tolerance (stated once, used by every check): |y - ref| <= EPS_OUT[dtype] * |ref| +
SUM_TOL * (|x| @ |W|^T), per element: the output's rounding plus fp32 summation-order error
(K <= 16384 terms). `ref` is x @ W^T in fp64 with W the dequantized weight, rounded to x's dtype
for M > 1 (the GEMM multiplies exactly that weight) and not rounded for M == 1 (the GEMV sums
(q - z) * x in fp32 and scales per group)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "unit"))

pytestmark = pytest.mark.gpu

EPS_OUT = {torch.float32: 0.0, torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7}
SUM_TOL = 2e-5
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def random_layer(n: int, k: int, group: int, seed: int = 0):
    """(qweight (N, K/8) int32, scales (N, G) fp16, zeros (N, G) uint8, W (N, K) fp32): random
    codes, zeros over the whole 0..16 range, and the dequantized weight."""
    from radixlm.runtime.layers import int4_linear

    g = torch.Generator().manual_seed(seed)
    ng = k // group
    q = torch.randint(0, 16, (n, k), generator=g)
    z = torch.randint(0, 17, (n, ng), generator=g)
    s = (torch.rand(n, ng, generator=g) * 0.02 + 1e-3).half()
    grp = torch.arange(k) // group
    w = (q - z[:, grp]).float() * s.float()[:, grp]
    return int4_linear.pack_rows(q), s, z.to(torch.uint8), w


def _check_close(y, x, w, bias, dtype, what, exact_w=None) -> None:
    # exact_w: the reference's W unrounded (the GEMV's sums); None: so for one row only (the
    # GEMM multiplies W rounded to x's dtype)
    exact = x.shape[0] == 1 if exact_w is None else exact_w
    wr = w if exact else w.to(dtype).float()
    ref = x.double() @ wr.double().t()
    if bias is not None:
        ref += bias.double()
    bound = EPS_OUT[dtype] * ref.abs() + SUM_TOL * (x.double().abs() @ wr.double().abs().t())
    err = (y.double().cpu() - ref).abs()
    assert bool((err <= bound).all()), (what, float((err - bound).max()))


def check_int4_kernels(device, shapes, dtypes=(torch.bfloat16, torch.float16),
                       gemv_configs=(None,), gemm_configs=(None,)) -> None:
    """triton_int4.gemv (M == 1) and gemm (M > 1) against the reference at shapes (N, K,
    group, M), every second shape with a bias."""
    from radixlm.runtime.layers import triton_int4, triton_int4_gemm

    for i, (n, k, group, m) in enumerate(shapes):
        qw, s, z, w = random_layer(n, k, group, seed=n + k + m)
        qw, s, z = qw.to(device), s.to(device), z.to(device)
        for dt in dtypes:
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dt)
            b = torch.randn(n).to(dt) if i % 2 else None
            for cfg in (gemv_configs if m == 1 else gemm_configs):
                fn = triton_int4.gemv if m == 1 else triton_int4_gemm.gemm
                y = fn(x.to(device), qw, s, z, group, None if b is None else b.to(device),
                       config=cfg)
                assert y.shape == (m, n) and y.dtype == dt
                _check_close(y, x.float(), w, b, dt, (n, k, group, m, dt, cfg))


def check_int4_layer(device, dtype, ms=(1, 5)) -> None:
    """Int4Linear with act-order (a permuted g_idx) and a bias against x @ W^T + b."""
    import int4_ckpt as ic

    from radixlm.runtime.layers import int4_linear
    from radixlm.runtime.models import int4_config, int4_formats

    c = ic.CASES["gptq-v1-asym-act-g64"]
    k, n = 256, 48
    g_idx = ic.act_g_idx(k, 64, seed=5)
    wd = torch.randn(n, k) * 0.05
    q, z, s = ic.quantize(wd, c, g_idx, torch.float16)
    t = ic.pack(c, q, z, s, g_idx, torch.float16)
    scheme = int4_config.Int4Scheme("gptq", 64, sym=False, g_idx=True, zero_offset=1)
    piece = int4_formats.read(scheme, "l", lambda sfx: t.get(sfx))
    lin = int4_linear.Int4Linear.from_weights([piece], True, dtype, device)
    lin.bias.data.copy_(torch.randn(n).to(dtype))
    w = piece.dequantize(torch.float32)
    for m in ms:
        x = torch.randn(m, k).to(dtype)
        _check_close(lin(x.to(device)), x.float(), w, lin.bias.cpu(), dtype, ("layer", m, dtype))


def check_int4_gate_up_silu(device, shapes, dtypes=(torch.bfloat16, torch.float16),
                            act_order=False) -> None:
    """The int4 GEMV with the SiLU-and-mul epilogue (Int4Linear.gate_up_silu, shapes (2I, K,
    group)) against the plain int4 GEMV then SiLU-and-mul with the same roundings (layers/
    triton_ops' silu_and_mul): equal up to an output ulp or two (the same per-row sums)."""
    from radixlm.runtime.layers import int4_linear

    for n2, k, group in shapes:
        qw, s, z, _ = random_layer(n2, k, group, seed=n2 + k)
        for dtype in dtypes:
            lin = int4_linear.Int4Linear(k, n2, group, False, dtype, device, act_order=act_order)
            lin.qweight.copy_(qw), lin.scales.copy_(s), lin.zeros.copy_(z)
            if act_order:
                lin.perm.copy_(torch.randperm(k, generator=torch.Generator().manual_seed(k)))
            x = torch.randn(1, k, generator=torch.Generator().manual_seed(2)).to(device, dtype)
            y = lin.gate_up_silu(x)
            gu = lin(x).float()
            g, u = gu[:, : n2 // 2], gu[:, n2 // 2:]
            ref = ((g / (1 + torch.exp(-g))).to(dtype).float() * u).to(dtype)
            assert y.shape == (1, n2 // 2) and y.dtype == dtype
            ulp = 2 ** -7 if dtype == torch.bfloat16 else 2 ** -10
            torch.testing.assert_close(y.float(), ref.float(), atol=1e-3, rtol=2 * ulp)
            assert lin.gate_up_silu(x.repeat(2, 1)) is None  # batch > 1: the unfused ops


def test_int4_gate_up_silu_cuda():
    check_int4_gate_up_silu("cuda", [(28672, 4096, 128), (2 * 1000, 512, 64)])
    check_int4_gate_up_silu("cuda", [(2 * 96, 256, 32)], act_order=True)


def check_int4_torch(device, shapes=((64, 256, 32, 1), (48, 512, 128, 7), (32, 128, 64, 64))):
    """use_torch_kernels (torch's _weight_int4pack_mm after layers/int4_torch's repack) against
    the reference. Its own tolerance: it rounds the scale and the zero term (8 - z) * s to bf16
    and x to bf16, so per weight |dW| <= 2^-8 * (|q - 8| + |8 - z|) * s <= 2^-4 * s, plus bf16
    rounding of x and of the output: |y - ref| <= 2^-7 |ref| + 2^-4 (|x| @ S^T) +
    2^-8 (|x| @ |W|^T), S the per-weight scale. A layout error (a wrong nibble order or zero
    mapping) moves whole rows by far more."""
    from radixlm.runtime.layers import int4_linear

    for (n, k, group, m) in shapes:
        qw, s, z, w = random_layer(n, k, group, seed=n + m)
        lin = int4_linear.Int4Linear(k, n, group, True, torch.bfloat16, device)
        lin.qweight.copy_(qw), lin.scales.copy_(s), lin.zeros.copy_(z)
        lin.bias.data.copy_(torch.randn(n).to(torch.bfloat16))
        assert lin.use_torch_kernels()
        x = torch.randn(m, k).to(torch.bfloat16)
        y = lin(x.to(device)).double().cpu()
        ref = x.double() @ w.double().t() + lin.bias.double().cpu()
        sfull = s.double()[:, torch.arange(k) // group]
        bound = (2.0 ** -7 * ref.abs() + 2.0 ** -4 * (x.double().abs() @ sfull.t())
                 + 2.0 ** -8 * (x.double().abs() @ w.double().abs().t()))
        assert bool(((y - ref).abs() <= bound).all()), (n, k, group, m)
        # and clearly better than the bound: the mean error a few bf16 steps
        assert float((y - ref).abs().mean()) < 0.1 * float(bound.mean()), (n, k, group, m)


def test_int4_torch_kernel_cuda():
    check_int4_torch("cuda", ((6144, 4096, 128, 1), (4096, 14336, 128, 64), (512, 1024, 32, 3)))


def test_int4_kernels_cuda():
    shapes = [(6144, 4096, 128, 1), (4096, 14336, 128, 1), (4096, 4096, 32, 1),
              (1000, 512, 64, 1), (6144, 4096, 128, 64), (4096, 14336, 128, 7),
              (1000, 512, 64, 300), (512, 96 * 32, 96 * 32, 1), (512, 96 * 32, 96 * 32, 33)]
    check_int4_kernels("cuda", shapes, gemv_configs=(None, (4, 128, 4, 2), (16, 512, 8, 4),
                                                      (32, 2048, 8, 2), (8, 2048, 2, 3, 1),
                                                      (4, 1024, 1, 4, 1),
                                                      # split-K: one-shot and pipelined
                                                      (2, 1024, 1, 1, 0, 4),
                                                      (4, 2048, 2, 2, 1, 2),
                                                      (8, 2048, 2, 1, 0, 7)),
                       gemm_configs=(None, (64, 64, 128, 4, 4), (64, 256, 128, 8, 3, 2),
                                     (32, 128, 64, 4, 2), (16, 64, 32, 4, 3, 3)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_int4_linear_cuda(dtype):
    check_int4_layer("cuda", dtype, ms=(1, 3, 64))


def test_int4_linear_in_cuda_graph():
    """The layer captures: no allocation outside torch's graph pool, no host sync."""
    from radixlm.runtime.layers import int4_linear

    lin = int4_linear.Int4Linear.quantize(torch.randn(512, 1024, device="cuda") * 0.05, 128)
    for m in (1, 16):
        check_graph_replay(lin, torch.randn(m, 1024, device="cuda", dtype=torch.bfloat16))


def check_graph_replay(lin, x) -> None:
    """lin(x) captured in a CUDA graph (compiled outside it) replays on new x exactly."""
    lin(x)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = lin(x)
    x.copy_(torch.randn_like(x))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, lin(x))


def test_int4_gemv_split_k_in_cuda_graph():
    """Split-K GEMVs (and the SiLU epilogue) captured 3 times a graph, replayed 5 times: each
    replay gives the eager bits (the counters reset by every call's last split, the partials'
    sum in split order whichever program arrives last)."""
    from radixlm.runtime.layers import triton_int4

    qw, s, z, _ = random_layer(4096, 4096, 128, seed=1)
    qw, s, z = qw.cuda(), s.cuda(), z.cuda()
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    for cfg, silu in (((2, 1024, 1, 1, 0, 4), False), ((4, 1024, 1, 4, 1, 2), True)):
        want = triton_int4.gemv(x, qw, s, z, 128, config=cfg, silu=silu)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            ys = [triton_int4.gemv(x, qw, s, z, 128, config=cfg, silu=silu) for _ in range(3)]
        for _ in range(5):
            g.replay()
            torch.cuda.synchronize()
            assert all(torch.equal(y, want) for y in ys), cfg
    assert int(triton_int4._COUNTERS[x.device].abs().sum()) == 0


ENGINE_CASES = ("awq-g128", "gptq-v1-asym-act-g64", "gptq-v2-sym-act-g128", "ct-asym-g32")


@pytest.mark.parametrize("graphs", [True, False])
@pytest.mark.parametrize("name", ENGINE_CASES)
def test_int4_checkpoint_cuda(name, graphs, tmp_path):
    """The engine on CUDA with an int4 checkpoint (kept int4, Triton kernels) gives the greedy
    tokens of the dequantized bf16 model: every prompt but one at most (the GEMV sums in fp32
    the weights the bf16 model rounds, which can flip a near-tie)."""
    import arch_parity as ap
    import int4_ckpt as ic

    from radixlm.runtime.layers import int4_linear

    model = ic.tiny_llama(hidden_size=256, intermediate_size=512, head_dim=64)
    ic.write_int4(model, str(tmp_path / "q"), ic.CASES[name], plain_path=str(tmp_path / "p"))
    prompts = ap.prompts(model[0]["vocab_size"])
    kw = dict(device="cuda", dtype="bfloat16", disable_cuda_graph=not graphs)
    ref = _ref_tokens(str(tmp_path / "p"), prompts, **kw)
    eng = ap.make_engine(str(tmp_path / "q"), **kw)
    try:
        assert eng.runner.int4.mode == "triton"
        assert len([m for m in eng.runner.model.modules()
                    if isinstance(m, int4_linear.Int4Linear)]) == 8
        outs = [o["output_ids"] for o in ap.generate(eng, prompts)]
        same = sum(o == r for o, r in zip(outs, ref))
        # act-order sums x[perm[c]] in the permuted column order: more rounding difference from
        # the dense bf16 model (H200, a321ee4: 7 of 9 prompts for the asym act-order g64 case)
        slack = 2 if "act" in name else 1
        assert same >= len(prompts) - slack, (same, len(prompts))
        eng.wait_idle()
        eng.check_integrity()
    finally:
        eng.shutdown()


def _ref_tokens(path: str, prompts, **kw) -> list[list[int]]:
    import arch_parity as ap

    eng = ap.make_engine(path, **kw)
    try:
        out = [o["output_ids"] for o in ap.generate(eng, prompts)]
        eng.wait_idle()
        eng.check_integrity()
        return out
    finally:
        eng.shutdown()


def test_int4_checkpoint_cuda_torch_kernels(tmp_path):
    """int4_linear=torch (torch's _weight_int4pack_mm, bf16 scales): most greedy sequences equal
    the dequantized bf16 model's (not all: its scales and zeros are rounded to bf16)."""
    import arch_parity as ap
    import int4_ckpt as ic

    model = ic.tiny_llama(hidden_size=256, intermediate_size=512, head_dim=64)
    ic.write_int4(model, str(tmp_path / "q"), ic.CASES["awq-g128"], plain_path=str(tmp_path / "p"))
    prompts = ap.prompts(model[0]["vocab_size"])
    ref = _ref_tokens(str(tmp_path / "p"), prompts, device="cuda", dtype="bfloat16")
    eng = ap.make_engine(str(tmp_path / "q"), device="cuda", dtype="bfloat16",
                         int4_linear="torch")
    try:
        mods = [m for m in eng.runner.model.modules() if hasattr(m, "torch_packed")]
        assert len(mods) == 8 and all(m.torch_packed is not None for m in mods)
        outs = [o["output_ids"] for o in ap.generate(eng, prompts)]
        assert sum(o == r for o, r in zip(outs, ref)) >= len(prompts) - 2
        eng.wait_idle()
        eng.check_integrity()
    finally:
        eng.shutdown()


def test_int4_decode_benchmark_hook():
    """benchmarks/int4_decode.py end to end at its tiny size: one JSON line per arm."""
    p = subprocess.run([sys.executable, "benchmarks/int4_decode.py", "--tiny"], cwd=_ROOT,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    rows = [json.loads(ln) for ln in p.stdout.splitlines() if ln.startswith("{")]
    arms = {r.get("arm") for r in rows if r.get("bench") == "int4_decode"}
    assert arms == {"bf16", "awq-g128", "gptq-g128"}, rows
    print("\n".join(json.dumps(r) for r in rows))
