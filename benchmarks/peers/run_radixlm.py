"""radixlm's side of the offline peer workloads: one in-process Engine, every workload in order.

    .venv/bin/python benchmarks/peers/run_radixlm.py --workloads-file W.json --out R.json

W.json comes from workloads.py (token ids + output lengths). Times each workload's `generate`
alone (start-up is timed separately), greedy with `ignore_eos`, so both peers produce exactly the
same number of tokens. Workloads run in the file's order in one engine, without flushing the
cache between them (round 2 has fresh prompts; whatever round 1 left in the cache stays, as it
would in a server). Writes R.json (with output ids, to compare the peers' outputs) and prints one
summary JSON line per workload.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(os.path.dirname(_HERE))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from benchmarks.peers import workloads as wl  # noqa: E402

# RADIXLM_PEERS_TREE (serve_and_run.radixlm_tree): radixlm imported from another tree, the harness
# (already imported above) from this one
if os.environ.get("RADIXLM_PEERS_TREE"):
    sys.path.insert(0, os.path.abspath(os.environ["RADIXLM_PEERS_TREE"]))


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workloads-file", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--model-path", default=None, help="default: the bundled SmolLM2 GGUF")
    p.add_argument("--dtype", default="bfloat16")
    args = p.parse_args(argv)

    import torch

    import radixlm

    workloads = wl.read_offline(args.workloads_file)
    t0 = time.perf_counter()
    kw = {"dtype": args.dtype}
    if args.model_path:
        kw["model_path"] = args.model_path
    engine = radixlm.Engine(**kw)
    startup_s = time.perf_counter() - t0
    results = []
    try:
        for w in workloads:
            sampling = [{"max_new_tokens": n, "temperature": 0, "ignore_eos": True}
                        for n in w.output_lens]
            t0 = time.perf_counter()
            outs = engine.generate(input_ids=w.prompt_ids, sampling_params=sampling)
            elapsed = time.perf_counter() - t0
            metas = [o.get("meta_info", {}) for o in outs]
            out_ids = [list(o.get("output_ids") or []) for o in outs]
            res = {
                "workload": w.name, "round": w.round, "elapsed_s": round(elapsed, 4),
                **w.summary(),
                "completion_tokens": sum(len(x) for x in out_ids),
                "prompt_tokens": sum(m.get("prompt_tokens", 0) for m in metas),
                "cached_tokens": sum(m.get("cached_tokens", 0) for m in metas),
            }
            print(json.dumps(res), flush=True)
            results.append({**res, "output_ids": out_ids})
        stats = None
        if hasattr(engine, "get_stats"):
            try:
                stats = engine.get_stats()
                json.dumps(stats)
            except Exception as e:  # stats must not lose the measurement
                stats = {"error": repr(e)}
    finally:
        engine.shutdown()
    doc = {"engine": "radixlm", "version": getattr(radixlm, "__version__", "?"),
           "package_dir": os.path.dirname(os.path.abspath(radixlm.__file__)),
           "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
           "dtype": args.dtype, "startup_s": round(startup_s, 3), "engine_stats": stats,
           "results": results}
    with open(args.out, "w") as f:
        json.dump(doc, f)
    return doc


if __name__ == "__main__":
    main()
