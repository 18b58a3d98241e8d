"""Llama's decoder layers in one C++ call on the CPU (csrc/cpu_layers.cpp's `llama_layers`).

models/llama.py runs each layer as ~9 custom ops and ~50 tensor views, reshapes and allocations
from Python. On a 2-core CPU that per-op overhead is a large share of a decode step (SmolLM2's 30
layers with tiny weights: 7.8 ms a step of pure overhead; the real step ~38 ms), and the other
core idles through it. `run` hands the whole stack to one op that calls the same kernels in the
same order from C++: the same bits, ~1 Python call a step.

It applies only where every layer would take exactly those kernels (`plan` checks): llama.py's
decoder layer, attention (or Qwen3's, with its per-head q/k norms) and MLP classes, whatever the
model class around them (Llama, Mistral, Qwen2, Qwen3, Phi-3 without partial rotary, LLaVA's
language model; MoE and Gemma layers are other classes), the CPU attention backend, bf16,
the fused CPU ops, and every projection either a radixlm-GEMM pack (a PackedLinear, or a
QuantizedLinear above DIRECT_MAX_M rows, where it takes its dense pack) or a QuantizedLinear's
blocks at DIRECT_MAX_M rows or fewer. Shared-prefix decode steps (fb.prefix_groups) run the
grouped attention in C++ too. Anything else (oneDNN packs, the tiled block kernels,
`RADIXLM_CPU_LAYER_STACK=off`) runs the Python layers, which compute the same thing.
"""

from __future__ import annotations

import os
from typing import NamedTuple, Optional

import torch

from radixlm.runtime.layers import cpu_fused, cpu_packed

ENV_VAR = "RADIXLM_CPU_LAYER_STACK"


def _weight_for(module, rows: int) -> Optional[tuple[int, torch.Tensor]]:
    """(kind, tensor): how `module` multiplies `rows` rows, as its forward would: (-1, a
    radixlm-GEMM pack's data), or (ggml type, the GGUF blocks) for a QuantizedLinear at
    <= DIRECT_MAX_M rows (csrc/cpu_layers.cpp's `kinds`); None for any other path."""
    from radixlm.runtime.layers.quantized_linear import DIRECT_MAX_M, QuantizedLinear

    if isinstance(module, QuantizedLinear):
        if rows <= DIRECT_MAX_M:
            return module.fmt, module.blocks  # forward_fp32's direct kernel
        if module.weight is None:
            return None  # the tiled / chunked block kernels
    elif not isinstance(module, cpu_packed.PackedLinear):
        return None
    packed = module.packed
    return (-1, packed.data) if isinstance(packed, cpu_packed.OwnPacked) else None


