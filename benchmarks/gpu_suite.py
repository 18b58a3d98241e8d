"""The GPU benchmark suite: radixlm and HF transformers on the same GPU, in one process.

    python benchmarks/gpu_suite.py --model-path benchmarks/configs/llama-3.1-8b \
        --tokenizer-path .carry/smollm2-tokenizer --sharegpt .carry/sharegpt1000.json \
        --result-file benchmarks/results/gpu_suite.jsonl

Dummy (random) bf16 weights of the config; greedy, `ignore_eos`, token ids in. Prints one JSON line:
  copy_TBps              measured device-to-device copy bandwidth (bytes read + written / s)
  roofline_bs1_tok_s     weight bytes / copy bandwidth: the batch-1 decode limit
  bs1_tok_s              radixlm, 1 request, 128 in / 256 out (output tokens / wall time)
  hf_static_compile_bs1_tok_s   HF generate, static cache + torch.compile, same shape
  batch128_out_tok_s     radixlm, 128 x (512 in, 128 out) offline
  hf_batch128_out_tok_s  HF generate, one padded batch of the same 128 requests
  sharegpt1000_out_tok_s 1000 ShareGPT requests (benchmarks/gpu_prep.py), outputs capped at 1024
  shared_prefix_on_s / _off_s   32 groups x 16 prompts (2048 shared + 64 own, 64 out), radix
                                cache on / off
`--only` runs a subset; `--profile DIR` writes torch.profiler tables of decode steps.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import random
import sys
import time

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from benchmarks.gpu_suite_parts import (copy_bandwidth_tbps, hf_batch128, hf_bs1,  # noqa: E402
                                        profile_decode, rand_ids, shared_prefix_workload,
                                        timed_generate)

PARTS = ("copy", "bs1", "hf_bs1", "batch128", "hf_batch128", "sharegpt", "shared_prefix")


def partial(res: dict) -> None:
    """Figures so far, in case a later part runs past the device's time limit."""
    print("PARTIAL " + json.dumps(res), flush=True)


_T0 = time.perf_counter()


class Terminated(Exception):
    """SIGTERM (e.g. from `timeout`) while a part runs: that part is recorded as failed and the
    suite still prints and stores its line with every figure measured so far."""


def _on_sigterm(signum, frame):
    import signal

    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM ends the process
    raise Terminated("SIGTERM (time limit)")


def run_part(args, res: dict, name: str, fn) -> bool:
    """Run one part; a failure is recorded in res["errors"] (with its traceback printed) and the
    suite goes on, so one broken part never loses the others' figures. Parts that would start
    after --budget-s seconds are skipped and listed in res["skipped"]."""
    if "errors" in res and any("SIGTERM" in e for e in res["errors"].values()):
        res.setdefault("skipped", []).append(name)
        return False
    if args.budget_s and time.perf_counter() - _T0 > args.budget_s:
        res.setdefault("skipped", []).append(name)
        print(f"SKIP {name}: past --budget-s {args.budget_s}", flush=True)
        return False
    t0 = time.perf_counter()
    try:
        fn()
        return True
    except Exception as e:  # noqa: BLE001 - recorded, printed, and the suite continues
        import traceback

        traceback.print_exc()
        res.setdefault("errors", {})[name] = f"{type(e).__name__}: {e}"[:400]
        return False
    finally:
        res.setdefault("part_s", {})[name] = round(time.perf_counter() - t0, 1)
        partial(res)

def make_engine(args, **kw):
    import radixlm

    base = dict(model_path=args.model_path, load_format="dummy", dtype="bfloat16",
                tokenizer_path=args.tokenizer_path, attention_backend=args.attention_backend,
                disable_cuda_graph=args.disable_cuda_graph, context_length=4096,
                device=args.device)
    base.update(args.engine_kw)
    base.update(kw)
    return radixlm.Engine(**base)


def free_engine(holder: dict) -> None:
    """Shut down holder["eng"] and release its GPU memory (KV pool, graphs, weights): the caller
    must hold no other reference, which is why the engine travels in a dict."""
    eng = holder.pop("eng", None)
    if eng is not None:
        eng.shutdown()
    del eng
    from radixlm.runtime.executor import model_runner

    model_runner._MODEL_CACHE.clear()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        print(f"freed engine: {torch.cuda.memory_allocated() / 1e9:.2f} GB still allocated",
              flush=True)


