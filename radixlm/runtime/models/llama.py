"""The Llama family (Llama 2/3, SmolLM2, Mistral, Qwen2) in plain torch.

The model sees a flat batch: T new tokens from B requests concatenated, with their positions; all
history lives in the KV pool and is reached through the attention backend (`fb`). Q/K/V and
gate/up projections are fused into one matmul each (fewer, larger GEMMs); `load_weights` maps the
HF checkpoint names onto the fused parameters.
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from radixlm.runtime.attention.base import AttentionSpec
from radixlm.runtime.config import ModelConfig
from radixlm.runtime.executor.forward_batch import ForwardBatch, ForwardMode
from radixlm.runtime.layers import cpu_fused, cpu_layer_stack, cpu_linear, cpu_packed
from radixlm.runtime.layers.rotary import RotaryEmbedding, apply_rotary
from radixlm.runtime.models import llama_weights, two_batch_overlap
from radixlm.runtime.models.sliding_windows import layer_windows


def _fused_ops(x: torch.Tensor):
    """One fused kernel per norm / rotary / SiLU-and-mul: layers/triton_ops for CUDA tensors,
    layers/cpu_fused (C++) for CPU tensors, None where neither runs (the torch ops below then).
    The CPU path never imports triton."""
    if not x.is_cuda:
        return cpu_fused if cpu_fused.usable(x) else None
    from radixlm.runtime.layers import triton_ops

    return triton_ops if triton_ops.ENABLED else None


def _defined_by(cls: type, name: str) -> type:
    """The class in cls's MRO whose body defines `name`."""
    return next(c for c in cls.__mro__ if name in c.__dict__)


def _gemv(x: torch.Tensor):
    """layers/triton_gemv for a CUDA input of 1-16 rows (small decode batches, a verify's
    rows; it picks the kernel by the row count and shape), None elsewhere."""
    if not x.is_cuda or x.shape[0] > 16:
        return None
    from radixlm.runtime.layers import triton_gemv

    return triton_gemv if triton_gemv.ENABLED else None


class Linear(nn.Linear):
    """nn.Linear whose CUDA calls of 1-16 rows go through layers/triton_gemv.linear: a small
    batch streams every weight once per step, and for the shapes tuned there the Triton GEMV (one
    row) and few-row kernel (layers/triton_skinny) stream faster than cuBLAS (untuned shapes
    still run cuBLAS)."""

    def reset_parameters(self) -> None:
        # as Embedding's below: kaiming_uniform_ on meta runs torch's Python decompositions
        # (0.2 s of SmolLM2's warm Engine() for its 120 layers, 2026-11-27), values overwritten
        if not self.weight.is_meta:
            super().reset_parameters()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gemv = _gemv(x)
        if gemv is not None:
            return gemv.linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


