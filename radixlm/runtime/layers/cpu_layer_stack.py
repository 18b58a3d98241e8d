"""Llama's decoder layers in one C++ call on the CPU (csrc/cpu_layers.cpp's `llama_layers`).

models/llama.py runs each layer as ~9 custom ops and ~50 tensor views, reshapes and allocations
from Python. On a 2-core CPU that per-op overhead is a large share of a decode step (SmolLM2's 30
layers with tiny weights: 7.8 ms a step of pure overhead; the real step ~38 ms), and the other
core idles through it. `run` hands the whole stack to one op that calls the same kernels in the
same order from C++: the same bits, ~1 Python call a step.

It applies only where every layer would take exactly those kernels (`plan` checks): a plain
`LlamaForCausalLM` (no subclass's own layer or attention code), the CPU attention backend, bf16,
the fused CPU ops, and every projection a radixlm-GEMM pack at this row count (a PackedLinear, or
a QuantizedLinear above DIRECT_MAX_M rows, where it takes its dense pack); the MLP's gate/up pack
paired. Anything else (a quantized small batch, the shared-prefix decode path, oneDNN packs,
`RADIXLM_CPU_LAYER_STACK=off`) runs the Python layers, which compute the same thing.
"""

from __future__ import annotations

import os
from typing import Optional

import torch

from radixlm.runtime.layers import cpu_fused, cpu_packed

ENV_VAR = "RADIXLM_CPU_LAYER_STACK"


def _pack_for(module, rows: int) -> Optional[cpu_packed.OwnPacked]:
    """The radixlm-GEMM pack `module` multiplies `rows` rows by, or None if it takes another path."""
    from radixlm.runtime.layers.quantized_linear import DIRECT_MAX_M, QuantizedLinear

    if isinstance(module, QuantizedLinear):
        if module.weight is None or rows <= DIRECT_MAX_M:
            return None  # the quantized kernels (or no dense rows)
    elif not isinstance(module, cpu_packed.PackedLinear):
        return None
    packed = module.packed
    return packed if isinstance(packed, cpu_packed.OwnPacked) else None


def _empty_if_none(t: Optional[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    return t if t is not None else like.new_empty(0)


def plan(model, layers, x: torch.Tensor, fb) -> Optional[list[torch.Tensor]]:
    """The flat weight list (8 per layer) for `llama_layers`, or None where it does not apply.
    Cached on the model per (layers, row class); a cached plan is used only while every module
    still holds the pack it was made from (a reload or repack replaces them)."""
    from radixlm.runtime.attention.cpu_backend import CpuAttention
    from radixlm.runtime.executor.forward_batch import ForwardMode
    from radixlm.runtime.layers.quantized_linear import DIRECT_MAX_M

    if os.environ.get(ENV_VAR, "auto") == "off" or not layers:
        return None
    if (x.device.type != "cpu" or x.dtype != torch.bfloat16 or not cpu_fused.usable(x)
            or type(fb.attn_backend) is not CpuAttention
            or (fb.mode == ForwardMode.DECODE and fb.prefix_groups is not None)):
        return None
    key = (len(layers), x.shape[0] > DIRECT_MAX_M)
    cache = model.__dict__.setdefault("_cpu_layer_stack_plans", {})
    hit = cache.get(key)
    if hit is not None and all(getattr(m, "packed", None) is pk for m, pk in hit[1]):
        return hit[0]
    held = [(m, getattr(m, "packed", None)) for layer in layers
            for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                      layer.mlp.down_proj)]
    cache[key] = (_make_plan(layers, x), held)  # None too: no re-check until a pack changes
    return cache[key][0]


def _make_plan(layers, x: torch.Tensor) -> Optional[list[torch.Tensor]]:
    from radixlm.runtime.models import llama

    rows = x.shape[0]
    flat: list[torch.Tensor] = []
    eps = layers[0].input_layernorm.eps
    dims = _dims(layers[0])
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        if (type(layer).forward is not llama.DecoderLayer.forward
                or type(attn).forward is not llama.Attention.forward
                or type(mlp).forward is not llama.MLP.forward
                or type(layer.input_layernorm) is not llama.RMSNorm
                or type(layer.post_attention_layernorm) is not llama.RMSNorm):
            return None
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        if _dims(layer) != dims or any(n.weight.dtype != x.dtype or n.eps != eps for n in norms):
            return None
        mods = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        packs = [_pack_for(m, rows) for m in mods]
        qkv, o, gate_up, down = packs
        if (None in packs or not gate_up.paired or mlp.gate_up_proj.bias is not None
                or mlp.down_proj.bias is not None or qkv.paired or o.paired or down.paired):
            return None
        flat += [norms[0].weight, qkv.data, _empty_if_none(attn.qkv_proj.bias, x), o.data,
                 _empty_if_none(attn.o_proj.bias, x), norms[1].weight, gate_up.data, down.data]
    return flat


def run(model, layers, x: torch.Tensor, cos_sin, fb):
    """(x, residual) after `layers` (some of the model's layers, in order), as the Python loop
    `x, residual = layer(x, cos_sin, fb, residual)` from residual None gives; or None where the
    C++ stack does not apply (the caller runs that loop)."""
    from radixlm.runtime.executor.forward_batch import ForwardMode

    weights = plan(model, layers, x, fb)
    if weights is None:
        return None
    backend, meta = fb.attn_backend, fb.attn_metadata
    dims = _dims(layers[0])
    cos, sin = (c.reshape(x.shape[0], dims[2]) for c in cos_sin)  # (T, 1, D) -> (T, D)
    pool = backend.kv_pool
    ids = [layer.self_attn.layer_id for layer in layers]
    return torch.ops.radixlm_cpu.llama_layers(
        x.contiguous(), cos, sin, weights, dims, layers[0].input_layernorm.eps,
        [pool.k_buffers[i] for i in ids], [pool.v_buffers[i] for i in ids], fb.out_cache_loc,
        backend.req_to_token, meta.rows, meta.lens, meta.qo_indptr,
        fb.mode == ForwardMode.DECODE, backend.scale, [backend.windows[i] for i in ids],
        float(backend.logit_softcap or 0.0))


def _dims(layer) -> list[int]:
    """[hq, hkv, head_dim, qkv out, o out, down out]: one set for the whole stack."""
    attn = layer.self_attn
    return [attn.hq, attn.hkv, attn.d, attn.qkv_proj.out_features, attn.o_proj.out_features,
            layer.mlp.down_proj.out_features]
