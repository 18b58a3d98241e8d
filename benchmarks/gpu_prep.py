"""Prepare, on the CPU machine, what the GPU suite needs and cannot build on the device.

The GPU machine has no network and the ShareGPT package (125 MB) and the bundled GGUF do not fit
the 64 MiB that travels with a device call, so this writes a small folder to carry instead:

    .carry/smollm2-tokenizer/     the bundled SmolLM2 tokenizer as an HF folder (token ids < 49152,
                                  valid for any Llama-3-vocab dummy model)
    .carry/sharegpt1000.json      1000 ShareGPT requests as token ids + the dataset's output length
                                  (capped at 1024), the standard serving set of SGLang's benchmark

    python benchmarks/gpu_prep.py --out .carry
"""

from __future__ import annotations

import argparse
import json
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from benchmarks import datasets as ds  # noqa: E402


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=".carry")
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--max-output-len", type=int, default=1024)
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args(argv)

    from radixlm.runtime.models import loader

    tok = loader.load_tokenizer(loader.default_model_path(), "gguf")
    tok_dir = os.path.join(args.out, "smollm2-tokenizer")
    os.makedirs(tok_dir, exist_ok=True)
    tok.save_pretrained(tok_dir)

    # SGLang bench filters: prompt <= 1024 tokens, prompt + output <= 2048
    reqs = ds.sample_sharegpt(tok, args.num_prompts, args.seed)
    rows = [{"prompt_ids": r.prompt_ids, "output_len": min(r.output_len, args.max_output_len)}
            for r in reqs]
    with open(os.path.join(args.out, f"sharegpt{args.num_prompts}.json"), "w") as f:
        json.dump(rows, f, separators=(",", ":"))
    n_in = sum(len(r["prompt_ids"]) for r in rows)
    n_out = sum(r["output_len"] for r in rows)
    print(json.dumps({"requests": len(rows), "input_tokens": n_in, "output_tokens": n_out,
                      "out": args.out}))


if __name__ == "__main__":
    main()