def run_radixlm(args, res: dict, vocab: int) -> None:
    rng = random.Random(args.seed)
    h: dict = {}
    t0 = time.perf_counter()
    if not run_part(args, res, "engine", lambda: h.update(eng=make_engine(args))):
        free_engine(h)
        if args.disable_cuda_graph:
            return
        # a broken graph capture must not lose every other figure: go on without graphs
        args.disable_cuda_graph = True
        if not run_part(args, res, "engine_no_graph", lambda: h.update(eng=make_engine(args))):
            return
    res["engine_ready_s"] = round(time.perf_counter() - t0, 2)
    eng = h["eng"]
    eng.generate(input_ids=[rand_ids(rng, 32, vocab) for _ in range(4)],  # warm-up
                 sampling_params={"max_new_tokens": 8, "temperature": 0, "ignore_eos": True})

    def bs1():
        prompt = rand_ids(rng, 128, vocab)
        timed_generate(eng, [prompt], [16])  # same shapes once more (graph, kernels warm)
        eng.flush_cache()
        ttft, _ = timed_generate(eng, [prompt], [1])  # prefill only (cache flushed: full prefill)
        eng.flush_cache()
        dt, n = timed_generate(eng, [prompt], [256])
        res["bs1_tok_s"] = round(n / dt, 1)
        res["bs1_prefill_s"] = round(ttft, 4)
        res["bs1_decode_tok_s"] = round((n - 1) / max(dt - ttft, 1e-9), 1)

    def batch128():
        dt, n = timed_generate(eng, [rand_ids(rng, 512, vocab) for _ in range(128)], [128] * 128)
        res["batch128_out_tok_s"] = round(n / dt, 1)

    def shared_on():
        eng.flush_cache()
        res["shared_prefix_on_s"] = round(timed_generate(eng, sp_prompts, sp_outs)[0], 2)

    def sharegpt():
        rows = json.load(open(args.sharegpt))[: args.sharegpt_n]
        eng.flush_cache()
        dt, n = timed_generate(eng, [r["prompt_ids"] for r in rows],
                               [r["output_len"] for r in rows])
        n_in = sum(len(r["prompt_ids"]) for r in rows)
        key = f"sharegpt{len(rows)}"
        res[f"{key}_out_tok_s"] = round(n / dt, 1)
        res[f"{key}_total_tok_s"] = round((n + n_in) / dt, 1)
        res[f"{key}_s"] = round(dt, 2)

    sp_prompts, sp_outs = shared_prefix_workload(rng, vocab)
    if "bs1" in args.only:
        run_part(args, res, "bs1", bs1)
    if "batch128" in args.only:
        run_part(args, res, "batch128", batch128)
    if args.profile:
        run_part(args, res, "profile", lambda: profile_decode(eng, rng, vocab, args.profile, res,
                                                       args.profile_bs))
    if "shared_prefix" in args.only:
        run_part(args, res, "shared_prefix_on", shared_on)
    if "sharegpt" in args.only and args.sharegpt:  # the longest radixlm part
        run_part(args, res, "sharegpt", sharegpt)
    try:
        res["engine_stats"] = eng.get_stats()
    except Exception as e:  # noqa: BLE001
        res.setdefault("errors", {})["engine_stats"] = repr(e)[:200]
    if torch.cuda.is_available():
        res["peak_gpu_mem_GB"] = round(torch.cuda.max_memory_allocated() / 1e9, 1)
    del eng
    free_engine(h)
    if "shared_prefix" in args.only:
        def shared_off():
            h["eng"] = make_engine(args, disable_radix_cache=True)
            res["shared_prefix_off_s"] = round(
                timed_generate(h["eng"], sp_prompts, sp_outs)[0], 2)
            if "shared_prefix_on_s" in res:
                res["shared_prefix_ratio"] = round(
                    res["shared_prefix_off_s"] / res["shared_prefix_on_s"], 2)
        run_part(args, res, "shared_prefix_off", shared_off)
        free_engine(h)

def run_hf(args, res: dict, vocab: int) -> None:
    h: dict = {}
    if "hf_batch128" in args.only:
        run_part(args, res, "hf_batch128", lambda: hf_batch128(args, res, vocab, h))
    if "hf_bs1" in args.only:
        run_part(args, res, "hf_bs1", lambda: hf_bs1(args, res, vocab, h))
    h.clear()
    gc.collect()
    torch.cuda.empty_cache()

