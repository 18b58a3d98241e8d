"""Sparse mixture-of-experts: Mixtral (`MixtralForCausalLM`) and Qwen3-MoE (`Qwen3MoeForCausalLM`).

Both are their dense model (llama.py / qwen3.py) with the MLP of some layers replaced by a
`SparseMoeBlock`, computed as HF transformers 5.23 does:
  router: logits = x @ gate.weight.T (model dtype); probs = softmax(logits) in fp32; top-k of
    probs; Mixtral always divides the k weights by their sum (fp32, and keeps them fp32);
    Qwen3-MoE divides only with `norm_topk_prob`, then casts the weights to the model dtype.
  experts: SwiGLU, down(silu(gate(x)) * up(x)), each routed pair's output times its weight, cast
    to the model dtype, and the k contributions of a token added in ascending expert order (HF
    index_adds expert by expert into zeros), so fp32 results match HF's up to GEMM rounding.
Qwen3-MoE: layer i is sparse unless i is in `mlp_only_layers` or (i + 1) % decoder_sparse_step
!= 0 (or num_experts == 0); dense layers use llama.py's MLP with `intermediate_size`; experts use
`moe_intermediate_size`. It has no shared expert (that is Qwen2-MoE, not served here).
Sliding windows: Mixtral's `sliding_window` and Qwen3-MoE's (with `use_sliding_window`) apply to
every layer, as in HF (arch_support.layer_windows); Qwen3-MoE inherits Qwen3's attention_spec.

Expert weights are stacked per layer, as HF 5 holds them in memory: `experts.gate_up_proj`
(E, 2I, H) with rows [gate | up] and `experts.down_proj` (E, H, I). Checkpoints written by
`save_pretrained` (5.23 too) store one 2-D tensor per expert (`experts.{e}.gate_proj/up_proj/
down_proj`, Mixtral `block_sparse_moe.experts.{e}.w1/w3/w2`); `load_weights` stacks those and also
takes the stacked names as they are.

The expert computation, on the CPU and for long CUDA inputs (more than TRITON_MAX_TOKENS rows:
prefill chunks), is one gather of all (token, expert) pairs sorted by expert, one GEMM pair per
expert that received tokens (a loop over experts, never over tokens), then one scatter back. Its
slice bounds need the per-expert counts on the host (one sync per MoE layer). On CUDA, up to
TRITON_MAX_TOKENS rows (every decode batch of the default graph buckets, eager or in a CUDA
graph, so graphs on and off run the same arithmetic) and always inside a graph capture:
layers/triton_moe.py, two grouped GEMMs over the pairs sorted by expert, shapes from (T, k, E)
only, no sync, and only the routed experts' weights read. Without it
(RADIXLM_DISABLE_TRITON_MOE=1) a capture runs every expert on every token with weight 0 where not
routed (`_dense`: same sums in the same order, E / k times the FLOPs and bytes).

CPU fp32-GEMM path (layers/cpu_linear, bf16 on AVX2): it swaps nn.Linear projections only; the
stacked expert weights and the router are not nn.Linear and stay in the model dtype, computed by
torch's bf16 GEMM: exact bf16 math, just without that path's speed-up.
"""

from __future__ import annotations

import re
from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from radixlm.runtime.config import ModelConfig
from radixlm.runtime.models import arch_support
from radixlm.runtime.models.llama import Linear, LlamaForCausalLM, _fused_ops
from radixlm.runtime.models.qwen3 import Qwen3ForCausalLM


# CUDA rows up to which the Triton grouped experts run eagerly: every decode batch a graph
# captures by default (cuda_graph_max_bs 160), so a decode step computes alike with graphs on and
# off. Longer inputs (prefill) run the per-expert cuBLAS loop: there an expert gets many rows and
# the kernel's blocks would each re-read its weights. (With cuda_graph_max_bs above this, a
# captured batch larger than it runs the kernel and the same batch eagerly the loop: equal up to
# GEMM rounding.)
TRITON_MAX_TOKENS = 256


def _triton_moe():
    """layers/triton_moe (CUDA) unless RADIXLM_DISABLE_TRITON_MOE=1; imported only on CUDA."""
    from radixlm.runtime.layers import triton_moe

    return triton_moe if triton_moe.ENABLED else None


