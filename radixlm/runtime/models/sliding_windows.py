"""Which layers of a Llama-family config attend through a sliding window, as HF applies it
(used by llama.py's attention spec and by arch_support for Qwen2/Qwen3-style `layer_types`)."""

from __future__ import annotations

from typing import Optional

from radixlm.runtime.config import ModelConfig


def layer_windows(cfg: ModelConfig) -> tuple[Optional[int], ...]:
    """Each layer's sliding window as HF 5.23 applies it (None: full attention).
    Mistral: `sliding_window` on every layer (MistralModel builds one sliding mask for all layers
    and ignores `layer_types`). Qwen2: only with `use_sliding_window`, on the layers `layer_types`
    marks "sliding_attention" (config.json has them since transformers 5; older configs: the
    layers >= `max_window_layers`). Llama: none (LlamaModel ignores a `sliding_window` field).
    A config.json without `sliding_window` gets MistralConfig's / Qwen2Config's default, 4096."""
    hf, n = cfg.hf, cfg.num_layers
    model_type = hf.get("model_type")
    if model_type == "mistral":
        return (hf.get("sliding_window", 4096),) * n
    if model_type != "qwen2":
        return (None,) * n
    window = hf.get("sliding_window", 4096) if hf.get("use_sliding_window", False) else None
    return windows_by_layer_type(cfg, window)


def windows_by_layer_type(cfg: ModelConfig, window: Optional[int]) -> tuple[Optional[int], ...]:
    """Qwen2 / Qwen3: `window` on the layers `layer_types` marks "sliding_attention" (configs
    without layer_types: the layers >= `max_window_layers`, their config classes' default)."""
    hf, n = cfg.hf, cfg.num_layers
    types = hf.get("layer_types")
    if types is None:
        first = hf.get("max_window_layers", 28)
        types = ["sliding_attention" if window is not None and i >= first else "full_attention"
                 for i in range(n)]
    if len(types) != n or set(types) - {"full_attention", "sliding_attention"}:
        raise ValueError(f"{cfg.architecture}: layer_types {types} is not supported (one of "
                         "full_attention / sliding_attention per layer)")
    if window is None and "sliding_attention" in types:
        raise ValueError(f"{cfg.architecture}: layer_types lists sliding_attention layers but no "
                         "sliding_window applies (use_sliding_window false or no window): HF "
                         "refuses to build their mask, so this config is refused too")
    return tuple(window if t == "sliding_attention" else None for t in types)
