"""An EAGLE-3 head's config, known before it loads: its shape, the target layers it reads and
its memory. A module apart from eagle3_model.py (torch modules) and eagle3.py (the speculator):
the target's ModelRunner reads it at start-up, to capture those layers (also inside its CUDA
graphs) and to leave the head its share of --mem-fraction-static.

The checkpoint's config.json is a Llama config (`architectures: ["LlamaForCausalLMEagle3"]`,
`num_hidden_layers: 1`) plus `draft_vocab_size` (its head's vocabulary, a subset of the
target's mapped through the `d2t` buffer), optionally `target_hidden_size` (the target's width
when it differs from the head's) and `eagle_config.eagle_aux_hidden_state_layer_ids` (which
target layers' outputs feed the head). Without those ids SGLang takes the outputs of layers
1, L // 2 - 1 and L - 4 (it captures the inputs of layers 2, L // 2, L - 3).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from radixlm.runtime.config import ModelConfig
from radixlm.runtime.models import loader

ARCHITECTURES = ("LlamaForCausalLMEagle3",)


@dataclass(frozen=True)
class Eagle3Config:
    model: ModelConfig  # the head's decoder layer: hidden, heads, rope, eps, vocab (target's)
    draft_vocab: int  # rows of its lm_head (== model.vocab_size: no d2t needed)
    target_hidden: int  # width of each captured target feature; fc takes 3 of them
    aux_layers: tuple[int, ...]  # target layers (0-based) whose outputs are captured

    @property
    def fc_in(self) -> int:
        return len(self.aux_layers) * self.target_hidden


def load_format(args) -> str:
    """Random head weights when the target's are (`--load-format dummy`, as SGLang does)."""
    if args.load_format == "dummy":
        return "dummy"
    return loader.resolve_load_format(args.speculative_draft_model_path)


def resolve(args, target: ModelConfig) -> Eagle3Config:
    """The head's config from --speculative-draft-model-path, checked against the target.
    Raises ValueError naming the flag for a head that cannot serve this target."""
    path = args.speculative_draft_model_path
    flag = "speculative_draft_model_path"
    try:
        hf = loader.load_hf_config(path, load_format(args))
    except (OSError, ValueError) as e:
        raise ValueError(f"{flag}: cannot read the EAGLE-3 head's config.json ({e})") from e
    arch = (hf.get("architectures") or [""])[0]
    if arch not in ARCHITECTURES:
        raise ValueError(f"{flag}: architecture {arch!r} is not an EAGLE-3 head "
                         f"({', '.join(ARCHITECTURES)})")
    if hf.get("num_hidden_layers", 1) != 1:
        raise ValueError(f"{flag}: num_hidden_layers={hf['num_hidden_layers']}: only one-layer "
                         "EAGLE-3 heads are built")
    cfg = ModelConfig.from_hf(hf)
    if cfg.vocab_size != target.vocab_size:
        raise ValueError(f"{flag}: the head's vocab_size ({cfg.vocab_size}) differs from the "
                         f"target's ({target.vocab_size})")
    draft_vocab = hf.get("draft_vocab_size") or cfg.vocab_size
    if not 0 < draft_vocab <= cfg.vocab_size:
        raise ValueError(f"{flag}: draft_vocab_size {draft_vocab} not in [1, {cfg.vocab_size}]")
    target_hidden = hf.get("target_hidden_size") or cfg.hidden_size
    if target_hidden != target.hidden_size:
        raise ValueError(f"{flag}: the head reads target features of width {target_hidden}, "
                         f"the target's hidden_size is {target.hidden_size}")
    return Eagle3Config(cfg, int(draft_vocab), int(target_hidden),
                        aux_layer_ids(hf, target.num_layers))


def aux_layer_ids(hf: dict, num_layers: int) -> tuple[int, ...]:
    """The target layers whose outputs the head reads: the config's ids, else SGLang's
    default (outputs of 1, L // 2 - 1, L - 4)."""
    ids: Optional[list] = (hf.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if not ids:
        ids = [1, num_layers // 2 - 1, num_layers - 4]
    if len(ids) != 3 or not all(isinstance(i, int) and 0 <= i < num_layers for i in ids):
        raise ValueError(f"speculative_draft_model_path: EAGLE-3 target layers {list(ids)} are "
                         f"not 3 layers of a {num_layers}-layer target (set "
                         "eagle_config.eagle_aux_hidden_state_layer_ids in its config.json)")
    return tuple(ids)


def capture_layers(args, target: ModelConfig) -> tuple[int, ...]:
    """What the target's ModelRunner captures: the head's layers with EAGLE3 on, else ()."""
    if str(args.speculative_algorithm).upper() != "EAGLE3":
        return ()
    return resolve(args, target).aux_layers


def draft_memory(args, target: ModelConfig, dtype: torch.dtype) -> tuple[int, int]:
    """(KV bytes per target slot, weight bytes) of the head: its pool has one layer and a slot
    per target slot (eagle3.py); weights fc, the layer (q/k/v read 2 * hidden), norms, lm_head
    (the embedding is the target's)."""
    from radixlm.runtime.mem_cache.kv_pool import KVPool

    e = resolve(args, target)
    c = e.model
    h, d = c.hidden_size, c.head_dim
    params = (e.fc_in * h + 2 * h * d * (c.num_heads + 2 * c.num_kv_heads) + c.num_heads * d * h
              + 3 * h * c.intermediate_size + e.draft_vocab * h + 4 * h)
    elem = torch.empty((), dtype=dtype).element_size()
    return KVPool.bytes_per_token(1, c.num_kv_heads, d, dtype), params * elem