class Experts(nn.Module):
    # tests set this (with TRITON_INTERPRET=1) to run the CUDA path's Triton kernel on CPU tensors
    kernel_on_cpu = False

    def __init__(self, n_experts: int, hidden: int, inter: int):
        super().__init__()
        self.n_experts, self.inter = n_experts, inter
        self.gate_up_proj = nn.Parameter(torch.empty(n_experts, 2 * inter, hidden))
        self.down_proj = nn.Parameter(torch.empty(n_experts, hidden, inter))

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert e on rows x (n, H) -> (n, H)."""
        gate_up = F.linear(x, self.gate_up_proj[e])  # (n, 2I)
        ops = _fused_ops(gate_up)
        if ops is not None:
            return F.linear(ops.silu_and_mul(gate_up), self.down_proj[e])
        gate, up = gate_up.split(self.inter, dim=-1)
        return F.linear(F.silu(gate) * up, self.down_proj[e])

    def forward(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor,
                presorted: bool = False, add: torch.Tensor | None = None) -> torch.Tensor:
        """x (T, H); idx (T, k) chosen experts; w (T, k) their weights -> (T, H). presorted:
        each row of idx is ascending already (DeepSeek's router kernel): no sort. add (T, H):
        added to the result (DeepSeek's shared experts; in the Triton path's last kernel)."""
        out, added = self._routed(x, idx, w, presorted, add)
        return out if add is None or added else out + add

    def _routed(self, x, idx, w, presorted, add) -> tuple[torch.Tensor, bool]:
        """(forward's routed sum, whether `add` is in it already: the Triton path's)."""
        t, k = idx.shape
        if not presorted:
            idx, perm = idx.sort(dim=-1)  # each token's experts ascending: HF's order of addition
            w = w.gather(-1, perm)
        if x.is_cuda or self.kernel_on_cpu:
            capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
            moe_kernel = _triton_moe()
            if moe_kernel is not None and (capturing or t <= TRITON_MAX_TOKENS):
                return moe_kernel.experts(x.contiguous(), self.gate_up_proj, self.down_proj,
                                          idx, w, add=add), True
            if capturing:
                return self._dense(x, idx, w), False
        flat = idx.reshape(-1)  # (T*k,) pair j = token j // k, slot j % k
        order = torch.argsort(flat, stable=True)  # pairs grouped by expert
        counts = torch.bincount(flat, minlength=self.n_experts).tolist()  # the one host sync
        xs = x[order // k]  # (T*k, H) rows grouped by expert
        ys = torch.empty_like(xs)
        start = 0
        for e, n in enumerate(counts):
            if n:
                ys[start : start + n] = self.expert(e, xs[start : start + n])
                start += n
        contrib = torch.empty_like(ys)  # back to pair order, weighted, in the model dtype
        contrib[order] = (ys * w.reshape(-1)[order, None]).to(x.dtype)
        contrib = contrib.view(t, k, -1)
        out = contrib[:, 0]
        for j in range(1, k):  # k is the config's top-k (2-8): a loop over slots, not tokens
            out = out + contrib[:, j]
        return out, False

    def _dense(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """Every expert on every token (CUDA graph capture: no host sync, fixed shapes); weight 0
        off the route, so each token's sum adds its experts' terms in ascending order plus zeros."""
        dense_w = torch.zeros(x.shape[0], self.n_experts, dtype=w.dtype, device=w.device)
        dense_w.scatter_(1, idx, w)  # (T, E)
        out = None
        for e in range(self.n_experts):
            c = (self.expert(e, x) * dense_w[:, e : e + 1]).to(x.dtype)
            out = c if out is None else out + c
        return out


class SparseMoeBlock(nn.Module):
    """Router (`gate`, HF's name) + experts; replaces a decoder layer's `mlp`: (T, H) -> (T, H)."""

    def __init__(self, hidden: int, inter: int, n_experts: int, top_k: int, *,
                 renormalize: bool, weights_in_model_dtype: bool):
        super().__init__()
        self.top_k, self.renormalize = top_k, renormalize
        self.weights_in_model_dtype = weights_in_model_dtype
        self.gate = Linear(hidden, n_experts, bias=False)
        self.experts = Experts(n_experts, hidden, inter)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.gate(x)  # (T, E)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        w, idx = torch.topk(probs, self.top_k, dim=-1)  # (T, k) each
        if self.renormalize:
            w = w / w.sum(dim=-1, keepdim=True)
        if self.weights_in_model_dtype:
            w = w.to(logits.dtype)
        return self.experts(x, idx, w)


# one expert's 2-D tensor in a checkpoint -> (stacked parameter, half of gate_up_proj or None)
_EXPERT_NAME = re.compile(r"(?:model\.)?layers\.(\d+)\.mlp\.experts\.(\d+)\.(\w+)\.weight")
_PIECES = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
           "down_proj": ("down_proj", None),
           "w1": ("gate_up_proj", 0), "w3": ("gate_up_proj", 1), "w2": ("down_proj", None)}


class MoeWeights:
    """load_weights for models with `Experts`: per-expert tensors are copied into the stacked
    parameters here; everything else (and each stacked parameter once complete) goes through
    llama.py's loader, whose check then covers every parameter."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(self._stack_experts(weights))

    def _stack_experts(self, weights):
        params = dict(self.named_parameters())
        filled: dict[str, set] = {}  # stacked parameter -> {(expert, piece)} copied in
        for name, tensor in weights:
            name = name.replace(".block_sparse_moe.", ".mlp.")  # Mixtral's checkpoint module name
            m = _EXPERT_NAME.fullmatch(name)
            if m is None:
                yield name, tensor
                continue
            layer, e, piece = m.group(1), int(m.group(2)), m.group(3)
            target, half = _PIECES.get(piece, (None, None))
            pname = f"layers.{layer}.mlp.experts.{target}"
            if pname not in params or e >= params[pname].shape[0]:
                raise KeyError(f"checkpoint tensor {name!r} has no place in {type(self).__name__}")
            dst = params[pname].data[e]
            if half is not None:
                n = dst.shape[0] // 2
                dst = dst[half * n : (half + 1) * n]
            if dst.shape != tensor.shape:
                raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model shape "
                                 f"{tuple(dst.shape)}")
            dst.copy_(tensor)
            filled.setdefault(pname, set()).add((e, piece))
        for pname, got in filled.items():
            want = params[pname].shape[0] * (2 if pname.endswith("gate_up_proj") else 1)
            if len(got) != want:
                raise ValueError(f"checkpoint lacks {want - len(got)} of the {want} expert "
                                 f"tensors of {pname}")
            yield pname, params[pname].data  # complete: llama.py's loader marks it loaded


def _check_moe(cfg: ModelConfig, context_len: int, n_experts: int, top_k: int) -> None:
    arch_support.require_silu(cfg)
    arch_support.require_plain_rope(cfg)
    arch_support.layer_windows(cfg)
    if n_experts and not 0 < top_k <= n_experts:
        raise ValueError(f"{cfg.architecture}: num_experts_per_tok={top_k} must be in "
                         f"1..{n_experts} (the number of experts)")


def _mixtral_experts(hf: dict) -> tuple[int, int]:
    """(experts, top-k), MixtralConfig's defaults (8, 2) where absent."""
    return hf.get("num_local_experts", 8), hf.get("num_experts_per_tok", 2)


class MixtralForCausalLM(MoeWeights, LlamaForCausalLM):
    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        hf = cfg.hf
        for layer in self.layers:  # built on the meta device: swapping is free
            layer.mlp = SparseMoeBlock(cfg.hidden_size, cfg.intermediate_size,
                                       *_mixtral_experts(hf), renormalize=True,
                                       weights_in_model_dtype=False)

    @staticmethod
    def check_supported(cfg: ModelConfig, context_len: int) -> None:
        _check_moe(cfg, context_len, *_mixtral_experts(cfg.hf))

    attention_spec = staticmethod(arch_support.attention_spec)  # sliding window on every layer


def _qwen3_moe_experts(hf: dict) -> int:
    # HF 5 writes `num_local_experts` (attribute_map of num_experts); Qwen's configs say num_experts
    for key in ("num_experts", "num_local_experts"):
        if hf.get(key) is not None:
            return hf[key]
    return 128  # Qwen3MoeConfig's default


class Qwen3MoeForCausalLM(MoeWeights, Qwen3ForCausalLM):
    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        hf = cfg.hf
        n, step = _qwen3_moe_experts(hf), hf.get("decoder_sparse_step", 1)
        dense = set(hf.get("mlp_only_layers") or ())
        for i, layer in enumerate(self.layers):
            if i not in dense and n > 0 and (i + 1) % step == 0:
                layer.mlp = SparseMoeBlock(cfg.hidden_size, hf.get("moe_intermediate_size", 768),
                                           n, hf.get("num_experts_per_tok", 8),
                                           renormalize=bool(hf.get("norm_topk_prob", False)),
                                           weights_in_model_dtype=True)

    @staticmethod
    def check_supported(cfg: ModelConfig, context_len: int) -> None:
        step = cfg.hf.get("decoder_sparse_step", 1)
        if not isinstance(step, int) or step < 1:
            raise ValueError(f"Qwen3MoeForCausalLM: decoder_sparse_step={step!r} must be >= 1")
        _check_moe(cfg, context_len, _qwen3_moe_experts(cfg.hf),
                   cfg.hf.get("num_experts_per_tok", 8))
