"""Tiny random checkpoints for tests whose checks hold for any model (routing, TP plumbing,
process life cycle): a forward costs microseconds instead of SmolLM2's milliseconds.

`write_tiny_llama` writes config.json + model.safetensors; `write_tiny_chat_model` adds the bundled
SmolLM2's tokenizer (vocab 49152, chat template), so text prompts, the chat routes and stop
strings work as with the bundled model, only the (random) tokens differ."""

from __future__ import annotations

import json
import os

import torch


def write_tiny_llama(path: str, *, vocab: int, heads: int, kv_heads: int, tied: bool,
                     bias: bool = False, hidden: int = 64, inter: int = 96, layers: int = 2,
                     seed: int = 0, arch: str = "llama") -> str:
    """config.json + model.safetensors of a random Llama (std 0.08: peaked logits, no ties).
    arch "qwen3": per-head q/k norms; "phi3": fused qkv / gate_up tensors in the file, rotary on
    half of each head, an 8-token sliding window."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    d = hidden // heads
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab,
           "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers,
           "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": d,
           "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 512,
           "tie_word_embeddings": tied, "attention_bias": bias}
    if arch == "qwen3":
        cfg.update(architectures=["Qwen3ForCausalLM"], model_type="qwen3")
    elif arch == "phi3":
        cfg.update(architectures=["Phi3ForCausalLM"], model_type="phi3", sliding_window=8,
                   partial_rotary_factor=0.5, original_max_position_embeddings=512)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *shape: torch.randn(*shape, generator=g) * 0.08  # noqa: E731
    w = {"model.embed_tokens.weight": rnd(vocab, hidden), "model.norm.weight": 1 + rnd(hidden)}
    if not tied:
        w["lm_head.weight"] = rnd(vocab, hidden)
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes = {"self_attn.q_proj": (heads * d, hidden), "self_attn.k_proj": (kv_heads * d, hidden),
                  "self_attn.v_proj": (kv_heads * d, hidden), "self_attn.o_proj": (hidden, heads * d),
                  "mlp.gate_proj": (inter, hidden), "mlp.up_proj": (inter, hidden),
                  "mlp.down_proj": (hidden, inter)}
        for name, shape in shapes.items():
            w[p + name + ".weight"] = rnd(*shape)
            if bias and name.startswith("self_attn"):
                w[p + name + ".bias"] = rnd(shape[0])
        if arch == "qwen3":
            w[p + "self_attn.q_norm.weight"] = 1 + rnd(d)
            w[p + "self_attn.k_norm.weight"] = 1 + rnd(d)
        if arch == "phi3":  # Phi-3 checkpoints hold the fused tensors
            for fused, parts in (("self_attn.qkv_proj", ("q", "k", "v")),
                                 ("mlp.gate_up_proj", ("gate", "up"))):
                prefix = fused.split(".")[0]
                w[p + fused + ".weight"] = torch.cat(
                    [w.pop(f"{p}{prefix}.{x}_proj.weight") for x in parts])
        w[p + "input_layernorm.weight"] = 1 + rnd(hidden)
        w[p + "post_attention_layernorm.weight"] = 1 + rnd(hidden)
    save_file({k: v.contiguous() for k, v in w.items()}, os.path.join(path, "model.safetensors"))
    return path


def write_tiny_chat_model(path: str, *, seed: int = 0) -> str:
    """A random Llama on SmolLM2's tokenizer (the bundled GGUF's, or the saved folder named by
    RADIXLM_TEST_TOKENIZER on machines without it): 6 query heads over 3 KV heads (SmolLM2's 3 KV heads
    split 2 + 1 under TP=2 here too), hidden 96, 2 layers, tied embeddings."""
    from radixlm.runtime.models import loader

    folder = os.environ.get("RADIXLM_TEST_TOKENIZER")  # a saved copy: GPU machines lack the GGUF
    tok = (loader.load_tokenizer(folder, "auto") if folder
           else loader.load_tokenizer(loader.default_model_path(), "gguf"))
    tok.save_pretrained(path)
    write_tiny_llama(path, vocab=49152, heads=6, kv_heads=3, tied=True, hidden=96, inter=192,
                     seed=seed)
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg.update(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
               max_position_embeddings=2048)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return path


def write_tiny_eagle3(path: str, *, vocab: int, hidden: int = 64, heads: int = 4, kv_heads: int = 2,
                      inter: int = 96, draft_vocab: int = 0, aux_layers=None, seed: int = 1,
                      hot=None, t2d: bool = True, drop=(), reshape=None) -> str:
    """config.json + model.safetensors of a random EAGLE-3 head (LlamaForCausalLMEagle3) for a
    target of `vocab` tokens and width `hidden`. `draft_vocab` (0: vocab) rows of lm_head; `hot`
    the target ids of the draft ids (increasing; default: every other id from 1), stored as
    d2t = hot - arange and t2d; `aux_layers` its eagle_config layer ids (None: SGLang's default).
    For loader tests: `drop` names tensors to leave out, `reshape` {name: shape} to misshape."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    d, dv = hidden // heads, draft_vocab or vocab
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "vocab_size": vocab,
           "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": 1,
           "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": d,
           "rms_norm_eps": 1e-5, "max_position_embeddings": 256, "tie_word_embeddings": False,
           "draft_vocab_size": dv}
    if aux_layers is not None:
        cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(aux_layers),
                               "use_aux_hidden_state": True}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *shape: torch.randn(*shape, generator=g) * 0.08  # noqa: E731
    m = "midlayer."
    w = {"fc.weight": rnd(hidden, 3 * hidden), m + "input_layernorm.weight": 1 + rnd(hidden),
         m + "hidden_norm.weight": 1 + rnd(hidden),
         m + "self_attn.q_proj.weight": rnd(heads * d, 2 * hidden),
         m + "self_attn.k_proj.weight": rnd(kv_heads * d, 2 * hidden),
         m + "self_attn.v_proj.weight": rnd(kv_heads * d, 2 * hidden),
         m + "self_attn.o_proj.weight": rnd(hidden, heads * d),
         m + "post_attention_layernorm.weight": 1 + rnd(hidden),
         m + "mlp.gate_proj.weight": rnd(inter, hidden),
         m + "mlp.up_proj.weight": rnd(inter, hidden),
         m + "mlp.down_proj.weight": rnd(hidden, inter), "norm.weight": 1 + rnd(hidden),
         "lm_head.weight": rnd(dv, hidden)}
    ids = torch.tensor(hot if hot is not None else range(1, 2 * dv, 2)[:dv], dtype=torch.int64)
    if dv < vocab or hot is not None:
        w["d2t"] = ids - torch.arange(dv)
        if t2d:
            w["t2d"] = torch.zeros(vocab, dtype=torch.bool).index_fill_(0, ids, True)
    for name in drop:
        w.pop(name)
    for name, shape in (reshape or {}).items():
        w[name] = rnd(*shape)
    save_file({k: v.contiguous() for k, v in w.items()}, os.path.join(path, "model.safetensors"))
    return path
