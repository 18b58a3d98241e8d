"""The EAGLE-3 head (SGLang's LlamaForCausalLMEagle3; EAGLE-3, Li et al. 2025): one decoder
layer that reads the target's features instead of its own lower layers.

Per row t (the draft's row for position t, predicting the token at t + 2):
  g_t     = fc(cat(low_t, mid_t, high_t))  (H,)  the target's three captured layers (3 * Ht ->
            H), or, deeper in a chain, the head's own pre-norm output of the row before
  x       = cat(input_layernorm(embed(x_{t+1})), hidden_norm(g_t))  (2H,)  embed: the target's
  h       = self_attn(x) (q/k/v read 2H) + g_t;  out = mlp(post_attention_layernorm(h)) + h
  logits  = lm_head(norm(out))  (draft_vocab,);  `out` (pre-norm) feeds the next chain row
A draft id d is target id d + d2t[d] (`hot`); the head's logits are placed at those columns of a
target-vocabulary row (`to_target`) so every sampling parameter, grammar mask and the rejection
sampler work on target ids, and q is 0 outside the draft vocabulary.

Checkpoint names (no prefix; a `model.` prefix is tolerated): fc.weight, midlayer.{input_layernorm,
hidden_norm,post_attention_layernorm}.weight, midlayer.self_attn.{q,k,v,o}_proj.weight,
midlayer.mlp.{gate,up,down}_proj.weight, norm.weight, lm_head.weight, d2t (int64, draft vocab),
t2d (bool, target vocab; optional, checked against d2t), embed_tokens.weight (optional and
unused: the target's embedding is the head's, as in SGLang).
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from radixlm.runtime.executor.forward_batch import ForwardBatch
from radixlm.runtime.layers.rotary import RotaryEmbedding
from radixlm.runtime.models.llama import MLP, Attention, Linear, RMSNorm
from radixlm.runtime.speculative.eagle3_config import Eagle3Config

# logits of target ids outside the draft vocabulary: finite, so a grammar that allows none of
# the draft's tokens still leaves a distribution (then over its allowed ids), yet exp() of it
# next to any real logit is exactly 0
OUTSIDE = -1e30


class MidLayer(nn.Module):
    def __init__(self, e: Eagle3Config):
        super().__init__()
        cfg, h = e.model, e.model.hidden_size
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, 0)  # layer 0 of the head's own one-layer pool
        attn = self.self_attn
        self.self_attn.qkv_proj = Linear(2 * h, attn.q_size + 2 * attn.kv_size, bias=False)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, emb, g, cos_sin, fb: ForwardBatch):
        """emb, g (T, H) -> (mlp output, residual) (T, H) each; the layer's output is their sum."""
        x = torch.cat([self.input_layernorm(emb), self.hidden_norm(g)], dim=-1)  # (T, 2H)
        h = self.self_attn(x, cos_sin, fb)
        h, residual = self.post_attention_layernorm(h, g)
        return self.mlp(h), residual


