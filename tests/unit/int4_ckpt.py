"""Tiny int4 checkpoints for the int4 tests (tests/unit/test_int4_*.py, tests/gpu/test_int4.py):
a random-weight HF Llama (arch_parity.save_tiny) whose projections are quantized to int4 here
and packed with plain loops over each format's documented bit layout, written with a
config.json quantization_config as AWQ, GPTQ and compressed-tensors write them, next to the
dequantized fp32 weights (the reference every int4 path is checked against).

Nothing here imports radixlm's int4 code: the packers, the layout constants and the per-element
reference unpacker are written from the formats' documentation (layouts: the docstring of
radixlm/runtime/models/int4_formats.py), so the loader is checked against an independent reading.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's pack: nibble i of a word holds column ORDER[i]
PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# the input each projection reads: act-order permutations are shared by the projections of one
# input (GPTQ's column order comes from that input's Hessian)
_INPUT = {"q_proj": "attn_in", "k_proj": "attn_in", "v_proj": "attn_in", "o_proj": "o_in",
          "gate_proj": "mlp_in", "up_proj": "mlp_in", "down_proj": "down_in"}


@dataclass(frozen=True)
class Case:
    method: str  # awq | gptq | ct
    group: int  # 0: one group per row (GPTQ -1, compressed-tensors channel)
    sym: bool = False
    act: bool = False  # act-order with a stored g_idx
    v1: bool = True  # GPTQ checkpoint_format "gptq" (zero - 1 stored) vs "gptq_v2"
    zp_int8: bool = False  # compressed-tensors: unpacked int8 zero points (older writers)


CASES = {
    "awq-g32": Case("awq", 32),
    "awq-g128": Case("awq", 128),
    "gptq-v1-asym-act-g64": Case("gptq", 64, act=True),
    "gptq-v1-sym-g32": Case("gptq", 32, sym=True),
    "gptq-v2-asym-g128": Case("gptq", 128, v1=False),
    "gptq-v2-sym-act-g128": Case("gptq", 128, sym=True, act=True, v1=False),
    "gptq-v1-row": Case("gptq", 0),
    "ct-asym-g32": Case("ct", 32),
    "ct-sym-act-g64": Case("ct", 64, sym=True, act=True),
    "ct-asym-int8zp-g128": Case("ct", 128, zp_int8=True),
    "ct-sym-channel": Case("ct", 0, sym=True),
}


def quantization_config(c: Case) -> dict:
    if c.method == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": c.group, "zero_point": True,
                "version": "gemm", "modules_to_not_convert": None}
    if c.method == "gptq":
        return {"quant_method": "gptq", "bits": 4, "group_size": c.group or -1,
                "desc_act": c.act, "sym": c.sym, "damp_percent": 0.01, "true_sequential": True,
                "static_groups": False, "lm_head": False, "model_name_or_path": None,
                "checkpoint_format": "gptq" if c.v1 else "gptq_v2",
                "meta": {"quantizer": ["gptqmodel:2.0.0"]}}
    weights = {"num_bits": 4, "type": "int", "symmetric": c.sym, "dynamic": False,
               "strategy": "group" if c.group else "channel", "group_size": c.group or None,
               "block_structure": None, "actorder": "group" if c.act else None,
               "observer": "minmax", "observer_kwargs": {}}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized",
            "quantization_status": "compressed", "global_compression_ratio": None,
            "kv_cache_scheme": None, "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": None, "output_activations": None,
                                          "format": "pack-quantized"}}}


def act_g_idx(k: int, group: int, seed: int) -> torch.Tensor:
    """GPTQ desc_act: columns quantized in a random order, group j = the j-th run of `group`."""
    order = torch.randperm(k, generator=torch.Generator().manual_seed(seed))
    g = torch.empty(k, dtype=torch.int64)
    g[order] = torch.arange(k) // group
    return g


def quantize(w: torch.Tensor, c: Case, g_idx: Optional[torch.Tensor], scale_dtype):
    """w (N, K) -> q (N, K), z (N, G) int64 and s (N, G) fp32 holding `scale_dtype` values:
    per-group min/max (asymmetric) or absmax (symmetric, z = 8) rounding."""
    n, k = w.shape
    group = c.group or k
    grp = g_idx if g_idx is not None else torch.arange(k) // group
    ng = -(-k // group)
    q = torch.zeros(n, k, dtype=torch.int64)
    z = torch.zeros(n, ng, dtype=torch.int64)
    s = torch.zeros(n, ng)
    lo_z = 1 if (c.method == "gptq" and c.v1) else 0  # v1 stores zero - 1: zero 0 is lost
    for g in range(ng):
        cols = grp == g
        wg = w[:, cols].float()
        if c.sym:
            sg = (wg.abs().amax(dim=1) / 7.5).clamp(min=1e-6)
            zg = torch.full((n,), 8, dtype=torch.int64)
        else:
            lo, hi = wg.amin(dim=1).clamp(max=0), wg.amax(dim=1).clamp(min=0)
            sg = ((hi - lo) / 15).clamp(min=1e-6)
            zg = (-lo / sg).round().clamp(lo_z, 15).long()
        sg = sg.to(scale_dtype).float()
        q[:, cols] = (wg / sg[:, None] + zg[:, None]).round().clamp(0, 15).long()
        z[:, g], s[:, g] = zg, sg
    return q, z, s


def dequantize(q, z, s, grp) -> torch.Tensor:
    return (q - z[:, grp]).float() * s[:, grp]


# --- packers: loops over the documented layouts ----------------------------------------------
def _words(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a.astype(np.uint32)).view(np.int32))


def pack_awq(v: torch.Tensor) -> torch.Tensor:
    """(R, C) -> (R, C/8) int32: nibble i of word c holds v[:, 8c + AWQ_ORDER[i]]."""
    v = v.numpy().astype(np.uint64)
    out = np.zeros((v.shape[0], v.shape[1] // 8), dtype=np.uint64)
    for c in range(out.shape[1]):
        for i in range(8):
            out[:, c] |= v[:, 8 * c + AWQ_ORDER[i]] << np.uint64(4 * i)
    return _words(out)


def pack_rows(v: torch.Tensor) -> torch.Tensor:
    """(R, C) -> (ceil(R/8), C) int32: nibble i of out[r] holds v[8r + i] (zero padded)."""
    v = v.numpy().astype(np.uint64)
    out = np.zeros((-(-v.shape[0] // 8), v.shape[1]), dtype=np.uint64)
    for r in range(v.shape[0]):
        out[r // 8] |= v[r] << np.uint64(4 * (r % 8))
    return _words(out)


def pack_cols(v: torch.Tensor) -> torch.Tensor:
    """(R, C) -> (R, ceil(C/8)) int32: nibble i of out[:, c] holds v[:, 8c + i]."""
    return pack_rows(v.t()).t().contiguous()


def pack(c: Case, q, z, s, g_idx, scale_dtype) -> dict[str, torch.Tensor]:
    """One layer's tensors (suffix -> tensor) in case `c`'s format; q (N, K), z / s (N, G)."""
    n, k = q.shape
    if c.method == "awq":
        return {"qweight": pack_awq(q.t()), "qzeros": pack_awq(z.t()),
                "scales": s.t().to(scale_dtype).contiguous()}
    if c.method == "gptq":
        group = c.group or k
        gi = g_idx if g_idx is not None else torch.arange(k) // group
        return {"qweight": pack_rows(q.t()), "qzeros": pack_cols(z.t() - (1 if c.v1 else 0)),
                "scales": s.t().to(scale_dtype).contiguous(), "g_idx": gi.to(torch.int32)}
    out = {"weight_packed": pack_cols(q), "weight_scale": s.to(scale_dtype),
           "weight_shape": torch.tensor([n, k], dtype=torch.int32)}
    if not c.sym:
        out["weight_zero_point"] = ((z - 8).to(torch.int8) if c.zp_int8 else pack_rows(z))
    if g_idx is not None:
        out["weight_g_idx"] = g_idx.to(torch.int32)
    return out


# --- the reference reading: one element at a time ---------------------------------------------
def _nib(word, i: int) -> int:
    return (int(word) & 0xFFFFFFFF) >> (4 * i) & 0xF


def ref_dequantize(c: Case, t: dict[str, torch.Tensor], n: int, k: int) -> torch.Tensor:
    """W (N, K) fp32 read element by element from the packed tensors `t` as the formats
    document them: W = (q - z) * s with the fp32 product rounded once."""
    group = c.group or k
    out = np.zeros((n, k), dtype=np.float32)
    int8_zp = t.get("weight_zero_point") is not None and t["weight_zero_point"].dtype == torch.int8
    t = {name: v.float().numpy() if v.is_floating_point() else v.numpy() for name, v in t.items()}
    sc = {name: v for name, v in t.items() if name in ("scales", "weight_scale")}
    gi = t.get("g_idx", t.get("weight_g_idx"))
    for nn_ in range(n):
        for kk in range(k):
            g = int(gi[kk]) if gi is not None else kk // group
            if c.method == "awq":
                pos = AWQ_ORDER.index(nn_ % 8)
                q = _nib(t["qweight"][kk, nn_ // 8], pos)
                z = _nib(t["qzeros"][g, nn_ // 8], pos)
                s = sc["scales"][g, nn_]
            elif c.method == "gptq":
                q = _nib(t["qweight"][kk // 8, nn_], kk % 8)
                z = _nib(t["qzeros"][g, nn_ // 8], nn_ % 8) + (1 if c.v1 else 0)
                s = sc["scales"][g, nn_]
            else:
                q = _nib(t["weight_packed"][nn_, kk // 8], kk % 8) - 8
                zp = t.get("weight_zero_point")
                z = (0 if zp is None else int(zp[nn_, g]) if int8_zp
                     else _nib(zp[nn_ // 8, g], nn_ % 8) - 8)
                s = sc["weight_scale"][nn_, g]
            out[nn_, kk] = np.float32(q - z) * np.float32(s)
    return torch.from_numpy(out)


# --- whole checkpoints ------------------------------------------------------------------------
LLAMA = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=256,
             hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, max_position_embeddings=512, rms_norm_eps=1e-5,
             rope_theta=10000.0, tie_word_embeddings=False, hidden_act="silu",
             bos_token_id=1, eos_token_id=2, torch_dtype="float32")


QWEN2 = dict(LLAMA, architectures=["Qwen2ForCausalLM"], model_type="qwen2",
             use_sliding_window=False)  # q/k/v biases


def tiny_llama(seed: int = 0, base: Optional[dict] = None, **kw
               ) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config.json dict, HF-named fp32 weights) of a random Llama (or `base`=QWEN2: with q/k/v
    biases): std 0.08 (peaked logits, as arch_parity.save_tiny), norms in [0.8, 1.2]. Written
    without transformers (its import alone costs seconds)."""
    cfg = {**(base or LLAMA), **kw}
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    q = cfg["num_attention_heads"] * cfg["head_dim"]
    kv = cfg["num_key_value_heads"] * cfg["head_dim"]
    g = torch.Generator().manual_seed(seed)
    w = lambda *shape: torch.randn(*shape, generator=g) * 0.08  # noqa: E731
    norm = lambda: torch.rand(h, generator=g) * 0.4 + 0.8  # noqa: E731
    sd = {"model.embed_tokens.weight": w(v, h), "model.norm.weight": norm(),
          "lm_head.weight": w(v, h)}
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        sd.update({p + "self_attn.q_proj.weight": w(q, h), p + "self_attn.k_proj.weight": w(kv, h),
                   p + "self_attn.v_proj.weight": w(kv, h), p + "self_attn.o_proj.weight": w(h, q),
                   p + "mlp.gate_proj.weight": w(i, h), p + "mlp.up_proj.weight": w(i, h),
                   p + "mlp.down_proj.weight": w(h, i), p + "input_layernorm.weight": norm(),
                   p + "post_attention_layernorm.weight": norm()})
        if cfg["model_type"] == "qwen2":
            sd.update({p + "self_attn.q_proj.bias": w(q), p + "self_attn.k_proj.bias": w(kv),
                       p + "self_attn.v_proj.bias": w(kv)})
    return cfg, sd


