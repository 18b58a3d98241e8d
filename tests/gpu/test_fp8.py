"""FP8 (e4m3) checkpoints on CUDA through torch._scaled_mm (layers/fp8_linear.py,
models/fp8_checkpoint.py): the Triton kernels, the layer against its emulation and against the
dequantized reference, the layer inside a CUDA graph, and tiny FP8 Llama checkpoints (vLLM,
transformers and compressed-tensors formats) through the Engine with decode in CUDA graphs and
eager, against HF transformers on the dequantized weights (tests/unit/fp8_ckpt.py states the
tolerance). The check_* functions also run under Triton's interpreter on the CPU
(tests/unit/test_triton_fp8.py). Run with `pytest -m gpu tests/gpu/test_fp8.py` (~1-2 min)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "unit"))

pytestmark = pytest.mark.gpu

E4M3 = torch.float8_e4m3fn


def _rows(m: int, k: int, device, dtype, seed: int = 0) -> torch.Tensor:
    """Activations with rows of very different magnitudes, one all-zero row and a few outliers."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.logspace(-3, 2, m)[:, None]
    x[m // 2] = 0.0 if m > 1 else x[0]
    x[0, : min(k, 3)] *= 50.0
    return x.to(dtype).to(device)


def check_quantize_rows(device, shapes, dtypes=(torch.bfloat16, torch.float16, torch.float32),
                        interpreted: bool = False) -> None:
    """triton_fp8.quantize_rows == fp8_linear.quantize_rows_torch, dynamic and static (with
    saturation): the scales exactly, the e4m3 values exactly. `interpreted`: Triton's interpreter
    converts fp32 -> e4m3 with quirks the GPU's cvt.rn.satfinite has not (ties away from zero, a
    rounding carry into the next power of two dropped, subnormals truncated), so there the values
    it gets wrong that way are not compared (the compiled kernel is checked by the GPU test)."""
    from radixlm.runtime.layers import fp8_linear, triton_fp8

    for (m, k) in shapes:
        for dt in dtypes:
            x = _rows(m, k, device, dt)
            for static in (None, torch.tensor([0.01], device=device)):
                q, s = triton_fp8.quantize_rows(x, static)
                rq, rs = fp8_linear.quantize_rows_torch(x.cpu(), None if static is None
                                                        else static.cpu())
                assert q.dtype == E4M3 and q.shape == (m, k) and s.shape == (m, 1)
                torch.testing.assert_close(s.cpu(), rs, rtol=0, atol=0)
                a, b = q.cpu().float(), rq.float()
                ok = a == b
                if interpreted:
                    r = (x.cpu().float() / rs).clamp(-448, 448)
                    quirk = ((b.abs() < 2.0 ** -6) | (r == (a + b) / 2)
                             | (b.abs() == 2.0 ** torch.log2(b.abs()).round()))
                    ok |= quirk
                    # still a real check: a good part of the nonzero values is compared
                    assert int((~quirk & (b != 0)).sum()) >= int((b != 0).sum()) // 3
                assert bool(ok.all()), (m, k, dt, static, int((~ok).sum()))


def check_fp8_gemv(device, shapes, out_dtypes=(torch.float16,), configs=(None,)) -> None:
    """triton_fp8.gemv == x @ (W_q * w_scale)^T (+ bias) in fp32, rounded once."""
    from radixlm.runtime.layers import fp8_linear, triton_fp8

    g = torch.Generator().manual_seed(1)
    for (n, k) in shapes:
        w = torch.randn(n, k, generator=g) * 0.05
        q, s = fp8_linear.quantize_weight(w)
        x = torch.randn(1, k, generator=g)
        bias = torch.randn(n, generator=g)
        for dt in out_dtypes:
            for cfg in configs:
                for b in (None, bias):
                    y = triton_fp8.gemv(x.to(dt).to(device), q.to(device), s.to(device),
                                        None if b is None else b.to(dt).to(device), config=cfg)
                    want = (x.to(dt).float() @ fp8_linear.dequantize(q, s, torch.float32).t()
                            + (0 if b is None else b.to(dt).float()))
                    assert y.shape == (1, n) and y.dtype == dt
                    # one rounding to dt (half an ulp: bf16's is 2^-8 relative, beyond the 2e-3
                    # this used to allow) plus fp32 summation-order differences, which scale
                    # with the largest output, not each element
                    tol = 2e-5 if dt == torch.float32 else torch.finfo(dt).eps
                    torch.testing.assert_close(y.cpu().float(), want, rtol=tol,
                                               atol=tol * float(want.abs().max()),
                                               msg=lambda m: f"{(n, k, dt, cfg, b is None)}: {m}")


# --- compiled kernels -------------------------------------------------------------------------
def test_quantize_rows_cuda():
    check_quantize_rows("cuda", [(1, 4096), (37, 96), (5, 14336), (300, 128)])


def test_fp8_gemv_cuda():
    check_fp8_gemv("cuda", [(6144, 4096), (4096, 14336), (37, 96), (5, 1030)],
                   out_dtypes=(torch.bfloat16, torch.float16, torch.float32),
                   configs=(None, (4, 256, 4, 2), (16, 1024, 8, 3)))


# --- the layer --------------------------------------------------------------------------------
def _layer(n: int, k: int, bias: bool, static, seed: int = 0):
    from radixlm.runtime.layers import fp8_linear

    torch.manual_seed(seed)
    lin = torch.nn.Linear(k, n, bias=bias).cuda().to(torch.bfloat16)
    m = fp8_linear.Fp8Linear.from_linear(lin)
    if static is not None:
        m.input_scale = torch.nn.Parameter(torch.full((n,), static, device="cuda"),
                                           requires_grad=False)
        m.input_scale_max = torch.ones(1, device="cuda")
        m.finish_loading()
    return m


@pytest.mark.parametrize("n,k,bias,static", [
    (256, 128, False, None), (256, 128, True, None), (256, 128, False, 0.02),
    (256, 128, True, 0.02), (6144, 4096, False, None), (4096, 14336, False, 0.02)])
def test_fp8_linear_cuda_matches_emulation_and_bound(n, k, bias, static):
    """_scaled_mm's output == the emulation of its inputs (x quantized by the layer's own kernel,
    W_q * w_scale, fp32 sum, bf16 out) up to bf16 rounding; and within the rigorous bound of the
    dequantized reference: |y - x W^T| <= 2^-4 |x| |W|^T (+ bf16 rounding)."""
    from radixlm.runtime.layers import fp8_linear, triton_fp8

    layer = _layer(n, k, bias, static)
    w = layer.dequantized_weight().cpu()
    for mrows in (1, 2, 16, 300):
        x = (torch.randn(mrows, k) * 2).to(torch.bfloat16).cuda()
        y = layer(x)
        assert y.dtype == torch.bfloat16 and y.shape == (mrows, n)
        xf = x.float().cpu()
        b = 0 if layer.bias is None else layer.bias.float().cpu()
        if mrows > fp8_linear.GEMV_MAX_M:  # _scaled_mm on the layer's own quantized x
            xq, sx = triton_fp8.quantize_rows(x, layer.input_scale_max)
            emu = (xq.float() * sx).cpu() @ w.t() + b
        else:  # the GEMV: unquantized x
            emu = xf @ w.t() + b
        torch.testing.assert_close(y.float().cpu(), emu, rtol=2 ** -7, atol=1e-3 * emu.abs().max())
        if static is None or mrows <= fp8_linear.GEMV_MAX_M:  # static may saturate: no bound
            ref = xf @ w.t() + b
            bound = 2.0 ** -4 * (xf.abs() @ w.abs().t()) + 2 ** -7 * ref.abs() + 1e-3
            assert bool(((y.float().cpu() - ref).abs() <= bound).all())


def test_fp8_linear_in_cuda_graph():
    """The layer captures (no host sync, no allocation outside the graph pool) and replays to
    the eager result bitwise, at M = 1 (GEMV) and M = 8 (quantize + _scaled_mm)."""
    layer = _layer(6144, 4096, False, None)
    for mrows in (1, 8):
        static_x = torch.zeros(mrows, 4096, dtype=torch.bfloat16, device="cuda")
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):  # warm up (Triton compiles, cuBLASLt picks) off the graph
            for _ in range(2):
                layer(static_x)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = layer(static_x)
        for seed in range(3):
            x = torch.randn(mrows, 4096, generator=torch.Generator().manual_seed(seed))
            static_x.copy_(x.to(torch.bfloat16))
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, layer(static_x)), mrows


