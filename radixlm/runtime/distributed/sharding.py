"""shard_model: a loaded Llama-family model -> its tensor-parallel rank's shard, in place.

Runs after the full weights are loaded (every rank reads the whole checkpoint, keeps its piece:
simple, and the peak is one full model per rank while sharding; a per-rank loader is later work).
llama.py's classes are not edited: the projections are swapped for their rank's slices
(layers/parallel_linear) and each attention / MLP gets its local sizes:
- attention: whole GQA groups per rank when hkv >= tp (`head_split`), else hq/tp q heads and
  the one KV head they read (replicated on tp/hkv ranks). qkv_proj: column parallel over those
  heads' q, k, v rows; o_proj: row parallel.
- MLP: gate_up_proj column parallel (the rank's slice of gate, then of up), down_proj row parallel.
- embedding: vocab parallel; LM head (tied or not): vocab-split rows, logits all-gathered.
Supported: LlamaForCausalLM (Llama, Mistral, Qwen2), Qwen3ForCausalLM, Phi3ForCausalLM; other
families (Gemma, MoE, LLaVA) are refused with the reason.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from radixlm.runtime.config import ModelConfig
from radixlm.runtime.distributed.parallel_state import TPGroup
from radixlm.runtime.layers import parallel_linear as pl

SUPPORTED = ("LlamaForCausalLM", "Qwen3ForCausalLM", "Phi3ForCausalLM")


def check_tp_supported(cfg: ModelConfig, tp_size: int, model_cls_name: str = "") -> None:
    """Raise ValueError naming why `cfg` cannot be split over `tp_size` ranks."""
    if tp_size == 1:
        return
    if model_cls_name and model_cls_name not in SUPPORTED:
        raise ValueError(f"tensor parallelism (tp_size={tp_size}) supports {', '.join(SUPPORTED)}; "
                         f"{cfg.architecture} runs as {model_cls_name}, which has no TP sharding yet")
    hq, hkv, inter = cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size
    if hq % hkv:
        raise ValueError(f"num_attention_heads={hq} is not a multiple of num_key_value_heads={hkv}")
    if hkv < tp_size and (tp_size % hkv or hq % tp_size):
        raise ValueError(f"tp_size={tp_size} > num_key_value_heads={hkv}: KV heads are replicated, "
                         f"which needs tp_size to be a multiple of {hkv} and to divide "
                         f"num_attention_heads={hq}")
    if inter % tp_size:
        raise ValueError(f"tp_size={tp_size} must divide intermediate_size={inter}")


def head_split(cfg: ModelConfig, tp_size: int, rank: int) -> tuple[int, int, int, int]:
    """(q_first, q_count, kv_first, kv_count): the q and KV heads rank `rank` holds.
    hkv >= tp: whole GQA groups (a KV head and its hq/hkv q heads), contiguous, as even as they
    go (SmolLM2's 3 KV heads over 2 ranks: 2 groups on rank 0, 1 on rank 1; SGLang refuses
    such splits, but each rank's heads are still whole groups so every kernel runs them as is).
    hkv < tp: hq/tp q heads each, and the one KV head they read (replicated on tp/hkv ranks)."""
    hq, hkv = cfg.num_heads, cfg.num_kv_heads
    if hkv >= tp_size:
        g = hq // hkv
        base, extra = divmod(hkv, tp_size)
        kv_count = base + (rank < extra)
        kv_first = rank * base + min(rank, extra)
        return kv_first * g, kv_count * g, kv_first, kv_count
    q_count = hq // tp_size
    return rank * q_count, q_count, rank // (tp_size // hkv), 1


def local_kv_heads(cfg: ModelConfig, tp_size: int, rank: int) -> int:
    """KV heads rank `rank` holds (and its KV pool stores)."""
    return head_split(cfg, tp_size, rank)[3] if tp_size > 1 else cfg.num_kv_heads


def _head_rows(first: int, count: int, d: int, offset: int = 0) -> slice:
    return slice(offset + first * d, offset + (first + count) * d)


def _shard_attention(attn: nn.Module, cfg: ModelConfig, tp: TPGroup) -> None:
    d = attn.d
    q_first, q_local, kv_first, kv_local = head_split(cfg, tp.size, tp.rank)
    q_size, kv_size = attn.hq * d, attn.hkv * d
    attn.qkv_proj = pl.column_parallel(attn.qkv_proj, [
        _head_rows(q_first, q_local, d),
        _head_rows(kv_first, kv_local, d, q_size),
        _head_rows(kv_first, kv_local, d, q_size + kv_size)])
    attn.o_proj = pl.RowParallelLinear(attn.o_proj, _head_rows(q_first, q_local, d), tp)
    attn.hq, attn.hkv = q_local, kv_local
    attn.q_size, attn.kv_size = q_local * d, kv_local * d


def _shard_mlp(mlp: nn.Module, tp: TPGroup) -> None:
    inter = mlp.inter
    local = inter // tp.size
    mine = slice(tp.rank * local, (tp.rank + 1) * local)
    up = slice(inter + mine.start, inter + mine.stop)
    mlp.gate_up_proj = pl.column_parallel(mlp.gate_up_proj, [mine, up])
    mlp.down_proj = pl.RowParallelLinear(mlp.down_proj, mine, tp)
    mlp.inter = local


def _compute_logits(model: nn.Module, base, vocab: int, tp: TPGroup,
                    hidden: torch.Tensor) -> torch.Tensor:
    """The class's compute_logits over the rank's head rows (N, per), gathered to (N, vocab)."""
    return pl.gather_logits(base(model, hidden), vocab, tp)


def shard_model(model: nn.Module, tp: TPGroup) -> nn.Module:
    """Turn a loaded (eval, no-grad) model into rank tp.rank's shard of tp.size, in place."""
    from radixlm.runtime.models import llama  # the model classes import nothing from here

    if tp.size == 1:
        return model
    cfg: ModelConfig = model.cfg
    check_tp_supported(cfg, tp.size, type(model).__name__)
    for i, layer in enumerate(model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        if not isinstance(attn, llama.Attention) or type(mlp) is not llama.MLP:
            raise ValueError(f"layer {i}: {type(attn).__name__} / {type(mlp).__name__} have no "
                             "TP sharding (llama.Attention subclasses and llama.MLP only)")
        _shard_attention(attn, cfg, tp)
        _shard_mlp(mlp, tp)
    vocab = cfg.vocab_size
    # the head rows first: a tied head is the embedding table, read before it is replaced
    if model.lm_head is not None:
        w = pl.vocab_shard(model.lm_head.weight.detach(), vocab, tp)
        model.lm_head = pl._sliced_copy(model.lm_head, w, None)
    if model.lm_head_fp32 is not None:  # layers/cpu_linear ran first: its fp32 head, split too
        model.lm_head_fp32 = (model.lm_head.weight.detach() if model.lm_head is not None
                              else pl.vocab_shard(model.lm_head_fp32, vocab, tp))
    model.embed_tokens = pl.VocabParallelEmbedding(model.embed_tokens, vocab, tp)
    # compute_logits stays the class's (fp32 head, CUDA GEMV...) over the rank's head rows; the
    # instance attribute adds the gather (N, per) -> (N, vocab) without editing llama.py
    model.compute_logits = functools.partial(_compute_logits, model,
                                             type(model).compute_logits, vocab, tp)
    model.tp_group = tp
    return model
