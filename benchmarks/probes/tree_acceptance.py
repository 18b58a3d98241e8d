"""Do draft trees accept more than chains for the same verify rows? A draft model (STANDALONE)
that is the target with N(0, sigma^2) added to every weight, greedy, adaptivity off, on a tiny
random Llama (tests/tiny_models.py) on the CPU: accepted drafts per verify and verify rows per
request, chains of 3 and 6 against trees of top-k 2 (3 levels, 6 nodes) and top-k 4 (3 levels,
9 nodes). Every arm's tokens must equal the first's. Prints one RESULT JSON line. Run from the
repository root: `python benchmarks/probes/tree_acceptance.py [--save]`."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile

import torch

sys.path[:0] = ["tests", "tests/unit"]
from test_speculative_standalone import _perturbed  # noqa: E402
from tiny_models import write_tiny_llama  # noqa: E402

import radixlm  # noqa: E402

V = 256
ARMS = {"chain_k3": dict(speculative_num_steps=3, speculative_num_draft_tokens=4),
        "chain_k6": dict(speculative_num_steps=6, speculative_num_draft_tokens=7),
        "tree_t2_s3_n6": dict(speculative_eagle_topk=2, speculative_num_steps=3,
                              speculative_num_draft_tokens=7),
        "tree_t4_s3_n9": dict(speculative_eagle_topk=4, speculative_num_steps=3,
                              speculative_num_draft_tokens=10)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sigmas", type=float, nargs="+", default=[0.02, 0.05])
    ap.add_argument("--save", action="store_true",
                    help="append to benchmarks/results/speculative-cpu.jsonl")
    args = ap.parse_args()
    root = tempfile.mkdtemp(prefix="tree-accept-")
    target = write_tiny_llama(os.path.join(root, "target"), vocab=V, heads=4, kv_heads=2,
                              tied=False)
    kw = dict(skip_tokenizer_init=True, max_total_tokens=8192, context_length=512,
              dtype="float32", speculative_algorithm="STANDALONE", speculative_adaptive=False)
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, V, (n,), generator=g).tolist()
               for n in (5, 9, 17, 33, 40, 50, 60, 70)]
    params = {"temperature": 0, "max_new_tokens": 64, "ignore_eos": True}
    res = {}
    for sigma in args.sigmas:
        draft = _perturbed(target, os.path.join(root, f"draft-{sigma}"), sigma)
        ref = None
        for name, extra in ARMS.items():
            eng = radixlm.Engine(model_path=target, speculative_draft_model_path=draft, **kw,
                                 **extra)
            try:
                outs = [o["output_ids"] for o in eng.generate(input_ids=prompts,
                                                              sampling_params=params)]
                s = eng.get_stats()
            finally:
                eng.shutdown()
            ref = ref or outs
            assert outs == ref, f"{name}: tokens differ from the first arm's"
            res[f"sigma{sigma}_{name}"] = {
                "accept_per_verify": round(s["spec_accepted_tokens"] / s["spec_verify_reqs"], 3),
                "rows_per_verify": round(1 + s["spec_draft_tokens"] / s["spec_verify_reqs"], 2)}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    line = dict(benchmark="tree_acceptance_probe", device=f"cpu: {os.cpu_count()} cores",
                model="tiny random Llama (tests/tiny_models.py), fp32", git_commit=commit,
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                command="python benchmarks/probes/tree_acceptance.py", **res)
    print("RESULT " + json.dumps(line))
    if args.save:
        with open("benchmarks/results/speculative-cpu.jsonl", "a") as f:
            f.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    main()
