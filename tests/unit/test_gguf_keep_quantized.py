"""GGUF weights kept quantized on the CPU (ServerArgs.gguf_keep_quantized, layers/quantized_linear)
against the dequantized path, through the Engine.

Tolerances. In float32 both paths multiply by the same dequantized values (the kernel's are
bit-identical to gguf.quants') and differ only in summation order: greedy tokens must be
identical and prompt logprobs within 1e-3 (seen: ~2e-5). In bfloat16 the dequantized path rounds
every weight to bf16 at load while the kernel uses the file's exact values, so the two parts
after a few tokens; there the quantized path must be as close to the float32 reference as the
dequantized one up to noise: mean |prompt logprob - fp32 ref| within 1.5x of the dequantized
path's (seen: 0.044 vs 0.040 -- bf16 activations dominate both errors)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from radixlm.runtime.layers import quant_kernels, quantized_linear
from radixlm.runtime.layers.quantized_linear import QuantizedLinear

gguf = pytest.importorskip("gguf")
CPU = torch.device("cpu")
PROMPTS = ["The quick brown fox", "def fibonacci(n):\n    ", "Paris is the capital of",
           "1, 2, 3, 4, 5,"]
MAX_NEW = 12
LP_ATOL = 1e-3


@pytest.fixture(autouse=True)
def no_env(monkeypatch):
    monkeypatch.delenv(quantized_linear.ENV_VAR, raising=False)
    return monkeypatch


@pytest.fixture(scope="module")
def kernels():
    if not quant_kernels.available():
        pytest.skip("quantized GEMM unavailable")


# ------------------------------------------------------------------------------------ the switch

def test_switch_resolution(kernels, no_env):
    avx2 = quant_kernels.load().isa() in ("avx2", "avx512", "avx512bf16")
    assert quantized_linear.keep_quantized("auto", CPU, "gguf") == avx2
    assert quantized_linear.keep_quantized("on", CPU, "gguf")
    assert not quantized_linear.keep_quantized("off", CPU, "gguf")
    assert not quantized_linear.keep_quantized("on", CPU, "safetensors")  # nothing to keep
    assert not quantized_linear.keep_quantized("auto", torch.device("cuda"), "gguf")
    with pytest.raises(ValueError, match="CPU-only"):
        quantized_linear.keep_quantized("on", torch.device("cuda"), "gguf")
    assert not quantized_linear.keep_quantized("auto", CPU, "gguf", tp_size=2)
    with pytest.raises(ValueError, match="tensor parallelism"):
        quantized_linear.keep_quantized("on", CPU, "gguf", tp_size=2)
    no_env.setenv(quantized_linear.ENV_VAR, "OFF")
    assert not quantized_linear.keep_quantized("on", CPU, "gguf")
    no_env.setenv(quantized_linear.ENV_VAR, "sometimes")
    with pytest.raises(ValueError, match=quantized_linear.ENV_VAR):
        quantized_linear.keep_quantized("auto", CPU, "gguf")


# ------------------------------------------------------------------------- SmolLM2 (Q4_1 + Q8_0)

def _run(path, mode: str, dtype: str, **kw):
    import radixlm

    eng = radixlm.Engine(model_path=path, dtype=dtype, gguf_keep_quantized=mode,
                         max_total_tokens=2000, context_length=512, **kw)
    try:
        ids = kw.get("skip_tokenizer_init") and PROMPT_IDS
        outs = eng.generate(prompt=None if ids else PROMPTS, input_ids=ids or None,
                            sampling_params={"temperature": 0, "max_new_tokens": MAX_NEW},
                            return_logprob=True, logprob_start_len=0)
        eng.wait_idle()
        eng.check_integrity()
        model = eng.runner.model
        return {"keep": eng.runner.keep_quantized, "model": model, "outs": outs,
                "tokens": [o["output_ids"] for o in outs],
                # prompt logprobs (the first token has none)
                "lps": [np.array([t[0] for t in o["meta_info"]["input_token_logprobs"][1:]])
                        for o in outs],
                "out_lps": [np.array([t[0] for t in o["meta_info"]["output_token_logprobs"]])
                            for o in outs]}
    finally:
        eng.shutdown()


@pytest.fixture(scope="module")
def smol(smol_path, kernels):
    mp = pytest.MonkeyPatch()
    mp.delenv(quantized_linear.ENV_VAR, raising=False)
    try:
        return {(mode, dt): _run(smol_path, mode, dt)
                for dt in ("float32", "bfloat16") for mode in ("off", "on")}
    finally:
        mp.undo()


def test_smollm2_modules_hold_blocks(smol):
    on, off = smol[("on", "float32")], smol[("off", "float32")]
    assert on["keep"] and not off["keep"]
    layer = on["model"].layers[0]
    for mod in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                layer.mlp.down_proj):
        assert isinstance(mod, QuantizedLinear) and mod.fmt_name == "Q4_1"
    assert layer.self_attn.qkv_proj.out_features == 576 + 2 * 192  # q | k | v rows fused
    head = on["model"].lm_head_quant
    assert isinstance(head, QuantizedLinear) and head.fmt_name == "Q8_0"  # the tied embedding
    assert on["model"].lm_head_fp32 is None  # no fp32 copy of the head
    assert off["model"].lm_head_quant is None


def test_smollm2_fp32_matches_dequantized(smol):
    on, off = smol[("on", "float32")], smol[("off", "float32")]
    assert on["tokens"] == off["tokens"]
    # prompt rows run the tiled path (BLAS on dequantized tiles: often bit-identical), decode
    # rows the direct kernel (another summation order)
    for key in ("lps", "out_lps"):
        worst = max(np.abs(a - b).max() for a, b in zip(on[key], off[key]))
        print(f"max |{key} diff| on vs off, fp32: {worst:.3g}")
        assert worst < LP_ATOL


def test_smollm2_bf16_as_accurate_as_dequantized(smol):
    ref = smol[("off", "float32")]["lps"]

    def mean_err(mode):
        return float(np.mean(np.concatenate(
            [np.abs(a - b) for a, b in zip(smol[(mode, "bfloat16")]["lps"], ref)])))

    on, off = mean_err("on"), mean_err("off")
    print(f"mean |prompt logprob - fp32 ref|, bf16: kept quantized {on:.4f}, dequantized {off:.4f}")
    assert on <= off * 1.5
    # the first greedy token of each prompt agrees (the paths part later, at bf16 near-ties)
    a, b = smol[("on", "bfloat16")]["tokens"], smol[("off", "bfloat16")]["tokens"]
    assert [t[0] for t in a] == [t[0] for t in b]


# ------------------------------------- a tiny Llama written here in Q4_K (+ Q6_K, Q8_0, F32)

HIDDEN, FFN, HEADS, KV, VOCAB, LAYERS = 256, 512, 4, 2, 320, 2
PROMPT_IDS = [[5, 17, 200, 33, 91], [1, 2, 3], [300, 12, 12, 12, 7, 8, 250, 3, 4], [42]]


def write_tiny_q4k(path: str, seed: int = 0, mixed: bool = True) -> str:
    """2 layers; every projection Q4_K except layer 1's ffn_up (Q8_0: its fused gate_up mixes
    formats and must stay dense) and ffn_down (Q6_K, random 6-bit values); untied Q8_0 output
    head; F32 embedding and norms."""
    from test_quant_gemm import q4k_quantize, q6k_random

    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(path, "llama")
    for add, v in ((w.add_block_count, LAYERS), (w.add_context_length, 512),
                   (w.add_embedding_length, HIDDEN), (w.add_feed_forward_length, FFN),
                   (w.add_head_count, HEADS), (w.add_head_count_kv, KV),
                   (w.add_layer_norm_rms_eps, 1e-5), (w.add_rope_freq_base, 10000.0)):
        add(v)
    d = HIDDEN // HEADS
    q4k, q8 = gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q8_0

    def put(name, shape, kind, scale):
        arr = (rng.standard_normal(shape) * scale).astype(np.float32)
        if kind == "q6k":  # |w| <= d * 128 * 32 with d = 1e-5: std ~ 0.03
            raw = q6k_random(*shape, rng)
            raw.reshape(shape[0], -1, 210)[..., 208:210] = np.array([1e-5], np.float16).view(np.uint8)
            w.add_tensor(name, raw, raw_dtype=gguf.GGMLQuantizationType.Q6_K)
        elif kind == "q4k":
            w.add_tensor(name, q4k_quantize(arr), raw_dtype=q4k)
        elif kind == "q8":
            w.add_tensor(name, gguf.quants.quantize(arr, q8), raw_dtype=q8)
        else:
            w.add_tensor(name, arr)

    put("token_embd.weight", (VOCAB, HIDDEN), "f32", 1.0)
    for i in range(LAYERS):
        p = f"blk.{i}."
        put(p + "attn_norm.weight", (HIDDEN,), "f32", 0.1)
        put(p + "ffn_norm.weight", (HIDDEN,), "f32", 0.1)
        for name, shape in (("attn_q", (HIDDEN, HIDDEN)), ("attn_k", (KV * d, HIDDEN)),
                            ("attn_v", (KV * d, HIDDEN)), ("attn_output", (HIDDEN, HIDDEN)),
                            ("ffn_gate", (FFN, HIDDEN)), ("ffn_up", (FFN, HIDDEN)),
                            ("ffn_down", (HIDDEN, FFN))):
            kind = ("q8" if (i, name) == (1 if mixed else 0, "ffn_up") else
                    "q6k" if (i, name) == (1, "ffn_down") else "q4k")
            put(f"{p}{name}.weight", shape, kind, 1 / np.sqrt(shape[1]))
    put("output_norm.weight", (HIDDEN,), "f32", 0.1)
    put("output.weight", (VOCAB, HIDDEN), "q8", 0.3)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_tiny_q4k_llama_matches_dequantized(tmp_path, kernels, monkeypatch):
    monkeypatch.setenv("RADIXLM_CACHE_DIR", str(tmp_path / "cache"))
    path = write_tiny_q4k(str(tmp_path / "tiny-q4k.gguf"))
    kw = dict(skip_tokenizer_init=True, attention_backend="torch_native")
    on, off = _run(path, "on", "float32", **kw), _run(path, "off", "float32", **kw)
    l0, l1 = on["model"].layers
    assert isinstance(l0.self_attn.qkv_proj, QuantizedLinear) and l0.self_attn.qkv_proj.fmt_name == "Q4_K"
    assert isinstance(l0.mlp.gate_up_proj, QuantizedLinear)
    assert isinstance(l1.mlp.down_proj, QuantizedLinear) and l1.mlp.down_proj.fmt_name == "Q6_K"
    assert not isinstance(l1.mlp.gate_up_proj, QuantizedLinear)  # Q4_K gate + Q8_0 up: dense
    assert on["model"].lm_head is None and on["model"].lm_head_quant.fmt_name == "Q8_0"
    assert on["tokens"] == off["tokens"]
    worst = max(np.abs(a - b).max(initial=0) for key in ("lps", "out_lps")
                for a, b in zip(on[key], off[key]))
    print(f"max |logprob diff| on vs off, tiny Q4_K: {worst:.3g}")
    assert worst < LP_ATOL, worst
    # a second engine reads the blocks from the start-up cache: same results
    again = _run(path, "on", "float32", **kw)
    assert again["tokens"] == on["tokens"]
    assert (tmp_path / "cache").exists() and any((tmp_path / "cache").rglob(quantized_linear._BLOCKS_FILE))


def test_reload_weights_takes_new_blocks(tmp_path, kernels, monkeypatch):
    """update_weights_from_disk's path for quantized models (scheduler_control): a GGUF with the
    same formats replaces every block in place; one whose formats differ is refused untouched."""
    import radixlm

    monkeypatch.setenv("RADIXLM_CACHE_DIR", str(tmp_path / "cache"))
    a = write_tiny_q4k(str(tmp_path / "a.gguf"), seed=0)
    b = write_tiny_q4k(str(tmp_path / "b.gguf"), seed=1)
    other = write_tiny_q4k(str(tmp_path / "c.gguf"), seed=2, mixed=False)  # layer 0 ffn_up Q8_0
    kw = dict(skip_tokenizer_init=True, attention_backend="torch_native")
    eng = radixlm.Engine(model_path=a, dtype="float32", gguf_keep_quantized="on",
                         max_total_tokens=2000, context_length=512, **kw)
    try:
        model = eng.runner.model
        before = model.layers[0].mlp.gate_up_proj.blocks.clone()
        with pytest.raises(ValueError, match="Q4_K"):
            quantized_linear.reload_weights(model, other, "gguf", torch.float32)
        assert torch.equal(model.layers[0].mlp.gate_up_proj.blocks, before)
        quantized_linear.reload_weights(model, b, "gguf", torch.float32)
        got = eng.generate(input_ids=PROMPT_IDS, sampling_params={"temperature": 0,
                                                                   "max_new_tokens": MAX_NEW})
        eng.wait_idle()
        eng.check_integrity()
    finally:
        eng.shutdown()
    assert [o["output_ids"] for o in got] == _run(b, "on", "float32", **kw)["tokens"]


# ------------------------------- dense rows: bf16 on a CPU with native bf16 matmul (auto only)

def test_dense_rows_switch(no_env, monkeypatch):
    from radixlm.runtime.layers import cpu_linear

    bf16 = torch.bfloat16
    monkeypatch.setattr(cpu_linear, "cpu_has_native_bf16_matmul", lambda: True)
    assert quantized_linear.keep_dense_rows("auto", CPU, bf16)
    assert not quantized_linear.keep_dense_rows("on", CPU, bf16)  # on: blocks only (memory)
    assert not quantized_linear.keep_dense_rows("auto", CPU, torch.float32)
    assert not quantized_linear.keep_dense_rows("auto", torch.device("cuda"), bf16)
    no_env.setenv(quantized_linear.ENV_VAR, "on")
    assert not quantized_linear.keep_dense_rows("auto", CPU, bf16)
    no_env.delenv(quantized_linear.ENV_VAR)
    monkeypatch.setattr(cpu_linear, "cpu_has_native_bf16_matmul", lambda: False)
    assert not quantized_linear.keep_dense_rows("auto", CPU, bf16)


def test_dense_rows_take_the_dense_path_above_16_rows(tmp_path, kernels, monkeypatch):
    """auto + bf16 + native bf16 matmul (patched in, so any CPU runs it): every QuantizedLinear
    also holds the dense bf16 weight. The 18 prompt rows of the batch run dense, so prompt
    logprobs equal the dequantized (off) engine's exactly; decode (4 rows) runs the blocks."""
    from radixlm.runtime.layers import cpu_linear

    monkeypatch.setattr(cpu_linear, "cpu_has_native_bf16_matmul", lambda: True)
    monkeypatch.setenv("RADIXLM_CACHE_DIR", str(tmp_path / "cache"))
    path = write_tiny_q4k(str(tmp_path / "tiny-q4k.gguf"))
    kw = dict(skip_tokenizer_init=True, attention_backend="torch_native")
    hyb, off = _run(path, "auto", "bfloat16", **kw), _run(path, "off", "bfloat16", **kw)
    assert sum(map(len, PROMPT_IDS)) > quantized_linear.DIRECT_MAX_M
    m = hyb["model"]
    qkv = m.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, QuantizedLinear) and qkv.weight is not None
    assert torch.equal(qkv.weight, off["model"].layers[0].self_attn.qkv_proj.weight)
    assert m.lm_head_dense_above == quantized_linear.DIRECT_MAX_M
    assert m.lm_head is not None and m.lm_head_quant is not None  # untied: both heads kept
    for a, b in zip(hyb["lps"], off["lps"]):
        np.testing.assert_array_equal(a, b)
    assert [t[0] for t in hyb["tokens"]] == [t[0] for t in off["tokens"]]
    # few rows take the blocks: layer output == the blocks path's, not the dense weight's
    x = torch.randn(4, qkv.in_features, dtype=torch.bfloat16)
    assert torch.equal(qkv(x), qkv.forward_fp32(x).to(torch.bfloat16))
    # reload_weights keeps the dense copies in step with the new blocks
    b = write_tiny_q4k(str(tmp_path / "b.gguf"), seed=1)
    quantized_linear.reload_weights(m, b, "gguf", torch.bfloat16)
    fresh = _run(b, "off", "bfloat16", **kw)["model"].layers[0].self_attn.qkv_proj.weight
    assert torch.equal(qkv.weight, fresh)
