"""models/int4_formats.py and int4_config.py: AWQ, GPTQ and compressed-tensors int4 tensors
unpack bit-exactly (against tests/unit/int4_ckpt.py's independent packers and element-by-element
reference reading), the repack of layers/int4_linear.py keeps every value, and the
quantization_configs this loader cannot run are refused naming the field."""

from __future__ import annotations

import pytest
import torch

import int4_ckpt as ic
from radixlm.runtime.layers import int4_linear
from radixlm.runtime.models import fp8_config, int4_checkpoint, int4_config, int4_formats

N = 24  # not a multiple of 16, and compressed-tensors' zero points pack 3 words of rows


def _scheme(c: ic.Case) -> int4_config.Int4Scheme:
    return int4_config.parse({"quantization_config": ic.quantization_config(c)})


def _random_layer(c: ic.Case, n: int, k: int, seed: int):
    """q (N, K), z (N, G) (the full ranges: GPTQ v1 zeros 1..16, others 0..15; 8 when
    symmetric), s (N, G) and g_idx, drawn at random."""
    g = torch.Generator().manual_seed(seed)
    group = c.group or k
    ng = k // group
    q = torch.randint(0, 16, (n, k), generator=g)
    lo = 1 if (c.method == "gptq" and c.v1) else 0
    z = (torch.full((n, ng), 8) if c.sym else torch.randint(lo, lo + 16, (n, ng), generator=g))
    if c.method == "ct" and not c.sym:
        z = z.clamp(max=15)  # a signed 4-bit zero point: -8..7 stored + 8
    s = torch.rand(n, ng, generator=g) * 0.05 + 1e-3
    s = s.to(torch.bfloat16 if c.method == "ct" else torch.float16).float()
    g_idx = ic.act_g_idx(k, group, seed) if c.act else None
    return q, z, s, g_idx


@pytest.mark.parametrize("name", list(ic.CASES))
def test_unpack_is_bit_exact(name):
    c = ic.CASES[name]
    k = 96 if c.group == 0 else 256  # one group per row: a K that is not a power of two
    q, z, s, g_idx = _random_layer(c, N, k, seed=len(name))
    t = ic.pack(c, q, z, s, g_idx, torch.bfloat16 if c.method == "ct" else torch.float16)
    w = int4_formats.read(_scheme(c), "layer", lambda sfx: t.get(sfx))
    assert torch.equal(w.q.long(), q) and torch.equal(w.z.long(), z)
    assert torch.equal(w.s.float(), s)
    assert (w.g_idx is None) == (g_idx is None)
    if g_idx is not None:
        assert torch.equal(w.g_idx, g_idx)
    ref = ic.ref_dequantize(c, t, N, k)
    assert torch.equal(w.dequantize(torch.float32), ref)
    # the kernel layout (and its act-order permutation) keeps every value
    lin = int4_linear.Int4Linear.from_weights([w], bias=False, dtype=torch.float32, device="cpu")
    assert torch.equal(lin.dequantized_weight(torch.float32), ref)
    assert (lin.perm is not None) == (g_idx is not None)


def test_fused_pieces_stack_rows():
    c = ic.CASES["gptq-v1-asym-act-g64"]
    ws, refs = [], []
    g_idx = ic.act_g_idx(128, 64, seed=3)  # q, k and v read one input: one permutation
    for i, n in enumerate((32, 16, 16)):
        q, z, s, _ = _random_layer(c, n, 128, seed=i)
        t = ic.pack(c, q, z, s, g_idx, torch.float16)
        ws.append(int4_formats.read(_scheme(c), "p", lambda sfx, t=t: t.get(sfx)))
        refs.append(ic.ref_dequantize(c, t, n, 128))
    lin = int4_linear.Int4Linear.from_weights(ws, bias=True, dtype=torch.float32, device="cpu")
    assert torch.equal(lin.dequantized_weight(), torch.cat(refs))
    ws[1].g_idx = ic.act_g_idx(128, 64, seed=4)
    with pytest.raises(ValueError, match="g_idx"):
        int4_linear.Int4Linear.from_weights(ws, bias=False, dtype=torch.float32, device="cpu")


def test_checkpoint_contradicting_its_config_is_refused():
    c = ic.CASES["gptq-v2-asym-g128"]
    q, z, s, _ = _random_layer(c, N, 256, seed=1)
    t = ic.pack(c, q, z, s, None, torch.float16)
    sym = int4_config.Int4Scheme("gptq", 128, sym=True, g_idx=False)
    with pytest.raises(ValueError, match="sym"):
        int4_formats.read(sym, "layer", lambda sfx: t.get(sfx))
    act = int4_config.Int4Scheme("gptq", 128, sym=False, g_idx=True)
    with pytest.raises(ValueError, match="g_idx"):
        int4_formats.read(act, "layer", lambda sfx: None if sfx == "g_idx" else t.get(sfx))
    with pytest.raises(ValueError, match="qzeros: shape"):
        int4_formats.read(int4_config.Int4Scheme("gptq", 64, sym=False, g_idx=False), "layer",
                          lambda sfx: t.get(sfx))


