"""What the architectures built on llama.py (Qwen3, Phi-3, Mixtral, Qwen3-MoE) share beyond it:
their sliding windows (`attention_spec`) and their refusals.

Each `check_supported` raises ValueError naming the config field it cannot run exactly, so a
model is refused at start-up instead of served with wrong numbers.
"""

from __future__ import annotations

from typing import Optional

from radixlm.runtime.attention.base import AttentionSpec
from radixlm.runtime.config import ModelConfig
from radixlm.runtime.models.sliding_windows import windows_by_layer_type

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


def layer_windows(cfg: ModelConfig) -> tuple[Optional[int], ...]:
    """Each layer's sliding window as HF 5.23 applies it (None: full attention).
    Phi-3 and Mixtral: `sliding_window` on every layer (their models build one sliding mask).
    Qwen3-MoE: on every layer, only with `use_sliding_window` (its config drops the window
    otherwise). Qwen3: only with `use_sliding_window`, on the layers `layer_types` marks
    "sliding_attention" (older configs: the layers >= `max_window_layers`), as Qwen2. A field
    config.json omits takes the HF config class's default, as HF reads it."""
    hf, n = cfg.hf, cfg.num_layers
    mt = hf.get("model_type")
    window = hf.get("sliding_window")
    if mt in ("qwen3", "qwen3_moe"):  # config default 4096, applied only with use_sliding_window
        window = hf.get("sliding_window", 4096) if hf.get("use_sliding_window", False) else None
    if mt != "qwen3":
        return (window,) * n
    return windows_by_layer_type(cfg, window)


def attention_spec(cfg: ModelConfig) -> AttentionSpec:
    """Scale head_dim**-0.5 and the per-layer windows above (every attention backend runs them:
    a query at position p reads the keys in (p - window, p], HF's `kv_idx > q_idx - window`)."""
    windows = layer_windows(cfg)
    return AttentionSpec(scale=cfg.head_dim ** -0.5,
                         windows=windows if any(w is not None for w in windows) else ())
