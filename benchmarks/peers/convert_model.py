"""Convert the bundled GGUF (SmolLM2-135M-Instruct Q4_1) into an HF safetensors folder vLLM loads.

    python benchmarks/peers/convert_model.py --gguf PATH/SmolLM2-135M-Instruct.Q4_1.gguf \
        [--out benchmarks/peers/.cache/SmolLM2-135M-Instruct]

vLLM reads HF folders only. transformers 5.x de-quantizes the GGUF (to fp32) but refuses
`save_pretrained` on a GGUF-loaded model, so (shared/FACTS.md):
- the weights are `model.state_dict()` written with safetensors, fp32 (the de-quantized values;
  each engine rounds them to bf16 itself, as radixlm does from the GGUF), without
  `lm_head.weight` when the embeddings are tied;
- config.json: `quantization_config` deleted, `architectures` set (the GGUF config lacks it);
- the tokenizer is saved next to it (vLLM's server tokenizes the programs' text);
- no generation_config.json: the runners pass every sampling parameter explicitly.

Cached: a finished folder has `.converted` (with the GGUF's size and mtime) and is reused.
Needs torch, transformers, gguf, accelerate, safetensors (both venvs have them).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_OUT = os.path.join(HERE, ".cache", "SmolLM2-135M-Instruct")
STAMP = ".converted"


def _source_id(gguf: str) -> dict:
    st = os.stat(gguf)
    return {"gguf": os.path.abspath(gguf), "size": st.st_size, "mtime": int(st.st_mtime)}


def is_converted(out: str, gguf: str) -> bool:
    try:
        with open(os.path.join(out, STAMP)) as f:
            return json.load(f) == _source_id(gguf)
    except (OSError, ValueError):
        return False


def convert(gguf: str, out: str = DEFAULT_OUT, force: bool = False) -> str:
    """The HF folder for `gguf` (converted now unless already on disk). Returns its path."""
    if not force and is_converted(out, gguf):
        return out
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.perf_counter()
    d, f = os.path.split(os.path.abspath(gguf))
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)

    tmp = out + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    sd = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    if tied:
        sd.pop("lm_head.weight", None)
    save_file(sd, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})

    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)
    cfg["architectures"] = [type(model).__name__]  # LlamaForCausalLM
    cfg["torch_dtype"] = "float32"
    cfg["dtype"] = "float32"
    cfg["tie_word_embeddings"] = tied
    with open(os.path.join(tmp, "config.json"), "w") as fh:
        json.dump(cfg, fh, indent=2, sort_keys=True)
    tok.save_pretrained(tmp)

    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    with open(os.path.join(out, STAMP), "w") as fh:
        json.dump(_source_id(gguf), fh)
    print(f"converted {gguf} -> {out} ({len(sd)} tensors, tied={tied}) in "
          f"{time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gguf", required=True)
    p.add_argument("--out", default=DEFAULT_OUT)
    p.add_argument("--force", action="store_true")
    args = p.parse_args(argv)
    print(convert(args.gguf, args.out, args.force))


if __name__ == "__main__":
    main()