def _q(c: ic.Case, **kw) -> dict:
    q = ic.quantization_config(c)
    for key, v in kw.items():
        d = q
        parts = key.split("__")
        for p in parts[:-1]:
            d = d[p]
        d[parts[-1]] = v
    return q


_AWQ, _GPTQ, _CT = ic.CASES["awq-g128"], ic.CASES["gptq-v1-asym-act-g64"], ic.CASES["ct-asym-g32"]
_W = "config_groups__group_0__weights__"
REFUSED = {  # quantization_config -> the field the error must name
    "awq 3 bit": (_q(_AWQ, bits=3), "bits"),
    "awq gemv": (_q(_AWQ, version="gemv"), "version"),
    "awq marlin": (_q(_AWQ, version="marlin"), "version"),
    "awq no zero point": (_q(_AWQ, zero_point=False), "zero_point"),
    "awq group 256": (_q(_AWQ, group_size=256), "group_size"),
    "awq unknown field": (_q(_AWQ, new_knob=1), "new_knob"),
    "gptq 8 bit": (_q(_GPTQ, bits=8), "bits"),
    "gptq group 16": (_q(_GPTQ, group_size=16), "group_size"),
    "gptq marlin format": (_q(_GPTQ, checkpoint_format="marlin"), "checkpoint_format"),
    "gptq quantized head": (_q(_GPTQ, lm_head=True), "lm_head"),
    "gptq per-module overrides": (_q(_GPTQ, dynamic={"-:.*down": {}}), "dynamic"),
    "gptq rotation": (_q(_GPTQ, rotation="hadamard"), "rotation"),
    "gptq adapter": (_q(_GPTQ, adapter={"name": "eora", "rank": 64}), "adapter"),
    "gptq desc_act string": (_q(_GPTQ, desc_act="yes"), "desc_act"),
    "gptq unknown field": (_q(_GPTQ, new_knob=1), "new_knob"),
    "ct 8 bit": (_q(_CT, **{_W + "num_bits": 8}), "weights.num_bits"),
    "ct float": (_q(_CT, **{_W + "type": "float"}), "weights.type"),
    "ct tensor strategy": (_q(_CT, **{_W + "strategy": "tensor"}), "weights.strategy"),
    "ct group 256": (_q(_CT, **{_W + "group_size": 256}), "weights.group_size"),
    "ct actorder": (_q(_CT, **{_W + "actorder": "sideways"}), "weights.actorder"),
    "ct w4a8": (_q(_CT, config_groups__group_0__input_activations={"num_bits": 8}),
                "input_activations"),
    "ct unknown field": (_q(_CT, **{_W + "new_knob": 1}), "weights.new_knob"),
    "ct group format": (_q(_CT, config_groups__group_0__format="marlin-24"), "format"),
    "ct status": (_q(_CT, quantization_status="frozen"), "quantization_status"),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_refuses_what_it_cannot_run_naming_the_field(name):
    q, field = REFUSED[name]
    with pytest.raises(ValueError, match=rf"quantization_config\.\S*{field}"):
        int4_config.parse({"quantization_config": q})


def test_accepted_configs_and_the_fp8_loader_leaves_them():
    for name, c in ic.CASES.items():
        s = _scheme(c)
        assert s.method == {"ct": "compressed-tensors"}.get(c.method, c.method), name
        assert (s.group_size, s.sym, s.g_idx) == (c.group, c.sym, c.act), name
        assert s.zero_offset == (1 if c.method == "gptq" and c.v1 else 0), name
        assert fp8_config.parse({"quantization_config": ic.quantization_config(c)}) is None
    assert int4_config.parse({}) is None
    assert int4_config.parse({"quantization_config": {"quant_method": "fp8"}}) is None


def test_mode_resolution(monkeypatch):
    cpu = torch.device("cpu")
    cfg = {"quantization_config": ic.quantization_config(_AWQ)}
    assert int4_checkpoint.plan(cfg, "auto", cpu).mode == "dequant"  # CPU: dequantized at load
    assert int4_checkpoint.resolve_mode("triton", cpu) == "triton"  # tests: the emulation
    assert int4_checkpoint.resolve_mode("auto", cpu, tp_size=2) == "dequant"
    with pytest.raises(ValueError, match="tensor parallelism"):
        int4_checkpoint.resolve_mode("triton", cpu, tp_size=2)
    monkeypatch.setenv(int4_checkpoint.ENV_VAR, "triton")
    assert int4_checkpoint.resolve_mode("dequant", cpu) == "triton"  # the env var wins
    monkeypatch.setenv(int4_checkpoint.ENV_VAR, "fast")
    with pytest.raises(ValueError, match="RADIXLM_INT4_LINEAR"):
        int4_checkpoint.resolve_mode("auto", cpu)
    monkeypatch.delenv(int4_checkpoint.ENV_VAR)
    with pytest.raises(ValueError, match="load_format='gguf'"):
        int4_checkpoint.plan(cfg, "auto", cpu, 1, "gguf")
