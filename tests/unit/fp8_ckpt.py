"""Tiny FP8 checkpoints for the FP8 tests (tests/unit/test_fp8_*.py, tests/gpu/test_fp8.py): a
random-weight HF Llama (arch_parity.save_tiny) whose projection weights are quantized to e4m3 and
written in the formats users bring, plus the dequantized reference (HF transformers, fp32, on the
dequantized weights: what every FP8 path is checked against).

Formats (FORMATS): each writes config.json's quantization_config and the tensors the way the
producing tool does:
  fp8-dynamic, fp8-static  vLLM / AutoFP8: quant_method "fp8", 0-d `weight_scale` (and
                           `input_scale` for static activations)
  hf-dynamic, hf-static    transformers' FineGrainedFP8Config(weight_block_size=None): 0-d
                           `weight_scale_inv` (a multiplier, despite the name) / `activation_scale`
  ct-channel               compressed-tensors FP8_DYNAMIC (llm-compressor): `weight_scale` [out, 1]
                           per channel, dynamic per-token activations
  ct-tensor-static         compressed-tensors FP8 per-tensor `weight_scale` [1], static `input_scale`
                           [1]
Static input scales are calibrated: amax of each layer's input over the prompts, / 448.
Dimensions are multiples of 16 (CUDA's _scaled_mm needs K and N so)."""

from __future__ import annotations

import json
import os

import torch

from radixlm.runtime.layers import fp8_linear

VOCAB = 256
PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
        "qkv_proj", "gate_up_proj")  # the last two: Phi-3's fused checkpoint names
FORMATS = ("fp8-dynamic", "fp8-static", "hf-dynamic", "hf-static", "ct-channel",
           "ct-tensor-static")


def llama_config(**kw):
    from transformers import LlamaConfig

    base = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                max_position_embeddings=512, rms_norm_eps=1e-5, tie_word_embeddings=False)
    base.update(kw)
    return LlamaConfig(**base)


def quantization_config(fmt: str) -> dict:
    static = fmt.endswith("static")
    if fmt.startswith("fp8"):
        return {"quant_method": "fp8", "activation_scheme": "static" if static else "dynamic",
                "ignored_layers": ["lm_head"]}
    if fmt.startswith("hf"):  # FineGrainedFP8Config(weight_block_size=None, ...) as 5.23 saves
        # it (test_fp8_config checks it against the installed transformers; written out here so
        # the GPU machine's older transformers does not matter)
        return {"quant_method": "fp8", "modules_to_not_convert": None,
                "modules_to_convert": None, "activation_scheme": "static" if static else "dynamic",
                "weight_block_size": None, "dequantize": False, "scale_fmt": "float",
                "expert_dtype": "fp8"}
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False,
               "strategy": "tensor" if static else "channel", "group_size": None,
               "block_structure": None, "actorder": None, "observer": "minmax",
               "observer_kwargs": {}}
    acts = ({"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False,
             "strategy": "tensor", "observer": "minmax"} if static else
            {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": True,
             "strategy": "token", "observer": None})
    return {"quant_method": "compressed-tensors", "format": "float-quantized",
            "quantization_status": "compressed", "global_compression_ratio": None,
            "kv_cache_scheme": None, "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": acts,
                                          "output_activations": None,
                                          "format": "float-quantized"}}}


def calibrate(model, prompts) -> dict[str, float]:
    """Each projection's largest |input| over the prompts (static input scales: amax / 448)."""
    amax: dict[str, float] = {}
    hooks = []
    for name, mod in model.named_modules():
        if name.split(".")[-1] in PROJ:
            def hook(_m, args, name=name):
                amax[name] = max(amax.get(name, 0.0), args[0].detach().abs().max().item())
            hooks.append(mod.register_forward_pre_hook(hook))
    with torch.no_grad():
        for ids in prompts:
            model(torch.tensor([ids]))
    for h in hooks:
        h.remove()
    return amax