class Embedding(nn.Embedding):
    """nn.Embedding minus its random init on the meta device (ModelRunner builds the model
    there): normal_ on meta runs through torch's Python reference decompositions, which import
    torch._dynamo (seconds of start-up), for values the checkpoint overwrites anyway."""

    def reset_parameters(self) -> None:
        if not self.weight.is_meta:
            super().reset_parameters()


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        """norm(x); with `residual`: s = x + residual, returns (norm(s), s)."""
        ops = _fused_ops(x)
        if ops is not None and (x.is_cuda or self.weight.dtype == x.dtype):
            return ops.rmsnorm(x, self.weight, self.eps, residual)
        if residual is not None:
            x = x + residual
            return self._norm(x), x
        return self._norm(x)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.hq, self.hkv, self.d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = self.hq * self.d, self.hkv * self.d
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size,
                               bias=cfg.attention_bias)
        # HF's Llama puts attention_bias on o_proj too; Qwen2 (attention_bias set from its model
        # type) has biases on q/k/v only
        self.o_proj = Linear(self.q_size, cfg.hidden_size,
                             bias=cfg.attention_bias and cfg.hf.get("model_type") != "qwen2")

    def forward(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor],
                fb: ForwardBatch, project: bool = True) -> torch.Tensor:
        """(T, hidden) -> (T, hidden); project=False: the attention output before o_proj
        (T, q_size) (two-batch overlap projects it half by half)."""
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        ops = _fused_ops(qkv)
        backend = fb.attn_backend
        # (CUDA only: the CPU fused ops have no KV store; the triton backend under the Triton
        # interpreter on the CPU gets its K/V passed as usual)
        if ops is not None and qkv.is_cuda and getattr(backend, "accepts_stored_kv", False):
            k_buf = backend.kv_pool.k_buffers[self.layer_id]
            if k_buf.dtype == qkv.dtype:
                # one launch rotates q and k in place and writes k and v into the pool; the
                # backend is told (k = v = None) that the new tokens' K/V are already stored
                ops.rotary_store_kv(qkv.view(t, self.hq + 2 * self.hkv, self.d), *cos_sin,
                                    self.hq, self.hkv, k_buf,
                                    backend.kv_pool.v_buffers[self.layer_id], fb.out_cache_loc)
                q = qkv[:, : self.q_size].view(t, self.hq, self.d)
                o = backend.forward(q, None, None, self.layer_id, fb).reshape(t, self.q_size)
                return self.o_proj(o) if project else o
        q, k, v = self._rotated_qkv(qkv, ops, cos_sin)
        o = fb.attn_backend.forward(q, k, v, self.layer_id, fb).reshape(t, self.q_size)
        return self.o_proj(o) if project else o

    def forward_rows(self, x: torch.Tensor, cos_sin, fb: ForwardBatch,
                     rows: torch.Tensor) -> torch.Tensor:
        """The attention output (after o_proj) of the rows `rows` only; every row's K/V is
        stored (the backend's forward_rows). (R, hidden)."""
        qkv = self.qkv_proj(x)
        q, k, v = self._rotated_qkv(qkv, _fused_ops(qkv), cos_sin)
        o = fb.attn_backend.forward_rows(q[rows], k, v, self.layer_id, fb, rows)
        return self.o_proj(o.reshape(rows.shape[0], self.q_size))

    def _rotated_qkv(self, qkv: torch.Tensor, ops, cos_sin):
        """q (t, hq, d), k (t, hkv, d) rotated, v (t, hkv, d): views of qkv's rows."""
        t = qkv.shape[0]
        if ops is not None:  # q and k heads are adjacent in each qkv row: one in-place launch
            ops.rotary_inplace(qkv[:, : self.q_size + self.kv_size].view(t, self.hq + self.hkv,
                                                                          self.d), *cos_sin)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = q.view(t, self.hq, self.d), k.view(t, self.hkv, self.d)
        if ops is None and not qkv.is_cuda:
            # CPU: one rotary over the adjacent q and k heads (half the small ops of a decode
            # step's rotary); q (t, hq, d) and k (t, hkv, d) stay views of it, row stride
            # (hq + hkv) * d, which the CPU and torch_native backends read as they are
            qk = apply_rotary(qkv[:, : self.q_size + self.kv_size].view(t, self.hq + self.hkv, self.d),
                              *cos_sin)
            q, k = qk[:, : self.hq], qk[:, self.hq :]
        elif ops is None:
            q, k = apply_rotary(q, *cos_sin), apply_rotary(k, *cos_sin)
        return q, k, v.view(t, self.hkv, self.d)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.inter = cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * self.inter, bias=False)
        self.down_proj = Linear(self.inter, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gemv = _gemv(x)
        # batch-1 decode: the SiLU-and-mul runs in the GEMV's epilogue (a dense weight only: an
        # int4 or FP8 projection has its own kernel)
        if gemv is not None and isinstance(self.gate_up_proj, Linear):
            h = gemv.gate_up_silu(x, self.gate_up_proj.weight)
            if h is not None:
                return self.down_proj(h)
        fused = getattr(self.gate_up_proj, "gate_up_silu", None)  # an int4 layer's own GEMV
        if fused is not None:
            h = fused(x)
            if h is not None:
                return self.down_proj(h)
        h = cpu_packed.silu_linear(x, self.gate_up_proj)  # the CPU GEMM's SiLU epilogue
        if h is not None:
            return self.down_proj(h)
        gate_up = self.gate_up_proj(x)
        ops = _fused_ops(gate_up)
        if ops is not None:
            return self.down_proj(ops.silu_and_mul(gate_up))
        gate, up = gate_up.split(self.inter, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_id)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos_sin, fb, residual=None):
        """Returns (h, residual): the layer's output is h + residual. Carrying the residual
        stream separately lets each residual add fuse into the next norm (one kernel on CUDA)."""
        if residual is None:
            h = self.input_layernorm(x)
            residual = x
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, cos_sin, fb)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual

    def forward_rows(self, x, cos_sin, fb, residual, rows):
        """forward() for the rows `rows` only (every row's K/V still reaches the pool): the last
        layer, whose other rows no logit needs. Returns (h, residual) of those rows."""
        if residual is None:
            h = self.input_layernorm(x)
            residual = x
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn.forward_rows(h, cos_sin, fb, rows)
        h, residual = self.post_attention_layernorm(h, residual[rows])
        return self.mlp(h), residual