def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-path", default=os.path.join(_ROOT, "benchmarks/configs/llama-3.1-8b"))
    p.add_argument("--tokenizer-path", default=".carry/smollm2-tokenizer")
    p.add_argument("--sharegpt", default=".carry/sharegpt1000.json")
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--disable-cuda-graph", action="store_true")
    p.add_argument("--only", default=",".join(PARTS), help=f"comma list of {PARTS}")
    p.add_argument("--profile", default=None, metavar="DIR")
    p.add_argument("--profile-bs", default="1,64", help="batch sizes the profile runs")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--result-file", default=None)
    p.add_argument("--device", default="cuda", help="cpu: a dry run of the suite's logic only")
    p.add_argument("--engine-kw", type=json.loads, default={},
                   help='extra Engine arguments as JSON, e.g. \'{"cuda_graph_max_bs": 256}\'')
    p.add_argument("--sharegpt-n", type=int, default=1000, help="first N ShareGPT requests")
    p.add_argument("--budget-s", type=float, default=0,
                   help="skip the parts that would start after this many seconds (0: none)")
    p.add_argument("--note", default=None, help="free text stored in the result line")
    args = p.parse_args(argv)
    args.only = set(args.only.split(","))
    args.profile_bs = [int(b) for b in args.profile_bs.split(",")]
    import signal

    signal.signal(signal.SIGTERM, _on_sigterm)
    unknown = args.only - set(PARTS)
    if unknown:
        p.error(f"--only: unknown part(s) {sorted(unknown)}; parts are {PARTS}")
    cfg = json.load(open(os.path.join(args.model_path, "config.json")))
    vocab = min(cfg["vocab_size"], 49152)  # ids valid for the carried SmolLM2 tokenizer too

    cuda = args.device.startswith("cuda")
    res: dict = {"device": torch.cuda.get_device_name(0) if cuda else "cpu (dry run)"}
    if cuda:
        import triton

        res["versions"] = {"torch": torch.__version__, "triton": triton.__version__}
    if "copy" in args.only and cuda:
        run_part(args, res, "copy", lambda: res.update(copy_TBps=round(copy_bandwidth_tbps(), 3)))
    run_radixlm(args, res, vocab)
    if args.only & {"hf_bs1", "hf_batch128"} and cuda:
        run_hf(args, res, vocab)  # after radixlm's engines are freed: the GPU holds one model
    if "copy_TBps" in res:
        from radixlm.runtime.config import ModelConfig

        mc = ModelConfig.from_hf(cfg)
        n_params = (mc.vocab_size * mc.hidden_size * (1 if mc.tie_word_embeddings else 2)
                    + mc.num_layers * (mc.hidden_size * (mc.num_heads + 2 * mc.num_kv_heads)
                                       * mc.head_dim + mc.num_heads * mc.head_dim * mc.hidden_size
                                       + 3 * mc.hidden_size * mc.intermediate_size))
        # batch-1 decode reads every weight once, except the embedding table (one row)
        weight_bytes = 2 * (n_params - (0 if mc.tie_word_embeddings else mc.vocab_size * mc.hidden_size))
        res["weight_GB"] = round(weight_bytes / 1e9, 2)
        res["roofline_bs1_tok_s"] = round(res["copy_TBps"] * 1e12 / weight_bytes, 1)
        if "bs1_tok_s" in res:
            res["bs1_fraction_of_roofline"] = round(res["bs1_tok_s"] / res["roofline_bs1_tok_s"], 3)
    for a, b in (("bs1_tok_s", "hf_static_compile_bs1_tok_s"),
                 ("batch128_out_tok_s", "hf_batch128_out_tok_s")):
        if a in res and b in res:
            res[a.replace("_tok_s", "_vs_hf")] = round(res[a] / res[b], 2)
    res.update({
        "attention_backend": args.attention_backend, "cuda_graph": not args.disable_cuda_graph,
        "model": os.path.basename(args.model_path), "dtype": "bfloat16", "load_format": "dummy",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": os.environ.get("RADIXLM_GIT_COMMIT", "unknown"),
        "engine_kw": args.engine_kw,
        "fused_ops": os.environ.get("RADIXLM_DISABLE_FUSED_OPS", "") in ("", "0"),
        "command": "python " + " ".join([os.path.relpath(__file__, _ROOT)] + sys.argv[1:]),
    })
    if args.note:
        res["note"] = args.note
    line = json.dumps(res)
    print(line, flush=True)
    if args.result_file:
        with open(args.result_file, "a") as f:
            f.write(line + "\n")
    return res


if __name__ == "__main__":
    main()
