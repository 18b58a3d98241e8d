"""LLaVA (1.5 style): a CLIP vision tower, a two-layer projector and our Llama language model.

As HF 5.23's modeling_llava: the tower's hidden state `vision_feature_layer` (an index into
(embeddings, layer 1, ..., layer L); a list concatenates several on the feature axis), minus the
CLS row with the 'default' strategy, goes through linear_1 -> act -> linear_2 and replaces the
input embeddings of the prompt's image positions (one feature row per position).

The image positions carry pseudo ids >= vocab_size (runtime/multimodal.py); `fb.mm_inputs` says,
for each request of an extend batch with images, where its new tokens sit, so a chunk or a
radix-cache hit that starts or ends inside an image takes just the rows of the features it needs.
Decode batches never hold image positions. The tower is transformers' own CLIPVisionModel
(imported only when a LLaVA model is built).
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from radixlm.runtime.config import ModelConfig
from radixlm.runtime.executor.forward_batch import ForwardBatch
from radixlm.runtime.models.llama import LlamaForCausalLM

_ACTS = {"gelu": nn.GELU, "gelu_pytorch_tanh": lambda: nn.GELU(approximate="tanh"),
         "relu": nn.ReLU, "silu": nn.SiLU}


class LlavaForConditionalGeneration(LlamaForCausalLM):
    """The language model's modules are this module's own (LlamaForCausalLM's layout), plus
    `vision_tower` and `multi_modal_projector`."""

    is_multimodal = True

    @staticmethod
    def check_supported(cfg: ModelConfig, context_len: int) -> None:
        hf = cfg.hf
        vc, tc = hf.get("vision_config") or {}, hf.get("text_config") or {}
        if hf.get("model_type") != "llava":
            raise ValueError(f"model_type {hf.get('model_type')!r}: only 'llava' runs as "
                             "LlavaForConditionalGeneration (LLaVA-NeXT anyres etc. are not "
                             "supported)")
        if vc.get("model_type") != "clip_vision_model":
            raise ValueError(f"vision_config.model_type {vc.get('model_type')!r}: only the CLIP "
                             "vision tower (clip_vision_model) is supported")
        if tc.get("model_type") != "llama":
            raise ValueError(f"text_config.model_type {tc.get('model_type')!r}: only a Llama "
                             "language model is supported")
        if tc.get("hidden_act", "silu") != "silu" or tc.get("mlp_bias", False):
            raise ValueError("text_config.hidden_act / mlp_bias: the Llama MLP here computes "
                             "silu(gate) * up without biases")
        if hf.get("vision_feature_select_strategy", "default") not in ("default", "full"):
            raise ValueError("vision_feature_select_strategy: must be 'default' or 'full'")
        layer = hf.get("vision_feature_layer", -2)
        n_states = vc.get("num_hidden_layers", 12) + 1  # embeddings + one per encoder layer
        for i in [layer] if isinstance(layer, int) else layer:
            if not isinstance(i, int) or not -n_states <= i < n_states:
                raise ValueError(f"vision_feature_layer {layer!r}: the tower has {n_states} "
                                 "hidden states")
        if hf.get("projector_hidden_act", "gelu") not in _ACTS:
            raise ValueError(f"projector_hidden_act {hf.get('projector_hidden_act')!r} is not "
                             f"supported ({', '.join(_ACTS)})")
        LlamaForCausalLM.check_supported(cfg, context_len)

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        from transformers import CLIPVisionConfig, CLIPVisionModel

        hf = cfg.hf
        vcfg = CLIPVisionConfig(**{k: v for k, v in hf["vision_config"].items()
                                   if k != "model_type"})
        self.vision_tower = CLIPVisionModel(vcfg)
        layer = hf.get("vision_feature_layer", -2)
        self.feature_layers = [layer] if isinstance(layer, int) else list(layer)
        self.drop_cls = hf.get("vision_feature_select_strategy", "default") == "default"
        bias = hf.get("multimodal_projector_bias", True)
        self.multi_modal_projector = nn.Sequential()  # linear_1 -> act -> linear_2, HF's names
        p = self.multi_modal_projector
        p.add_module("linear_1", nn.Linear(vcfg.hidden_size * len(self.feature_layers),
                                           cfg.hidden_size, bias=bias))
        p.add_module("act", _ACTS[hf.get("projector_hidden_act", "gelu")]())
        p.add_module("linear_2", nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=bias))

    def to_empty(self, *, device, recurse: bool = True) -> "LlavaForConditionalGeneration":
        super().to_empty(device=device, recurse=recurse)
        emb = self.vision_tower.embeddings  # its position_ids buffer is computed, not loaded
        emb.position_ids = torch.arange(emb.num_positions, device=device).expand((1, -1))
        return self

    # --- forward --------------------------------------------------------------------------------
    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        if fb.mm_inputs is None:  # no image positions in this batch: the text model as is
            return super().forward(fb)
        ids = fb.input_ids  # (T,)
        is_image = ids >= self.cfg.vocab_size
        x = self.embed_tokens(ids.masked_fill(is_image, 0))  # (T, hidden)
        filled = 0
        for row, start, ext, mm in fb.mm_inputs:  # the request's tokens [start, start + ext)
            for item in mm.images:
                lo, hi = max(item.offset, start), min(item.offset + item.length, start + ext)
                if lo >= hi:
                    continue
                feats = self._features(item)  # (length, hidden)
                x[row + lo - start : row + hi - start] = feats[lo - item.offset : hi - item.offset]
                filled += hi - lo
                if start + ext >= item.offset + item.length:
                    item.features = None  # every position is in the KV now
        if filled != int(is_image.sum()):
            raise RuntimeError(f"{int(is_image.sum())} image positions in the batch, "
                               f"{filled} filled with image features")
        return super().forward(fb, input_embeds=x)

    def encode_images(self, mm, start: int, ext: int) -> None:
        """Run the vision tower for the images of one request that its tokens [start, start +
        ext) reach, before the batch's forward (which then reuses the features): the scheduler
        calls it per request, so a failing image fails only its request."""
        for item in mm.images:
            if item.offset < start + ext and item.offset + item.length > start:
                self._features(item)

    def _features(self, item) -> torch.Tensor:
        if item.features is not None:
            return item.features
        w = self.multi_modal_projector.linear_1.weight
        pixels = item.pixel_values.to(w.device, w.dtype)[None]  # (1, 3, H, W)
        out = self.vision_tower(pixels, output_hidden_states=True, return_dict=True)
        hs = [out.hidden_states[i] for i in self.feature_layers]  # each (1, 1 + P, vision)
        if self.drop_cls:
            hs = [h[:, 1:] for h in hs]
        feats = self.multi_modal_projector(torch.cat(hs, dim=-1))[0]  # (P or 1 + P, hidden)
        if feats.shape[0] != item.length:
            raise ValueError(f"image: {feats.shape[0]} feature rows for {item.length} image "
                             "tokens (image size does not match the vision tower)")
        item.features = feats
        return feats

    # --- weights --------------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """HF names, either layout: transformers 5's saved one (`language_model.model.*`,
        `language_model.lm_head.*`, `vision_tower.*`, `multi_modal_projector.*`) or its module
        one (`model.language_model.*`, `model.vision_tower.*`, `lm_head.*`)."""
        own = {n: p for n, p in self.named_parameters()
               if n.startswith(("vision_tower.", "multi_modal_projector."))}
        seen, text = set(), []
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if name.startswith("language_model."):
                rest = name[len("language_model."):]
                text.append((rest if rest.startswith(("model.", "lm_head.")) else "model." + rest,
                             tensor))
                continue
            if name.startswith(("lm_head.", "layers.", "embed_tokens.", "norm.")):
                text.append((name, tensor))
                continue
            name = name.replace("vision_tower.vision_model.", "vision_tower.")
            if name.endswith("position_ids"):
                continue
            if name not in own:
                raise KeyError(f"checkpoint tensor {name!r} has no place in {type(self).__name__}")
            if own[name].shape != tensor.shape:
                raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model shape "
                                 f"{tuple(own[name].shape)}")
            own[name].data.copy_(tensor)
            seen.add(name)
        missing = sorted(set(own) - seen)
        if missing:
            raise ValueError(f"checkpoint lacks tensors for: {missing[:8]}")
        # the text model's loader checks that every one of its parameters is loaded: let it see
        # only its own modules while it runs
        vision = {k: self._modules.pop(k) for k in ("vision_tower", "multi_modal_projector")}
        try:
            super().load_weights(text)
        finally:
            self._modules.update(vision)

    def init_dummy_weights(self, seed: int = 0) -> None:
        super().init_dummy_weights(seed)
        with torch.no_grad():
            for name, p in self.vision_tower.named_parameters():
                if "norm" in name and name.endswith("weight"):
                    p.fill_(1.0)