# --- checkpoints through the Engine ----------------------------------------------------------
FORMATS = ("fp8-dynamic", "hf-static", "ct-channel")  # the CPU tests cover all six


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    import arch_parity as ap
    import fp8_ckpt as fc
    from transformers import LlamaForCausalLM

    cfg = fc.llama_config()
    model = ap.save_tiny(LlamaForCausalLM, cfg, tmp_path_factory.mktemp("fp8-base"))
    return cfg, model, ap.prompts(fc.VOCAB)


@pytest.fixture(scope="module", params=FORMATS)
def case(request, base, tmp_path_factory):
    import fp8_ckpt as fc
    from transformers import LlamaForCausalLM

    cfg, model, prompts = base
    path = str(tmp_path_factory.mktemp(request.param))
    deq = fc.write_fp8(model, path, request.param, calib_prompts=prompts[:4])
    return request.param, path, fc.reference_model(LlamaForCausalLM, cfg, deq), prompts


def _engine(path, **kw):
    import arch_parity as ap

    kw.setdefault("attention_backend", "triton")
    return ap.make_engine(path, device="cuda", cuda_graph_max_bs=16, **kw)


def _count_replays(eng) -> list:
    """Wrap the graph runner's replay to count decode steps that ran from a CUDA graph."""
    gr = eng.runner.graph_runner
    assert gr is not None
    calls, orig = [], gr.replay
    gr.replay = lambda fb: calls.append(fb.batch_size) or orig(fb)
    return calls


