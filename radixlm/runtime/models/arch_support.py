"""Shared refusals for the architectures built on llama.py (Qwen3, Phi-3, Mixtral, Qwen3-MoE).

Each `check_supported` raises ValueError naming the config field it cannot run exactly, so a
model is refused at start-up instead of served with wrong numbers.
"""

from __future__ import annotations

from typing import Optional

from radixlm.runtime.config import ModelConfig

# rope types layers/rotary.RotaryEmbedding computes (frequencies only, no cos/sin scaling)
PLAIN_ROPE_TYPES = (None, "default", "linear", "llama3")


def require_silu(cfg: ModelConfig) -> None:
    act = cfg.hf.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"{cfg.architecture} with hidden_act={act!r} is not supported "
                         "(the MLPs here compute silu(gate) * up)")


def require_plain_rope(cfg: ModelConfig) -> None:
    kind = None if cfg.rope_scaling is None else cfg.rope_scaling.get(
        "rope_type", cfg.rope_scaling.get("type"))
    if kind not in PLAIN_ROPE_TYPES:
        raise ValueError(f"{cfg.architecture} with rope_scaling / rope_parameters rope_type="
                         f"{kind!r} is not supported (supported: default, linear, llama3)")


def refuse_window(cfg: ModelConfig, window: Optional[int], context_len: int) -> None:
    """HF masks keys with `kv_idx > q_idx - window`; positions stay below context_len, so a window
    of at least context_len is full attention (exact here) and a shorter one is refused."""
    if window is not None and window < context_len:
        raise ValueError(
            f"{cfg.architecture} with sliding_window={window} is not supported yet: positions "
            f"past the window would attend to tokens the model never sees. Pass "
            f"--context-length {window} (or less) to run it exactly within one window")


def used_window(cfg: ModelConfig) -> Optional[int]:
    """The window HF applies to some layer of this config, None for full attention everywhere.
    Qwen3 / Qwen3-MoE keep `sliding_window` only with `use_sliding_window` (their configs'
    __post_init__ drop it otherwise); Qwen3 then windows only the layers whose `layer_types`
    entry is "sliding_attention" (default: layers >= max_window_layers)."""
    hf = cfg.hf
    window = hf.get("sliding_window")
    mt = hf.get("model_type")
    if mt in ("qwen3", "qwen3_moe") and not hf.get("use_sliding_window", False):
        return None
    if mt == "qwen3" and window is not None:
        types = hf.get("layer_types") or [
            "sliding_attention" if i >= hf.get("max_window_layers", 28) else "full_attention"
            for i in range(cfg.num_layers)]
        if "sliding_attention" not in types:
            return None
    return window
