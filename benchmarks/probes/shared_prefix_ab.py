"""Does replaying decode CUDA graphs beat planned shared-prefix groups on the GPU suite's workload?

A/B in one process: decode batches a CUDA graph can take replay the graph (the default since
f1b62ac) vs shared-prefix groups always planned (the old behaviour, an eager step), on
gpu_suite's shared-prefix workload (32 groups x 16 prompts, 2048 shared + 64 own, 64 out).

    python benchmarks/probes/shared_prefix_ab.py   # GPU, from the repository root (the paths
                                                   # below are relative); one JSON line per
                                                   # round and mode
"""
import json
import os
import random
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if _ROOT not in sys.path:  # run as a script: the repository's packages
    sys.path.insert(0, _ROOT)

import radixlm  # noqa: E402
from benchmarks.gpu_suite_parts import shared_prefix_workload, timed_generate  # noqa: E402

if __name__ == "__main__":
    eng = radixlm.Engine(model_path="benchmarks/configs/llama-3.1-8b", load_format="dummy",
                         dtype="bfloat16", tokenizer_path=".carry/smollm2-tokenizer")
    vocab = eng.runner.model_config.vocab_size
    rng = random.Random(1)
    P, O = shared_prefix_workload(rng, vocab)
    orig = eng.runner.replays_decode_graph
    for rnd in range(2):
        for name, fn in (("graphs_first", orig), ("groups_always", lambda bs: False)):
            eng.runner.replays_decode_graph = fn
            eng.flush_cache()
            s0 = dict(eng.get_stats())
            dt = timed_generate(eng, P, O)[0]
            s1 = eng.get_stats()
            print(json.dumps({"round": rnd, "mode": name, "s": round(dt, 2),
                              "steps": s1["forward_steps"] - s0["forward_steps"],
                              "grouped": s1["shared_prefix_steps"] - s0["shared_prefix_steps"]}),
                  flush=True)
    eng.shutdown()