@pytest.mark.parametrize("graphs", [True, False], ids=["graph", "eager"])
def test_fp8_checkpoint_scaled_mm_cuda(case, graphs):
    """bf16 engine, projections kept e4m3 (_scaled_mm; batch-1 decode through the FP8 GEMV):
    within the stated tolerance of the dequantized reference, decode in CUDA graphs included."""
    import fp8_ckpt as fc

    from radixlm.runtime.layers import fp8_linear

    fmt, path, ref, prompts = case
    if not graphs and fmt != "ct-channel":
        pytest.skip("eager decode: one format is enough")
    eng = _engine(path, dtype="bfloat16", fp8_linear="scaled_mm",
                  disable_cuda_graph=not graphs)
    try:
        mods = [m for m in eng.runner.model.modules() if isinstance(m, fp8_linear.Fp8Linear)]
        assert len(mods) == 4 * 2 and all(m.weight.dtype == E4M3 and m.weight.is_cuda
                                          for m in mods)
        assert (mods[0].input_scale is not None) == fmt.endswith("static")
        calls = _count_replays(eng) if graphs else None
        res = fc.check_fp8_engine(eng, ref, prompts)
        if graphs:  # batched decode (bucket 16) and batch-1 decode (bucket 1, the GEMV) replayed
            assert 1 in calls and max(calls) > 1, sorted(set(calls))
        print(fmt, "graphs" if graphs else "eager", res)
    finally:
        eng.shutdown()


def test_fp8_checkpoint_dequant_cuda_is_the_reference(case):
    """fp8_linear=dequant on CUDA (fp32): the dequantized reference itself, HF's greedy tokens
    and prompt log-probs within 1e-3."""
    import arch_parity as ap

    fmt, path, ref, prompts = case
    if fmt != "ct-channel":
        pytest.skip("one format is enough for the dense path")
    eng = _engine(path, dtype="float32", fp8_linear="dequant")
    try:
        ap.check_greedy(eng, prompts, ap.hf_greedy(ref, prompts))
        ap.check_prompt_logprobs(eng, ref, prompts)
    finally:
        eng.shutdown()


def test_auto_picks_scaled_mm_on_this_gpu(case):
    """auto on an SM89+ GPU keeps the weights e4m3 (and says so in the runner's plan)."""
    fmt, path, _, _ = case
    if fmt != "fp8-dynamic":
        pytest.skip("one format is enough")
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("no FP8 tensor cores: auto dequantizes")
    eng = _engine(path, dtype="bfloat16", disable_cuda_graph=True)
    try:
        assert eng.runner.fp8 is not None and eng.runner.fp8.mode == "scaled_mm"
    finally:
        eng.shutdown()