def write_fp8(model, path: str, fmt: str, calib_prompts=None, skip: tuple[str, ...] = (),
              per_channel=None) -> dict[str, torch.Tensor]:
    """Save `model` (an fp32 HF model) to `path` with its projection weights in e4m3 and the
    scales `fmt` asks for; modules whose names end with one of `skip` stay fp32. Returns the
    dequantized state dict (the reference's weights)."""
    from safetensors.torch import save_file

    assert fmt in FORMATS, fmt
    static = fmt.endswith("static")
    per_channel = fmt == "ct-channel" if per_channel is None else per_channel
    amax = calibrate(model, calib_prompts) if static else {}
    scale_name = "weight_scale_inv" if fmt.startswith("hf") else "weight_scale"
    input_name = "activation_scale" if fmt.startswith("hf") else "input_scale"
    out, deq = {}, {}
    for name, t in model.state_dict().items():
        mod = name.removesuffix(".weight")
        if not (name.endswith(".weight") and mod.split(".")[-1] in PROJ) or mod.endswith(skip):
            out[name] = deq[name] = t.detach().clone().contiguous()
            continue
        q, s = fp8_linear.quantize_weight(t, per_channel)
        out[name] = q
        if per_channel:
            out[f"{mod}.{scale_name}"] = s.reshape(-1, 1).contiguous()  # [out, 1]
        else:
            out[f"{mod}.{scale_name}"] = s.reshape(1) if fmt.startswith("ct") else s.reshape(())
        if static:
            xs = torch.tensor(amax[mod] / fp8_linear.FP8_MAX, dtype=torch.float32)
            out[f"{mod}.{input_name}"] = xs.reshape(1) if fmt.startswith("ct") else xs
        deq[name] = fp8_linear.dequantize(q, s.reshape(-1).expand(q.shape[0]), torch.float32)
    os.makedirs(path, exist_ok=True)
    save_file(out, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    cfg = model.config.to_dict()
    cfg["quantization_config"] = quantization_config(fmt)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1, default=str)
    return deq


def reference_model(model_cls, config, deq: dict[str, torch.Tensor]):
    """The HF model in fp32 holding the dequantized weights."""
    ref = model_cls(config).float().eval()
    ref.load_state_dict(deq)
    return ref


def set_quant(path: str, qcfg) -> None:
    """Rewrite config.json's quantization_config (None: drop it)."""
    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    if qcfg is None:
        cfg.pop("quantization_config", None)
    else:
        cfg["quantization_config"] = qcfg
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=1)


def prompt_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def margins(model, prompts, outputs) -> list[float]:
    """Per prompt: the smallest top-1 minus top-2 logit gap of the reference over the positions
    that pick its greedy tokens (prompt end .. second-last output token). A path whose logits stay
    within half this gap of the reference picks the same tokens."""
    out = []
    for ids, gen in zip(prompts, outputs):
        logits = prompt_logits(model, ids + gen[:-1])[len(ids) - 1:]
        top2 = logits.topk(2, dim=-1).values
        out.append(float((top2[:, 0] - top2[:, 1]).min()))
    return out


def _fused_group(name: str) -> str:
    last = name.split(".")[-1]
    return name[: -len(last)] + {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv",
                                 "gate_proj": "gate_up", "up_proj": "gate_up"}.get(last, last)


class Fp8Emulation:
    """Hooks making an HF model (holding the dequantized weights) compute what radixlm's FP8
    layers compute: each projection's input quantized to e4m3 (per token, or with the static
    input scale, the max over a fused q/k/v or gate/up group), optionally its output rounded to
    `out_dtype` (CUDA's _scaled_mm writes bf16) and inputs of one row left unquantized
    (`gemv=True`: CUDA's batch-1 GEMV reads the activation as it is). A context manager."""

    def __init__(self, model, input_scales: dict[str, float] | None = None,
                 out_dtype: torch.dtype | None = None, gemv: bool = False):
        self.model, self.out_dtype, self.gemv = model, out_dtype, gemv
        self.static = None
        if input_scales is not None:
            grp: dict[str, float] = {}
            for name, s in input_scales.items():
                grp[_fused_group(name)] = max(grp.get(_fused_group(name), 0.0), s)
            self.static = {name: grp[_fused_group(name)] for name in input_scales}
        self.hooks = []

    def __enter__(self):
        for name, mod in self.model.named_modules():
            if name.split(".")[-1] not in PROJ:
                continue
            s = None if self.static is None else torch.tensor(self.static[name])

            def pre(_m, args, s=s):
                x = args[0]
                x2 = x.reshape(-1, x.shape[-1])
                if self.gemv and x2.shape[0] == 1:
                    return None
                q, sx = fp8_linear.quantize_rows_torch(x2, s)
                return ((q.float() * sx).to(x.dtype).reshape(x.shape),) + tuple(args[1:])

            def post(_m, _args, y):
                return None if self.out_dtype is None else y.to(self.out_dtype).to(y.dtype)

            self.hooks += [mod.register_forward_pre_hook(pre), mod.register_forward_hook(post)]
        return self.model

    def __exit__(self, *exc):
        for h in self.hooks:
            h.remove()
        self.hooks = []


