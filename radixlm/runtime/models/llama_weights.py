"""LlamaForCausalLM's weights: HF-named checkpoint tensors into the fused parameters, and the
random weights of `--load-format dummy` (models/llama.py's load_weights / init_dummy_weights)."""

from __future__ import annotations

from typing import Iterable

import torch


def load(model, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy HF-named tensors into `model`; q/k/v and gate/up land in their slice of the fused
    weight. Raises on a tensor with no place, a shape that differs, or a parameter left unset."""
    cfg = model.cfg
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    fused = {
        "q_proj": ("qkv_proj", 0, q), "k_proj": ("qkv_proj", q, kv),
        "v_proj": ("qkv_proj", q + kv, kv),
        "gate_proj": ("gate_up_proj", 0, cfg.intermediate_size),
        "up_proj": ("gate_up_proj", cfg.intermediate_size, cfg.intermediate_size),
    }
    params = dict(model.named_parameters())
    shards: dict[str, set] = {n: set() for n in params}  # param -> HF pieces copied into it
    for name, tensor in weights:
        if "rotary_emb" in name:
            continue
        if name == "lm_head.weight" and model.lm_head is None:
            continue  # tied: the embedding is the head
        name = name.removeprefix("model.")
        parts = name.split(".")
        piece = parts[-2] if len(parts) >= 2 and parts[-2] in fused else None
        if piece is not None:
            target, offset, size = fused[piece]
            name = ".".join(parts[:-2] + [target, parts[-1]])
        if name not in params:
            raise KeyError(f"checkpoint tensor {name!r} has no place in {type(model).__name__}")
        dst = params[name].data if piece is None else params[name].data[offset : offset + size]
        if dst.shape != tensor.shape:
            raise ValueError(f"{name} ({piece or 'whole'}): checkpoint shape "
                             f"{tuple(tensor.shape)} != model shape {tuple(dst.shape)}")
        dst.copy_(tensor)
        shards[name].add(piece)
    expected = {"qkv_proj": {"q_proj", "k_proj", "v_proj"}, "gate_up_proj": {"gate_proj", "up_proj"}}
    missing = [n for n, got in shards.items()
               if got != expected.get(n.split(".")[-2], {None})]
    if missing:
        raise ValueError(f"checkpoint lacks tensors for: {missing[:8]}"
                         + (" ..." if len(missing) > 8 else ""))


def init_dummy(model, seed: int = 0) -> None:
    """Random weights with a scale that keeps activations sane: norms 1, biases 0, the rest
    N(0, 0.02), generated on the parameters' device."""
    g = None
    with torch.no_grad():
        for name, p in model.named_parameters():
            if g is None:  # generate on the parameters' device: 8B randn on a CPU is slow
                g = torch.Generator(device=p.device).manual_seed(seed)
            if name.endswith("layernorm.weight") or name == "norm.weight":
                p.fill_(1.0)
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.normal_(0.0, 0.02, generator=g)