class Eagle3Head(nn.Module):
    def __init__(self, e: Eagle3Config, max_positions: int):
        super().__init__()
        cfg, h = e.model, e.model.hidden_size
        self.e = e
        self.fc = Linear(e.fc_in, h, bias=False)
        self.midlayer = MidLayer(e)
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.lm_head = Linear(h, e.draft_vocab, bias=False)
        # the head's rotary over the target's context (its config's max_position_embeddings may
        # be shorter: Llama-3.1's head says 2048)
        self.rope = RotaryEmbedding(cfg.head_dim, max(max_positions, cfg.max_position_embeddings),
                                    cfg.rope_theta, cfg.rope_scaling)
        self.register_buffer("hot", torch.arange(e.draft_vocab))  # (Vd,) draft id -> target id
        self.embed: Optional[torch.Tensor] = None  # (V, H) the target's embed_tokens.weight

    def project(self, aux: torch.Tensor) -> torch.Tensor:
        """(T, 3 * Ht) target features -> (T, H) the head's g rows."""
        return self.fc(aux.to(self.fc.weight.dtype))

    def forward(self, fb: ForwardBatch, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """fb: the head's batch (input_ids: the next tokens, positions, slots in its pool), g
        (T, H) -> (normed, pre-norm) (N, H) of the rows fb.logits_indices."""
        emb = F.embedding(fb.input_ids, self.embed)  # (T, H)
        x, residual = self.midlayer(emb, g, self.rope(fb.positions), fb)
        idx = fb.logits_indices
        return self.norm(x[idx], residual[idx])  # (norm(x + residual), x + residual)

    def logits(self, normed: torch.Tensor) -> torch.Tensor:
        """(N, H) -> (N, draft_vocab) float32."""
        return self.lm_head(normed).float()

    def to_target(self, logits: torch.Tensor, vocab: int) -> torch.Tensor:
        """(N, Vd) draft logits -> (N, V) target-vocabulary logits: column hot[d] holds draft d,
        every other column OUTSIDE (its probability 0 after any softmax that has a draft id)."""
        out = logits.new_full((logits.shape[0], vocab), OUTSIDE)
        out[:, self.hot] = logits
        return out

    # --- weights --------------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], vocab: int,
                     hidden: int) -> None:
        """Copy the checkpoint's tensors in (q/k/v and gate/up into their fused slices); any
        unknown, misshapen or missing tensor raises ValueError naming it."""
        a, c = self.midlayer.self_attn, self.e.model
        fused = {"q_proj": ("qkv_proj", 0, a.q_size), "k_proj": ("qkv_proj", a.q_size, a.kv_size),
                 "v_proj": ("qkv_proj", a.q_size + a.kv_size, a.kv_size),
                 "gate_proj": ("gate_up_proj", 0, c.intermediate_size),
                 "up_proj": ("gate_up_proj", c.intermediate_size, c.intermediate_size)}
        params = dict(self.named_parameters())
        want = {n for n in params}
        got: set[str] = set()
        d2t = t2d = None
        for name, t in weights:
            name = name.removeprefix("model.")
            if name == "d2t":
                d2t = _check(name, t, (self.e.draft_vocab,))
                continue
            if name == "t2d":
                t2d = _check(name, t, (vocab,))
                continue
            if name == "embed_tokens.weight":  # the target's embedding serves (SGLang's too)
                _check(name, t, (vocab, hidden))
                continue
            parts = name.split(".")
            piece = parts[-2] if len(parts) >= 2 and parts[-2] in fused else None
            target, dst = name, None
            if piece is not None:
                fused_name, off, size = fused[piece]
                target = ".".join(parts[:-2] + [fused_name, parts[-1]])
                if target in params:
                    dst = params[target].data[off : off + size]
            elif name in params:
                dst = params[name].data
            if dst is None:
                raise ValueError(f"EAGLE-3 checkpoint tensor {name!r} has no place in the head")
            dst.copy_(_check(name, t, tuple(dst.shape)))
            got.add(name)
        expect = {n for n in want if not n.endswith(("qkv_proj.weight", "gate_up_proj.weight"))}
        expect |= {n.replace("qkv_proj", p) for n in want if "qkv_proj" in n
                   for p in ("q_proj", "k_proj", "v_proj")}
        expect |= {n.replace("gate_up_proj", p) for n in want if "gate_up_proj" in n
                   for p in ("gate_proj", "up_proj")}
        missing = sorted(expect - got)
        if d2t is None and self.e.draft_vocab < vocab:
            missing.append("d2t")
        if missing:
            raise ValueError(f"EAGLE-3 checkpoint lacks tensors: {missing}")
        if d2t is not None:
            self.set_mapping(d2t.to(torch.int64), t2d, vocab)

    def set_mapping(self, d2t: torch.Tensor, t2d: Optional[torch.Tensor], vocab: int) -> None:
        """hot = arange + d2t (draft id -> target id), checked: ids in the target vocabulary,
        distinct, and the ones t2d marks (when given)."""
        hot = torch.arange(d2t.shape[0], dtype=torch.int64) + d2t.cpu()
        if hot.min() < 0 or hot.max() >= vocab or hot.unique().numel() != hot.numel():
            raise ValueError("EAGLE-3 checkpoint tensor 'd2t' maps draft ids outside the target "
                             "vocabulary or two draft ids to one target id")
        if t2d is not None:
            mask = t2d.cpu().bool()
            if int(mask.sum()) != hot.numel() or not bool(mask[hot].all()):
                raise ValueError("EAGLE-3 checkpoint tensors 't2d' and 'd2t' disagree (t2d must "
                                 "mark exactly the target ids d + d2t[d])")
        self.hot.copy_(hot.to(self.hot.device))

    def init_dummy_weights(self, seed: int = 0) -> None:
        """Random weights (`--load-format dummy`); draft id d is target id d."""
        g = None
        with torch.no_grad():
            for name, p in self.named_parameters():
                if g is None:
                    g = torch.Generator(device=p.device).manual_seed(seed)
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                else:
                    p.normal_(0.0, 0.02, generator=g)


def _check(name: str, t: torch.Tensor, shape: tuple) -> torch.Tensor:
    if tuple(t.shape) != shape:
        raise ValueError(f"EAGLE-3 checkpoint tensor {name!r}: shape {tuple(t.shape)}, the head "
                         f"needs {shape}")
    return t


def build_head(e: Eagle3Config, path: str, fmt: str, embed: torch.Tensor, dtype: torch.dtype,
               device: torch.device, max_positions: int, seed: int) -> Eagle3Head:
    """The head on `device` in `dtype`, its weights from `path` (or random with fmt dummy), its
    embedding `embed` (vocab, hidden): the target model's whole table."""
    from radixlm.runtime.models import loader

    with torch.device("meta"):
        head = Eagle3Head(e, max_positions)
    head = head.to(dtype)
    head = head._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))
    head.rope.reset(device)
    head.hot.copy_(torch.arange(e.draft_vocab, device=device))
    vocab, hidden = e.model.vocab_size, e.model.hidden_size
    if fmt == "dummy":
        head.init_dummy_weights(seed)
    else:
        head.load_weights(loader.iter_weights(path, fmt, dtype), vocab, hidden)
    head.eval().requires_grad_(False)
    if tuple(embed.shape) != (vocab, hidden):
        raise ValueError(f"speculative_draft_model_path: the target's embedding "
                         f"{tuple(embed.shape)} cannot serve the head (vocab {vocab}, hidden "
                         f"{hidden})")
    head.embed = embed
    return head
