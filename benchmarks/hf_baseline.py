"""HF transformers reference for the throughput benchmarks: static batches through `generate`.

This is the baseline DESIGN.md section 8 asks every figure to be paired with. It is given its
best honest chance: requests are sorted by length so a batch wastes little padding, decoding is
greedy, and each batch produces exactly its longest request's output length (`min_new_tokens` =
`max_new_tokens`, so EOS never ends it early, as radixlm runs with `ignore_eos`).
"""

from __future__ import annotations

import os
import time
from typing import Optional

import torch

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_dtype(dtype, device: Optional[str] = None) -> torch.dtype:
    """torch dtype from a flag value; "auto" is what radixlm's engine picks, so both run alike."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        from radixlm.runtime.executor.model_runner import resolve_dtype as engine_dtype

        return engine_dtype("auto")
    try:
        return DTYPES[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; choose from auto, {', '.join(DTYPES)}") from None


def _dtype_kwarg(dtype: torch.dtype) -> dict:
    # transformers 5 renamed `torch_dtype` to `dtype` (the old name still works, with a warning)
    import transformers

    major = int(transformers.__version__.split(".")[0])
    return {"dtype": dtype} if major >= 5 else {"torch_dtype": dtype}


def load_hf_model(path_or_gguf: str, dtype="auto", device: Optional[str] = None, load_format: str = "auto"):
    """A HF causal LM in eval mode on `device`.

    A .gguf is de-quantized by transformers (needs `accelerate`); `load_format="dummy"` builds the
    architecture from the config with random weights (for timing shapes without real weights).
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    device = device or default_device()
    tdtype = resolve_dtype(dtype, device)
    if path_or_gguf.endswith(".gguf"):
        where = {"pretrained_model_name_or_path": os.path.dirname(path_or_gguf) or ".",
                 "gguf_file": os.path.basename(path_or_gguf)}
    else:
        where = {"pretrained_model_name_or_path": path_or_gguf}
    if load_format == "dummy":
        config = AutoConfig.from_pretrained(**where)
        model = AutoModelForCausalLM.from_config(config, **_dtype_kwarg(tdtype))
    else:
        model = AutoModelForCausalLM.from_pretrained(**where, **_dtype_kwarg(tdtype))
    return model.to(device=device, dtype=tdtype).eval()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _pad_id(model, tokenizer) -> int:
    for cand in (getattr(tokenizer, "pad_token_id", None), getattr(tokenizer, "eos_token_id", None),
                 getattr(model.generation_config, "pad_token_id", None),
                 getattr(model.generation_config, "eos_token_id", None)):
        if isinstance(cand, (list, tuple)):
            cand = cand[0] if cand else None
        if cand is not None:
            return int(cand)
    return 0  # any id: padded positions are masked out and never attended


def run_hf_generate(model, tokenizer, requests, batch_size: int, dtype="auto", sort_by_length: bool = True) -> dict:
    """Run `requests` (BenchRequest-like: prompt_ids, output_len) through batched greedy generate.

    Returns elapsed seconds (model time only, tokenization excluded: the ids are given) and token
    counts: `output_tokens` is the sum of the requested lengths (what radixlm produces), while
    `generated_tokens` counts every token the batches decoded, padding-to-the-batch-max included.
    """
    device = next(model.parameters()).device
    tdtype = resolve_dtype(dtype, device.type)
    if next(model.parameters()).dtype != tdtype:
        model = model.to(tdtype)
    pad_id = _pad_id(model, tokenizer)
    order = list(range(len(requests)))
    if sort_by_length:
        # similar output lengths in one batch waste fewer decode steps; then similar prompt lengths
        order.sort(key=lambda i: (requests[i].output_len, len(requests[i].prompt_ids)), reverse=True)

    generated = 0
    outputs: list[Optional[list[int]]] = [None] * len(requests)
    _sync(device)
    start = time.perf_counter()
    for b in range(0, len(order), max(1, batch_size)):
        idx = order[b : b + max(1, batch_size)]
        width = max(len(requests[i].prompt_ids) for i in idx)
        new = max(requests[i].output_len for i in idx)
        ids = torch.full((len(idx), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(idx), width), dtype=torch.long)
        for row, i in enumerate(idx):  # left padding: every row's last prompt token is aligned
            p = requests[i].prompt_ids
            ids[row, width - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[row, width - len(p):] = 1
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids.to(device),
                attention_mask=mask.to(device),
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                pad_token_id=pad_id,
            )
        gen = out[:, width:].tolist()
        generated += sum(len(g) for g in gen)
        for row, i in enumerate(idx):
            outputs[i] = gen[row][: requests[i].output_len]
    _sync(device)
    elapsed = time.perf_counter() - start
    return {
        "elapsed_s": elapsed,
        "num_requests": len(requests),
        "input_tokens": sum(len(r.prompt_ids) for r in requests),
        "output_tokens": sum(r.output_len for r in requests),
        "generated_tokens": generated,
        "batch_size": batch_size,
        "dtype": str(tdtype).replace("torch.", ""),
        "output_ids": outputs,
    }
