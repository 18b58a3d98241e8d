"""vLLM's side of the offline peer workloads: one `vllm.LLM` (CPU build), every workload in order.

    benchmarks/peers/.venv-vllm/bin/python benchmarks/peers/run_vllm.py \
        --model benchmarks/peers/.cache/SmolLM2-135M-Instruct --workloads-file W.json --out R.json

The mirror of run_radixlm.py: same prompts (token ids via `TokensPrompt`), greedy, `ignore_eos`,
exact output lengths, prefix caching on, bf16; each workload's `generate` timed alone, start-up
(`LLM()`) timed separately. Runs in vLLM's own venv (install_vllm_cpu.sh); the model is the
HF folder convert_model.py makes from the bundled GGUF.

CPU settings (shared/FACTS.md): every core bound to vLLM's OpenMP threads and none reserved
(`VLLM_CPU_OMP_THREADS_BIND=0-<n-1>`, `VLLM_CPU_NUM_OF_RESERVED_CPU=0`); set here unless the
environment already says otherwise. `VLLM_CPU_KVCACHE_SPACE` (GiB of KV cache) is left to the
caller (compare.py sets 4, about radixlm's CPU pool for this model).
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


def cpu_env_defaults() -> dict:
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(n))
    bind = ",".join(map(str, cpus)) if cpus != list(range(cpus[0], cpus[-1] + 1)) else f"{cpus[0]}-{cpus[-1]}"
    return {"VLLM_CPU_OMP_THREADS_BIND": bind, "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
            "VLLM_TARGET_DEVICE": "cpu"}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="HF folder (convert_model.py)")
    p.add_argument("--workloads-file", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-model-len", type=int, default=4096)
    args = p.parse_args(argv)

    for k, v in cpu_env_defaults().items():
        os.environ.setdefault(k, v)

    import torch
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    workloads = wl.read_offline(args.workloads_file)
    t0 = time.perf_counter()
    llm = LLM(model=args.model, dtype=args.dtype, enable_prefix_caching=True,
              max_model_len=args.max_model_len, generation_config="vllm", seed=0)
    startup_s = time.perf_counter() - t0
    results = []
    for w in workloads:
        prompts = [TokensPrompt(prompt_token_ids=ids) for ids in w.prompt_ids]
        sampling = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True,
                                   detokenize=False) for n in w.output_lens]
        t0 = time.perf_counter()
        outs = llm.generate(prompts, sampling, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        out_ids = [list(o.outputs[0].token_ids) for o in outs]
        res = {
            "workload": w.name, "round": w.round, "elapsed_s": round(elapsed, 4),
            **w.summary(),
            "completion_tokens": sum(len(x) for x in out_ids),
            "prompt_tokens": sum(len(o.prompt_token_ids or []) for o in outs),
            "cached_tokens": sum(getattr(o, "num_cached_tokens", 0) or 0 for o in outs),
        }
        print(json.dumps(res), flush=True)
        results.append({**res, "output_ids": out_ids})
    cfg = {}
    try:  # what the engine chose (batching limits, KV blocks): useful when reading the numbers
        ec = llm.llm_engine.vllm_config
        cfg = {"max_num_seqs": ec.scheduler_config.max_num_seqs,
               "max_num_batched_tokens": ec.scheduler_config.max_num_batched_tokens,
               "num_gpu_blocks": getattr(ec.cache_config, "num_gpu_blocks", None),
               "block_size": ec.cache_config.block_size}
    except Exception as e:
        cfg = {"error": repr(e)}
    doc = {"engine": "vllm", "version": vllm.__version__, "torch": torch.__version__,
           "dtype": args.dtype, "startup_s": round(startup_s, 3), "engine_config": cfg,
           "env": {k: os.environ.get(k) for k in ("VLLM_CPU_OMP_THREADS_BIND",
                                                  "VLLM_CPU_NUM_OF_RESERVED_CPU",
                                                  "VLLM_CPU_KVCACHE_SPACE")},
           "results": results}
    with open(args.out, "w") as f:
        json.dump(doc, f)
    # vLLM's engine core is a child process; exit without waiting on its atexit teardown hangs
    del llm
    return doc


if __name__ == "__main__":
    main()