def _save(path: str, tensors: dict, cfg: dict) -> None:
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1, default=str)


def write_int4(model: tuple[dict, dict], path: str, c: Case, plain_path: Optional[str] = None,
               skip: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """Save `model` (tiny_llama's config and weights) to `path` with its projections in `c`'s int4
    format (those ending with one of `skip` stay fp32), and the dequantized weights as a plain
    fp32 checkpoint at `plain_path`. Returns the dequantized state dict."""
    scale_dtype = torch.bfloat16 if c.method == "ct" else torch.float16
    out, deq = {}, {}
    config, state = model
    for name, t in state.items():
        mod = name.removesuffix(".weight")
        kind = mod.split(".")[-1]
        if not name.endswith(".weight") or kind not in PROJ or mod.endswith(skip):
            out[name] = deq[name] = t.detach().clone().contiguous()
            continue
        n, k = t.shape
        layer = int(mod.split(".")[2])
        seed = 10 * layer + sorted(set(_INPUT.values())).index(_INPUT[kind])
        g_idx = act_g_idx(k, c.group or k, seed) if c.act else None
        q, z, s = quantize(t, c, g_idx, scale_dtype)
        for suffix, v in pack(c, q, z, s, g_idx, scale_dtype).items():
            out[f"{mod}.{suffix}"] = v
        grp = g_idx if g_idx is not None else torch.arange(k) // (c.group or k)
        deq[name] = dequantize(q, z, s, grp)
    cfg = dict(config)
    cfg["quantization_config"] = quantization_config(c)
    _save(path, out, cfg)
    if plain_path is not None:
        cfg.pop("quantization_config")
        _save(plain_path, deq, cfg)
    return deq


def set_quant(path: str, qcfg) -> None:
    """Rewrite config.json's quantization_config."""
    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = qcfg
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=1)