def run_capturing(layers, capture: tuple, x: torch.Tensor, cos_sin, fb: ForwardBatch):
    """The layer loop keeping, for every row, the hidden state after each layer in `capture`
    (x + residual, 0-based layer ids; EAGLE-3's low / middle / high features). Returns (x,
    residual, aux (T, len(capture) * hidden)). Only a speculator asks (fb.capture_layers): the
    plain path keeps its pruned last layer and its C++ stack."""
    residual = None
    kept: dict[int, torch.Tensor] = {}
    for i, layer in enumerate(layers):
        x, residual = layer(x, cos_sin, fb, residual)
        if i in capture:
            kept[i] = x + residual  # (T, hidden)
    return x, residual, torch.cat([kept[i] for i in capture], dim=-1)


# the C++ layer stack (layers/cpu_layer_stack.py) runs layers whose code is exactly this file's
cpu_layer_stack.accept(decoder=DecoderLayer.forward, attention=Attention.forward,
                       mlp=MLP.forward, norm=RMSNorm)


class LlamaForCausalLM(nn.Module):
    # (vocab, hidden) fp32 head when layers/cpu_linear.convert_model ran (bf16 on an AVX2 CPU)
    lm_head_fp32: Optional[torch.Tensor] = None
    # the dense head prepacked for oneDNN (layers/cpu_packed; bf16 on CPUs with bf16 matmul)
    lm_head_packed: Optional[torch.Tensor] = None
    # the TP group when --enable-two-batch-overlap (models/two_batch_overlap.py), else None
    two_batch_overlap = None

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(
            cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta,
                                    cfg.rope_scaling)
        # the LM head as GGUF blocks (layers/quantized_linear.py), when the weights stay quantized
        self.lm_head_quant: Optional[nn.Module] = None
        # with dense rows kept too: more hidden rows than this take the dense head
        self.lm_head_dense_above: Optional[int] = None

    def supports_two_batch_overlap(self) -> bool:
        """Every layer is this file's (models/two_batch_overlap.py runs their pieces), its
        o_proj and down_proj row-parallel without a bias."""
        return all(type(layer) is DecoderLayer and type(layer.self_attn) is Attention
                   and type(layer.mlp) is MLP
                   and two_batch_overlap.row_parallel(layer.self_attn.o_proj)
                   and two_batch_overlap.row_parallel(layer.mlp.down_proj)
                   for layer in self.layers)

    @staticmethod
    def check_supported(cfg: ModelConfig, context_len: int) -> None:
        layer_windows(cfg)  # raises on layer types it cannot run

    @staticmethod
    def attention_spec(cfg: ModelConfig) -> AttentionSpec:
        """Scale head_dim**-0.5; Mistral / Qwen2 sliding windows per layer (every attention
        backend runs them: keys outside (p - window, p] are skipped, the KV is all kept)."""
        windows = layer_windows(cfg)
        return AttentionSpec(scale=cfg.head_dim ** -0.5,
                             windows=windows if any(w is not None for w in windows) else ())

    def to_empty(self, *, device, recurse: bool = True) -> "LlamaForCausalLM":
        """nn.Module.to_empty, allocating with torch.empty(shape): torch's own calls empty_like
        on the meta tensors, whose Python reference decomposition imports sympy and torch.fx
        (1-3 s of start-up) to work out strides that are contiguous anyway."""
        return self._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device),
                           recurse=recurse)

    def forward(self, fb: ForwardBatch, input_embeds: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Returns final hidden states of the rows `fb.logits_indices`: (N, hidden).
        `input_embeds` (T, hidden): used instead of the token embeddings (LLaVA's image rows)."""
        x = self.embed_tokens(fb.input_ids) if input_embeds is None else input_embeds  # (T, hidden)
        cos_sin = self.rope(fb.positions)  # (T, 1, head_dim) each
        residual = None
        idx = fb.logits_indices
        if fb.capture_layers:  # EAGLE-3's target: every row of every layer, in Python
            x, residual, fb.aux_hidden = run_capturing(self.layers, fb.capture_layers, x,
                                                       cos_sin, fb)
            return self.norm(x.index_select(0, idx), residual.index_select(0, idx))[0]
        last = self.layers[-1]
        # an EXTEND batch's last layer runs only its logits rows past the K/V projection (the
        # prompt rows before each request's last need their K/V, nothing after): SmolLM2's 30
        # layers spend ~3% of a prefill's FLOPs there. Where the backend can (cpu: decode queries)
        # (an attention class whose forward and forward_rows are not defined together, e.g.
        # Phi-3's partial rotary, or a layer's own forward keeps all rows)
        prune = (fb.mode != ForwardMode.DECODE and idx.shape[0] < fb.input_ids.shape[0]
                 and hasattr(fb.attn_backend, "forward_rows")
                 and type(last).forward is DecoderLayer.forward
                 and _defined_by(type(last.self_attn), "forward")
                 is _defined_by(type(last.self_attn), "forward_rows"))
        run = self.layers[:-1] if prune else self.layers
        tbo = (self.two_batch_overlap is not None
               and two_batch_overlap.applies(fb, x.shape[0]))
        # (it checks each layer's classes: a subclass's own layer code runs in Python)
        stacked = None if tbo else cpu_layer_stack.run(self, run, x, cos_sin, fb)
        if stacked is not None:  # the CPU fast path: the same kernels, one call for the stack
            x, residual = stacked
        elif tbo:
            x, residual = two_batch_overlap.run_layers(run, x, cos_sin, fb,
                                                       self.two_batch_overlap)
        else:
            for layer in run:
                x, residual = layer(x, cos_sin, fb, residual)
        if prune:
            x, residual = last.forward_rows(x, cos_sin, fb, residual, idx)
            return self.norm(x, residual)[0]
        # index_select, not x[idx]: on the CPU, ATen's indexing ran a 2-thread OpenMP region
        # from 6 rows up, which on a busy 2-core box waited 4-12 ms (a scheduler tick) for its
        # second thread: a speculative verify's 9 rows paid it twice a step
        return self.norm(x.index_select(0, idx), residual.index_select(0, idx))[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(N, hidden) -> (N, vocab) float32."""
        dense_above = self.lm_head_dense_above  # quantized_linear.keep_dense_rows
        if self.lm_head_quant is not None and (dense_above is None
                                               or hidden.shape[0] <= dense_above):
            # rounded through hidden's dtype, as logits_fp32 does
            return self.lm_head_quant.forward_rounded(hidden)
        if self.lm_head_fp32 is not None:
            return cpu_linear.logits_fp32(hidden, self.lm_head_fp32, hidden.dtype)
        if self.lm_head_packed is not None:
            return cpu_packed.linear(hidden, self.lm_head_packed, None).float()
        w = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        gemv = _gemv(hidden)
        return (F.linear(hidden, w) if gemv is None else gemv.linear(hidden, w)).float()

    # --- weights --------------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors in; q/k/v and gate/up land in their slice of the fused weight."""
        llama_weights.load(self, weights)

    def init_dummy_weights(self, seed: int = 0) -> None:
        """Random weights (`--load-format dummy`) with a scale that keeps activations sane."""
        llama_weights.init_dummy(self, seed)