def _empty_if_none(t: Optional[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    return t if t is not None else like.new_empty(0)


class Plan(NamedTuple):
    """What `llama_layers` takes of the layers themselves, derived once per plan."""
    weights: list  # 10 tensors a layer (csrc/cpu_layers.cpp's order)
    kinds: list  # 4 a layer: how each projection multiplies
    dims: list  # _dims
    eps: float
    layer_ids: list  # each layer's KV pool index


def plan(model, layers, x: torch.Tensor, fb) -> Optional[Plan]:
    """The `llama_layers` plan of these layers at x's row count, or None where it does not
    apply.
    Cached on the model per (layers, row class); a cached plan is used only while every module
    still holds the pack it was made from (a reload or repack replaces them)."""
    from radixlm.runtime.attention.cpu_backend import CpuAttention
    from radixlm.runtime.layers.quantized_linear import DIRECT_MAX_M

    if os.environ.get(ENV_VAR, "auto") == "off" or not layers:
        return None
    if (x.device.type != "cpu" or x.dtype != torch.bfloat16 or not cpu_fused.usable(x)
            or type(fb.attn_backend) is not CpuAttention):
        return None
    key = (len(layers), x.shape[0] > DIRECT_MAX_M)
    cache = model.__dict__.setdefault("_cpu_layer_stack_plans", {})
    hit = cache.get(key)
    if hit is not None and all(getattr(m, "packed", None) is pk for m, pk in hit[1]):
        return hit[0]
    held = [(m, getattr(m, "packed", None)) for layer in layers for m in _projections(layer)]
    cache[key] = (_make_plan(layers, x), held)  # None too: no re-check until a pack changes
    return cache[key][0]


# The Python layer code the C++ stack reproduces, registered by the model files that define it
# (models/llama.py, models/qwen3.py): layers sit below models, so the stack never imports a model
# class; a layer runs here only where its classes' forwards are exactly these.
_CODE: dict = {}  # "decoder", "attention", "mlp": forward functions; "norm": the RMSNorm class
_QK_NORM_ATTENTION: set = set()  # attention forwards with per-head q/k norms (Qwen3's)


def accept(*, decoder, attention, mlp, norm: type) -> None:
    """Registers llama.py's layer code: DecoderLayer.forward, Attention.forward, MLP.forward and
    the RMSNorm class, which csrc/cpu_layers.cpp's `llama_layers` computes bit for bit."""
    _CODE.update(decoder=decoder, attention=attention, mlp=mlp, norm=norm)


def accept_qk_norm_attention(forward) -> None:
    """Registers an attention forward that is llama's plus an RMSNorm on each q and k head
    (Qwen3's QKNormAttention.forward), which the stack runs with the heads' norm weights."""
    _QK_NORM_ATTENTION.add(forward)


def _layer_kind(layer) -> Optional[bool]:
    """Whether the layer is llama.py's (False) or has Qwen3's per-head q/k norms (True); None for
    any other layer, attention, MLP or norm code."""
    if not _CODE:
        return None
    attn, mlp = layer.self_attn, layer.mlp
    qk_norm = type(attn).forward in _QK_NORM_ATTENTION
    norms = (layer.input_layernorm, layer.post_attention_layernorm) + (
        (attn.q_norm, attn.k_norm) if qk_norm else ())
    if (type(layer).forward is not _CODE["decoder"]
            or (type(attn).forward is not _CODE["attention"] and not qk_norm)
            or type(mlp).forward is not _CODE["mlp"]
            or any(type(n) is not _CODE["norm"] for n in norms)):
        return None
    return qk_norm


def _make_plan(layers, x: torch.Tensor) -> Optional[Plan]:
    qk_norms = [_layer_kind(layer) for layer in layers]
    if None in qk_norms:
        return None
    rows = x.shape[0]
    flat: list[torch.Tensor] = []
    kinds: list[int] = []
    eps = layers[0].input_layernorm.eps
    dims = _dims(layers[0])
    for layer, qk_norm in zip(layers, qk_norms):
        attn, mlp = layer.self_attn, layer.mlp
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        head_norms = (attn.q_norm, attn.k_norm) if qk_norm else ()
        if _dims(layer) != dims or any(n.weight.dtype != x.dtype or n.eps != eps
                                       for n in norms + head_norms):
            return None
        mods = _projections(layer)
        got = [_weight_for(m, rows) for m in mods]
        if None in got or mlp.gate_up_proj.bias is not None or mlp.down_proj.bias is not None:
            return None
        (kq, wq), (ko, wo), (kg, wg), (kd, wd) = got
        if kg == -1 and not mlp.gate_up_proj.packed.paired:
            kg = -2  # an unpaired pack: the GEMM, then silu_and_mul (MLP.forward's fallback)
        if any(k == -1 and m.packed.paired for k, m in ((kq, mods[0]), (ko, mods[1]),
                                                        (kd, mods[3]))):
            return None
        kinds += [kq, ko, kg, kd]
        flat += [norms[0].weight, wq, _empty_if_none(attn.qkv_proj.bias, x), wo,
                 _empty_if_none(attn.o_proj.bias, x), norms[1].weight, wg, wd]
        flat += [n.weight for n in head_norms] or [x.new_empty(0), x.new_empty(0)]
    return Plan(flat, kinds, dims, eps, [layer.self_attn.layer_id for layer in layers])


def run(model, layers, x: torch.Tensor, cos_sin, fb):
    """(x, residual) after `layers` (some of the model's layers, in order), as the Python loop
    `x, residual = layer(x, cos_sin, fb, residual)` from residual None gives; or None where the
    C++ stack does not apply (the caller runs that loop)."""
    from radixlm.runtime.executor.forward_batch import ForwardMode

    made = plan(model, layers, x, fb)
    if made is None:
        return None
    backend, meta = fb.attn_backend, fb.attn_metadata
    cos, sin = (c.reshape(x.shape[0], made.dims[2]) for c in cos_sin)  # (T, 1, D) -> (T, D)
    pool = backend.kv_pool
    ids = made.layer_ids
    decode = fb.mode == ForwardMode.DECODE
    g = fb.prefix_groups if decode else None  # layers with a window decode plainly (in C++)
    groups = [] if g is None else [g.rows, g.qo_indptr, g.rep_pool_indices, g.shared_lens,
                                   g.zeros, g.kv_start]
    return torch.ops.radixlm_cpu.llama_layers(
        x.contiguous(), cos, sin, made.weights, made.kinds, made.dims, made.eps,
        [pool.k_buffers[i] for i in ids], [pool.v_buffers[i] for i in ids], fb.out_cache_loc,
        backend.req_to_token, meta.rows, meta.lens, meta.qo_indptr,
        decode, backend.scale, [backend.windows[i] for i in ids],
        float(backend.logit_softcap or 0.0), groups)


def _projections(layer) -> tuple:
    """qkv, o, gate_up, down: the order of `llama_layers`' weights and kinds (None for one a
    layer of other classes lacks, e.g. an MoE block's gate_up)."""
    attn, mlp = layer.self_attn, layer.mlp
    return tuple(getattr(parent, name, None) for parent, name in (
        (attn, "qkv_proj"), (attn, "o_proj"), (mlp, "gate_up_proj"), (mlp, "down_proj")))


def _dims(layer) -> list[int]:
    """[hq, hkv, head_dim, qkv out, o out, down out, intermediate]: one set for the stack."""
    attn = layer.self_attn
    return [attn.hq, attn.hkv, attn.d, attn.qkv_proj.out_features, attn.o_proj.out_features,
            layer.mlp.down_proj.out_features, layer.mlp.inter]