def input_scales(path: str) -> dict[str, float]:
    """HF module name -> static input scale, read back from a written checkpoint."""
    from safetensors import safe_open

    out = {}
    with safe_open(os.path.join(path, "model.safetensors"), framework="pt") as f:
        for n in f.keys():
            for suffix in (".input_scale", ".activation_scale"):
                if n.endswith(suffix):
                    out[n[: -len(suffix)]] = float(f.get_tensor(n).float().reshape(()))
    return out


# --- checks of an FP8 engine against the dequantized reference (CPU and GPU tests) ------------
# The stated tolerance, on log-probabilities (the reference's logits have std ~0.9 here):
# activations rounded to e4m3 (3 mantissa bits: <= 2^-4 relative per element) give each FP8
# matmul ~2.5% RMS relative error (tests/unit/test_fp8_linear.py checks the rigorous per-element
# bound); through this 2-layer model the log-probs move by 0.06 on average, 0.26-0.41 at worst
# (CPU fp32, every format). Tolerance: mean <= 0.1, max <= 0.6 (bf16 on a GPU adds its own
# ~0.01-0.05). The dequantize-at-load path computes the reference itself: 1e-3 there.
LP_MEAN_TOL, LP_MAX_TOL = 0.1, 0.6
MARGIN = 2 * 0.25  # greedy tokens must agree where the reference's top-2 gap exceeds this


def _ref_lp(ref, ids: list[int], start: int) -> torch.Tensor:
    """log p(ids[i] | ids[:i]) under `ref` for i >= start."""
    lp = torch.log_softmax(prompt_logits(ref, ids), -1)
    return lp[start - 1:-1].gather(1, torch.tensor(ids[start:])[:, None])[:, 0]


def prompt_lp_errors(eng, ref, prompts) -> torch.Tensor:
    errs = []
    for ids in prompts:
        if len(ids) < 2:
            continue
        o = eng.generate(input_ids=ids, sampling_params={"max_new_tokens": 0},
                         return_logprob=True, logprob_start_len=0)
        got = torch.tensor([lp for lp, _, _ in o["meta_info"]["input_token_logprobs"][1:]])
        errs.append((got - _ref_lp(ref, ids, 1)).abs())
    return torch.cat(errs)


def decode_lp_errors(eng, ref, prompts, max_new: int) -> torch.Tensor:
    """Greedy decode (one batch of `prompts`), each generated token's log-prob against the
    reference's for the same token after the same tokens (teacher forcing on the engine's own
    output, so a near-tie that went the other way costs nothing)."""
    outs = eng.generate(input_ids=prompts, return_logprob=True, sampling_params={
        "temperature": 0, "max_new_tokens": max_new, "ignore_eos": True})
    errs = []
    for ids, o in zip(prompts, outs):
        got = torch.tensor([lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]])
        errs.append((got - _ref_lp(ref, ids + o["output_ids"], len(ids))).abs())
    return torch.cat(errs)


def margin_prompts(ref, n: int = 96, seed: int = 5) -> tuple[list[list[int]], list[int]]:
    """Random prompts whose reference next token wins by more than MARGIN, and those tokens."""
    g = torch.Generator().manual_seed(seed)
    keep, tokens = [], []
    for length in torch.randint(4, 60, (n,), generator=g).tolist():
        ids = torch.randint(0, VOCAB, (length,), generator=g).tolist()
        top2 = prompt_logits(ref, ids)[-1].topk(2)
        if float(top2.values[0] - top2.values[1]) > MARGIN:
            keep.append(ids)
            tokens.append(int(top2.indices[0]))
    return keep, tokens


def check_fp8_engine(eng, ref, prompts, max_new: int = 8) -> dict:
    """The FP8 engine against the dequantized reference within the stated tolerance: prompt
    log-probs, batched greedy decode log-probs, single-prompt decode log-probs (CUDA: the batch-1
    GEMV path), and greedy tokens where the reference's margin exceeds MARGIN."""
    res = {}
    for key, e in (("prompt", prompt_lp_errors(eng, ref, prompts)),
                   ("decode", decode_lp_errors(eng, ref, prompts, max_new)),
                   ("decode_bs1", decode_lp_errors(eng, ref, [prompts[3]], max_new))):
        res[key] = (round(float(e.mean()), 4), round(float(e.max()), 4))
        assert e.mean() <= LP_MEAN_TOL and e.max() <= LP_MAX_TOL, (key, res[key])
    clear, tokens = margin_prompts(ref)
    assert len(clear) >= 4, len(clear)
    outs = eng.generate(input_ids=clear, sampling_params={"temperature": 0, "max_new_tokens": 1})
    assert [o["output_ids"][0] for o in outs] == tokens
    res["margin_prompts"] = len(clear)
    eng.wait_idle()
    eng.check_integrity()
    return res
