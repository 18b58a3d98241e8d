"""DeepSeek's mixture of experts: a router, routed experts (moe.Experts) and shared experts.

Computed as HF transformers 5.24 does (DeepseekV2Moe / DeepseekV3MoE):
  out = experts(x, top-k ids, top-k weights) + shared_experts(x)
with shared_experts a SwiGLU MLP of moe_intermediate_size * n_shared_experts. The router works
in fp32 on an fp32 weight (HF keeps `gate.weight` and `e_score_correction_bias` in fp32 even in a
bf16 model: `_keep_in_fp32_modules_strict`), logits = x.float() @ W.T, and returns fp32 weights:
- V2 (`softmax`): scores = softmax(logits); "greedy": top-k of scores; "group_limited_greedy":
  the n_group groups scored by their best expert, the topk_group best kept, the others' scores
  set to 0, then top-k. weights = the top-k scores * routed_scaling_factor (HF 5.24 does not
  renormalize V2's weights, whatever norm_topk_prob says: configs with norm_topk_prob true are
  refused, see deepseek.check_supported).
- V3 (`sigmoid`, "noaux_tc"): scores = sigmoid(logits); the choice uses scores +
  e_score_correction_bias: groups scored by the sum of their two best, topk_group groups kept,
  the others -inf, top-k of those; weights = the chosen experts' plain scores, divided by their
  sum + 1e-20 with norm_topk_prob, times routed_scaling_factor.
The expert weights stay fp32 into moe.Experts, which multiplies each expert's output by its
weight and casts to the model dtype before the sum, as HF's index_add does.
"""

from __future__ import annotations

import torch
from torch import nn

from radixlm.runtime.config import ModelConfig
from radixlm.runtime.models.deepseek_config import fields
from radixlm.runtime.models.llama import MLP
from radixlm.runtime.models.moe import Experts, _triton_moe


class Router(nn.Module):
    kernel_on_cpu = False  # tests set this (with TRITON_INTERPRET=1) to run the CUDA path's kernel

    def __init__(self, cfg: ModelConfig, sigmoid: bool):
        super().__init__()
        hf = fields(cfg)
        self.n_experts, self.top_k = hf["n_routed_experts"], hf["num_experts_per_tok"]
        self.sigmoid = sigmoid
        self.method = "noaux_tc" if sigmoid else hf["topk_method"]
        self.n_group, self.topk_group = hf["n_group"], hf["topk_group"]
        self.scaling = hf["routed_scaling_factor"]
        self.norm_topk = sigmoid and bool(hf["norm_topk_prob"])
        self.weight = nn.Parameter(torch.empty(self.n_experts, cfg.hidden_size))
        if sigmoid:
            self.register_buffer("e_score_correction_bias", torch.empty(self.n_experts))

    def _apply(self, fn, recurse=True):
        """Whatever dtype the model is cast to, the router's tensors stay fp32 (as HF's)."""
        super()._apply(fn, recurse)
        self.weight.data = self.weight.data.float()
        if self.sigmoid:
            self.e_score_correction_bias = self.e_score_correction_bias.float()
        return self

    def _group_mask(self, scores: torch.Tensor, group_score) -> torch.Tensor:
        """(T, E) bool: True for the experts of each token's topk_group best groups."""
        t = scores.shape[0]
        grouped = scores.view(t, self.n_group, self.n_experts // self.n_group)
        best = torch.topk(group_score(grouped), self.topk_group, dim=-1, sorted=False)[1]
        mask = torch.zeros(t, self.n_group, dtype=torch.bool, device=scores.device)
        mask.scatter_(1, best, True)
        return mask.unsqueeze(-1).expand_as(grouped).reshape(t, self.n_experts)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (T, hidden) -> (ids (T, k) ascending, weights (T, k) fp32): on CUDA (and where
        tests set `kernel_on_cpu`) one kernel (layers/triton_router; off with the grouped
        experts' RADIXLM_DISABLE_TRITON_MOE=1), else the torch ops below."""
        logits = torch.nn.functional.linear(x.float(), self.weight.float())  # (T, E)
        if (logits.is_cuda and _triton_moe() is not None) or self.kernel_on_cpu:
            from radixlm.runtime.layers import triton_router as tr

            groups = (tr.GROUP_TOP2 if self.sigmoid else
                      tr.GROUP_MAX if self.method == "group_limited_greedy" else tr.GREEDY)
            return tr.select(logits, self.top_k, self.scaling, sigmoid=self.sigmoid,
                             groups=groups, n_group=self.n_group, topk_group=self.topk_group,
                             norm=self.norm_topk,
                             bias=self.e_score_correction_bias if self.sigmoid else None)
        if not self.sigmoid:
            scores = logits.softmax(dim=-1, dtype=torch.float32)
            if self.method == "group_limited_greedy":
                mask = self._group_mask(scores, lambda g: g.max(dim=-1).values)
                scores = scores.masked_fill(~mask, 0.0)
            w, ids = torch.topk(scores, self.top_k, dim=-1, sorted=False)
            return _ascending(ids, w * self.scaling)
        scores = logits.sigmoid()
        choice = scores + self.e_score_correction_bias
        mask = self._group_mask(choice, lambda g: g.topk(2, dim=-1)[0].sum(dim=-1))
        choice = choice.masked_fill(~mask, float("-inf"))
        ids = torch.topk(choice, self.top_k, dim=-1, sorted=False)[1]
        w = scores.gather(1, ids)
        if self.norm_topk:
            w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
        return _ascending(ids, w * self.scaling)


class DeepseekMoE(nn.Module):
    """Replaces a decoder layer's `mlp`: (T, hidden) -> (T, hidden)."""

    def __init__(self, cfg: ModelConfig, sigmoid: bool):
        super().__init__()
        hf = fields(cfg)
        inter = hf["moe_intermediate_size"]
        self.gate = Router(cfg, sigmoid)
        self.experts = Experts(hf["n_routed_experts"], cfg.hidden_size, inter)
        shared = hf["n_shared_experts"] or 0
        self.shared_experts = (MLP(_with_inter(cfg, inter * shared)) if shared else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, w = self.gate(x)
        shared = self.shared_experts(x) if self.shared_experts is not None else None
        # (routed sum + shared, as HF adds them; on CUDA in the experts' last kernel)
        return self.experts(x, ids, w, presorted=True, add=shared)


def _ascending(ids: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's experts in ascending order (HF adds their outputs in that order), weights
    alike."""
    ids, perm = ids.sort(dim=-1)
    return ids, w.gather(1, perm)


def _with_inter(cfg: ModelConfig, inter: int) -> ModelConfig:
    import dataclasses

    return dataclasses.replace(cfg, intermediate_size=inter)
