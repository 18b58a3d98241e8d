"""Speculative decoding (NGRAM) on vs off in one process, one engine, alternating runs.

    python benchmarks/speculative.py --workload copy --batch 1 --rounds 3 --save

One Engine is built with --speculative-algorithm NGRAM; an "off" run detaches its speculator
(the scheduler then runs exactly its plain decode code), an "on" run attaches a fresh one (empty
n-gram tables, cold cost model: nothing learned from an earlier run's identical answers). The
radix cache is flushed before every run, so both see the same prefill work. This machine is
shared and its load swings within minutes (a batch-1 decode step took 13 ms idle and 145 ms at a
load average of 5), so the arms alternate at a fine grain: the requests go in chunks (--chunk,
default 8 at batch 1, the whole batch otherwise), each chunk runs off then on or on then off
(flipping every chunk), and each arm's tok/s is its total tokens over its total time; the median
of the per-chunk ratios is reported too, and the load average at start and end.

Workloads (benchmarks/workloads/spec_text.py, chat prompts from ShareGPT text, greedy):
copy (return a JSON document / code block with one change), extract (quote a passage), chat.
--batch 1 runs one request at a time (max_running_requests=1); --batch N lets N run together.
--drafts random replaces the n-gram drafts with random token ids (never accepted): with
--speculative-adaptive on it measures what drafts that never pay cost; with it off, tok/s off/on is
the cost of one verify step of k drafts against one plain decode step (each verify appends one
token). On a GPU, --load-format dummy with --model-path benchmarks/configs/llama-3.1-8b and a
--tokenizer-path runs the 8B shape on dummy weights.
Prints one JSON line per workload: output tok/s off and on, their ratio, the on runs'
mean accept length (tokens a request appended per verify it drafted in) and how often drafts
ran; --save appends it to benchmarks/results/speculative-<device>.jsonl.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import statistics
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from benchmarks import datasets as ds  # noqa: E402
from benchmarks.offline_throughput import (  # noqa: E402
    default_model_path, device_name, emit_result, git_commit)
from benchmarks.workloads import spec_text  # noqa: E402

SPEC_STATS = ("spec_verify_steps", "spec_verify_reqs", "spec_verify_tokens", "spec_draft_tokens",
              "spec_accepted_tokens", "forward_steps")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workload", action="append", choices=spec_text.WORKLOADS,
                   help="repeatable; default: all three")
    p.add_argument("--batch", type=int, default=1, help="requests decoding together")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--rounds", type=int, default=2, help="passes over the requests")
    p.add_argument("--chunk", type=int, default=None,
                   help="requests per alternation (default: 8 at batch 1, else the batch)")
    p.add_argument("--model-path", default=None)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--gguf-keep-quantized", default="auto", choices=["auto", "on", "off"])
    p.add_argument("--speculative-num-draft-tokens", type=int, default=None)
    p.add_argument("--speculative-algorithm", default="NGRAM",
                   choices=["NGRAM", "STANDALONE", "EAGLE3"])
    p.add_argument("--draft-model-path", default=None,
                   help="STANDALONE: the draft model (the target's vocabulary); EAGLE3: the "
                        "head (its off runs still capture the target's layers: one engine)")
    p.add_argument("--no-speculative-adaptive", action="store_true")
    p.add_argument("--arms", default=None,
                   help="comma list of NUM_DRAFT_TOKENS[:fixed], each an on arm against off on "
                        "the same engine (e.g. 8,5:fixed,9:fixed); default: the two flags above")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--drafts", default="ngram", choices=["ngram", "random"],
                   help="random: drafts of random token ids, never accepted")
    p.add_argument("--load-format", default="auto")
    p.add_argument("--tokenizer-path", default=None)
    p.add_argument("--sharegpt", default=None, help="a ShareGPT JSON file (default: the package's)")
    p.add_argument("--device", default=None, help="default: cuda when available")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="every request's output length (default: the workload's)")
    p.add_argument("--save", action="store_true",
                   help="append to benchmarks/results/speculative-<cpu|gpu>.jsonl")
    return p.parse_args(argv)


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def _run(eng, ids, params, spec_on: bool, make_spec) -> dict:
    sched = eng.scheduler

    def setup():
        sched.flush_cache()
        sched.spec = make_spec() if spec_on else None

    eng._call_in_loop(setup)
    before = eng.get_stats()
    t0 = time.perf_counter()
    outs = eng.generate(input_ids=ids, sampling_params=params)
    elapsed = time.perf_counter() - t0
    after = eng.get_stats()
    d = {k: after.get(k, 0) - before.get(k, 0) for k in SPEC_STATS}
    tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
    return {"tok_s": tokens / elapsed, "tokens": tokens, "s": elapsed, "stats": d,
            "ids": [o["output_ids"] for o in outs]}


def _random_drafts(vocab: int, seed: int):
    """A stand-in for ngram.propose: `max_len` random token ids, claimed as the longest match."""
    import random

    from radixlm.runtime.speculative import ngram

    rng = random.Random(seed)

    def propose(own, shared, max_len):
        return [rng.randrange(vocab) for _ in range(max(max_len, 0))], own.max_n

    assert ngram.propose.__code__.co_varnames[:3] == ("own", "shared", "max_len")
    return propose


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    import radixlm
    from radixlm.runtime import speculative
    from radixlm.runtime.speculative import spec_config

    commit = git_commit()  # the code this process imported (later edits do not count)
    model_path = args.model_path or default_model_path()
    tok = ds.load_tokenizer(args.tokenizer_path or model_path)
    kw = dict(model_path=model_path, dtype=args.dtype, gguf_keep_quantized=args.gguf_keep_quantized,
              max_running_requests=args.batch, speculative_algorithm=args.speculative_algorithm,
              speculative_draft_model_path=args.draft_model_path,
              speculative_adaptive=not args.no_speculative_adaptive)
    if args.speculative_num_draft_tokens:
        kw["speculative_num_draft_tokens"] = args.speculative_num_draft_tokens
    for name in ("load_format", "tokenizer_path", "device"):
        if getattr(args, name) not in (None, "auto"):
            kw[name] = getattr(args, name)
    eng = radixlm.Engine(**kw)
    if args.drafts == "random":
        from radixlm.runtime.speculative import ngram_drafter

        ngram_drafter.propose = _random_drafts(len(tok), args.seed)
    arms = [(args.speculative_num_draft_tokens, not args.no_speculative_adaptive)]
    if args.arms:
        arms = [(int(a.split(":")[0]), not a.endswith(":fixed")) for a in args.arms.split(",")]
    standalone = args.speculative_algorithm in ("STANDALONE", "EAGLE3")
    if standalone and (args.arms or args.drafts != "ngram"):
        raise SystemExit("--arms and --drafts are for NGRAM (a draft model keeps one runner)")

    def arm_args(tokens, adaptive):
        return dataclasses.replace(eng.server_args, speculative_num_draft_tokens=tokens,
                                   speculative_adaptive=adaptive)

    def make_arm(arm):
        if standalone:  # one draft runner (weights, pool) for all runs
            draft_spec = eng.scheduler.spec

            def make_spec():  # a cold cost model and global acceptance each run, as NGRAM's
                old = draft_spec.policy
                draft_spec.policy = type(old)(draft_spec.cfg.adaptive, eng.runner.device.type,
                                              overlap=old.fast_skips)
                return draft_spec
            return make_spec
        return lambda a=arm_args(*arm): speculative.create(a, eng.scheduler)

    make_spec = make_arm(arms[0])
    results = []
    try:
        warm = tok("The quick brown fox jumps over the lazy dog. " * 4)["input_ids"]
        for on in (False, True):
            _run(eng, [warm], [{"temperature": 0, "max_new_tokens": 16}], on, make_spec)
        for workload, arm in itertools.product(args.workload or list(spec_text.WORKLOADS), arms):
            make_spec = make_arm(arm)
            items = spec_text.build(workload, args.num_requests, args.seed, args.sharegpt)
            texts = [tok.apply_chat_template(m, add_generation_prompt=True, tokenize=False)
                     for m, _ in items]
            ids = tok(texts, add_special_tokens=False)["input_ids"]
            params = [{"temperature": 0, "max_new_tokens": args.max_new_tokens or n,
                       "ignore_eos": args.max_new_tokens is not None} for _, n in items]
            load_start = _load()
            chunk = args.chunk or (8 if args.batch == 1 else args.batch)
            runs = {False: [], True: []}
            flip = 0
            for _ in range(args.rounds):
                for c in range(0, len(ids), chunk):
                    part = slice(c, c + chunk)
                    for on in ((False, True) if flip % 2 == 0 else (True, False)):
                        runs[on].append(_run(eng, ids[part], params[part], on, make_spec))
                    flip += 1
            tok_s = {on: sum(x["tokens"] for x in runs[on]) / sum(x["s"] for x in runs[on])
                     for on in runs}
            off_med, on_med = tok_s[False], tok_s[True]
            chunk_ratio = statistics.median(y["tok_s"] / x["tok_s"]
                                            for x, y in zip(runs[False], runs[True]))
            st = {k: sum(x["stats"][k] for x in runs[True]) for k in SPEC_STATS}
            same = sum(a == b for x, y in zip(runs[False], runs[True])
                       for a, b in zip(x["ids"], y["ids"]))
            res = {
                "benchmark": "speculative", "workload": workload, "batch": args.batch,
                "algorithm": args.speculative_algorithm, "draft_model": args.draft_model_path,
                "requests": len(ids), "drafts": args.drafts,
                "device": device_name(argparse.Namespace(device=eng.runner.device.type)),
                "model": os.path.basename(model_path.rstrip("/")),
                "dtype": str(eng.runner.dtype).removeprefix("torch."),
                "gguf_keep_quantized": eng.runner.keep_quantized, "git_commit": commit,
                "num_draft_tokens": spec_config.resolve(arm_args(*arm)).max_draft + 1,
                "adaptive": arm[1],
                "tok_s_off": round(off_med, 2), "tok_s_on": round(on_med, 2),
                "ratio": round(on_med / off_med, 3),
                "median_chunk_ratio": round(chunk_ratio, 3),
                "chunks_tok_s_off": [round(x["tok_s"], 1) for x in runs[False]],
                "chunks_tok_s_on": [round(x["tok_s"], 1) for x in runs[True]],
                "output_tokens_per_pass": sum(x["tokens"] for x in runs[False]) // args.rounds,
                "mean_accept_length": round(st["spec_verify_tokens"] / st["spec_verify_reqs"], 3)
                if st["spec_verify_reqs"] else None,
                "drafted_steps_share": round(st["spec_verify_steps"] / st["forward_steps"], 3)
                if st["forward_steps"] else None,
                "draft_tokens_per_verify":
                round(st["spec_draft_tokens"] / st["spec_verify_reqs"], 2)
                if st["spec_verify_reqs"] else None,
                "same_outputs_share": round(same / (len(ids) * args.rounds), 3),
                "rounds": args.rounds, "chunk": chunk,
                "loadavg_start": load_start, "loadavg_end": _load(),
            }
            out = None
            if args.save:
                kind = "gpu" if eng.runner.device.type == "cuda" else "cpu"
                out = os.path.join(_ROOT, "benchmarks", "results", f"speculative-{kind}.jsonl")
            results.append(emit_result(res, out, __file__))
    finally:
        eng.shutdown()
    return results


if __name__ == "__main__":
    main()
