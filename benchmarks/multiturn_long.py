"""Long multi-turn chats whose KV outgrows the device pool: the hierarchical cache on vs off.

    python benchmarks/multiturn_long.py --save        # CPU: bundled SmolLM2, defaults below
    # GPU, Llama-3.1-8B shape, dummy weights: conversations sampled here, carried there
    python benchmarks/multiturn_long.py --dump-conversations .carry/convs.json \
        --tokenizer-path .carry/smollm2-tokenizer --num-conversations 64 --turns 5 \
        --first-turn-len 4096 --question-len 256 --output-len 64
    python benchmarks/multiturn_long.py --conversations .carry/convs.json \
        --model-path benchmarks/configs/llama-3.1-8b --load-format dummy --dtype bfloat16 \
        --tokenizer-path .carry/smollm2-tokenizer --num-conversations 64 --turns 5 \
        --first-turn-len 4096 --question-len 256 --output-len 64 --concurrency 32 --save

N ShareGPT conversations, turns interleaved round-robin (turn t of every conversation, then turn
t + 1), each turn = the whole history + a new question, answered with `--output-len` greedy
tokens (ignore_eos: every configuration does the same work); the answer joins the history. The
device pool is capped at `--device-fraction` of the KV working set (the histories' total at the
end), so with the radix cache alone each conversation's history is evicted before its next turn.
Runs, each a fresh Engine in this process (`--server`: a server process each, driven over HTTP
as SGLang's clients do, benchmarks/server_client.py: the in-process Engine's scheduler thread
shares the GIL with this client's work on every streamed token):
  off      radix cache only, turns 1..T-1
  on       + host pool holding the working set + file store (write_through), same turns
  restart  a new engine on `on`'s store (warm) and one on an empty store (cold) both replay
           turn T of every conversation: the first turns after a restart, one request at a time
           by default (--restart-concurrency), so TTFT is the turn's own prefill or load and
           not its wait behind other requests' decoding
Prints one JSON line (throughput, TTFT p50/p90, per-tier hits and bytes, the ratios, whether
`off` and `on` generated the same tokens, the machine's load); --save appends it to
benchmarks/results/multiturn_long-<device>.jsonl with the date, commit and command.

`tokens_identical` holds in fp32. In bf16 on a CPU it need not: `off` recomputes in one prefill
the KV that `on` kept from decode steps, and the CPU's linear layers round differently for one
row than for many (GGUF blocks below 17 rows, packed bf16 weights above), as the plain radix
cache on vs off does. On a shared, oversubscribed CPU run it with OMP_WAIT_POLICY=PASSIVE (or
OMP_NUM_THREADS=1): with other processes on the cores, spinning OpenMP threads stalled at
barriers and a 50 ms decode step took 1-2 s (2026-11-27, load 4-6 on 2 cores).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from benchmarks import datasets as ds  # noqa: E402
from benchmarks.offline_throughput import (default_model_path, device_name, emit_result,  # noqa: E402
                                           git_commit)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-path", default=None, help="default: the bundled SmolLM2 GGUF")
    p.add_argument("--load-format", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--num-conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=5, help="user turns per conversation (the last "
                                                        "is the restart phase's)")
    p.add_argument("--first-turn-len", type=int, default=768)
    p.add_argument("--question-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=4, help="requests in flight at once")
    p.add_argument("--restart-concurrency", type=int, default=1)
    p.add_argument("--device-fraction", type=float, default=0.25,
                   help="device pool (max_total_tokens) / KV working set")
    p.add_argument("--hicache-ratio", type=float, default=None,
                   help="default: a host pool 1.25x the working set")
    p.add_argument("--hicache-write-policy", default="write_through")
    p.add_argument("--no-storage", action="store_true",
                   help="`on` with the host pool only (no file store, no restart phase)")
    p.add_argument("--storage-dir", default=None, help="default: a fresh temporary folder")
    p.add_argument("--write-queue-pages", type=int, default=None,
                   help="the page-write queue's bound (default: the engine's); 0 writes pages on "
                        "the scheduler's thread, as before the writer thread")
    p.add_argument("--prefetch-policy", default=None,
                   choices=["best_effort", "wait_complete", "timeout"],
                   help="--hicache-storage-prefetch-policy (default: the engine's, timeout)")
    p.add_argument("--skip-off", action="store_true",
                   help="no `off` run (no ratios, no tokens_identical): comparing `on` variants")
    p.add_argument("--server", action="store_true",
                   help="each arm a server process driven over HTTP (SGLang's client's way), "
                        "not an in-process Engine sharing the GIL with the client")
    p.add_argument("--disable-piecewise-cuda-graph", action="store_true",
                   help="both arms' extends launched op by op (CUDA)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save", action="store_true",
                   help="append the line to benchmarks/results/multiturn_long-<device>.jsonl")
    p.add_argument("--note", default=None, help="free text stored with the result")
    # the GPU machine has neither the ShareGPT package nor a tokenizer for a dummy-weight config:
    # sample the conversations here (--dump-conversations) and carry the file (--conversations)
    p.add_argument("--tokenizer-path", default=None, help="for sampling; default: --model-path")
    p.add_argument("--dump-conversations", default=None, metavar="FILE",
                   help="write the sampled conversations (token ids) to FILE and exit")
    p.add_argument("--conversations", default=None, metavar="FILE",
                   help="read conversations written by --dump-conversations instead of sampling")
    return p.parse_args(argv)


async def _one(eng, prompt: list[int], sp: dict) -> dict:
    t0 = time.perf_counter()
    ttft, last = None, None
    async for chunk in await eng.async_generate(input_ids=prompt, sampling_params=sp, stream=True):
        if ttft is None and chunk["output_ids"]:
            ttft = time.perf_counter() - t0
        last = chunk
    meta = last["meta_info"]
    return {"ttft": ttft, "latency": time.perf_counter() - t0, "output_ids": last["output_ids"],
            "cached": meta["cached_tokens"], "details": meta.get("cached_tokens_details")}


async def _turns(eng, convs, histories, turns, args, concurrency: int) -> list[dict]:
    """Run `turns` of every conversation, `concurrency` requests at a time; updates histories in
    place. Returns one record per request."""
    sp = {"temperature": 0, "max_new_tokens": args.output_len, "ignore_eos": True}
    sem = asyncio.Semaphore(concurrency)
    records = []

    async def turn_of(i: int, t: int) -> None:
        prompt = histories[i] + (convs[i].first_ids if t == 0 else convs[i].question_ids[t - 1])
        async with sem:
            rec = await _one(eng, prompt, sp)
        histories[i] = prompt + rec["output_ids"]
        records.append(dict(rec, conv=i, turn=t, prompt_len=len(prompt)))

    for t in turns:
        await asyncio.gather(*(turn_of(i, t) for i in range(len(convs))))
    return records


def _run(engine_kw: dict, convs, histories, turns, args,
         concurrency: int) -> tuple[dict, list[dict]]:
    t_start = time.perf_counter()
    if args.server:  # its own process, over HTTP (benchmarks/server_client.py says why)
        from benchmarks.server_client import ServerProcess
        eng = ServerProcess(engine_kw)
    else:
        import radixlm
        eng = radixlm.Engine(**engine_kw)
    start_s = time.perf_counter() - t_start  # (weights, KV pools, CUDA graphs: decode, pieces)

    async def drive():
        try:
            return await _turns(eng, convs, histories, turns, args, concurrency)
        finally:
            if args.server:
                await eng.aclose()

    try:
        eng.generate(input_ids=list(range(1000, 1016)), sampling_params={"max_new_tokens": 4})
        eng.flush_cache()  # warm-up done: device and host empty (a store keeps what it has)
        t0 = time.perf_counter()
        records = asyncio.run(drive())
        elapsed = time.perf_counter() - t0
        stats = eng.get_stats()
    finally:
        eng.shutdown()
    ttfts = sorted(r["ttft"] for r in records)
    hits = {"device": 0, "host": 0, "storage": 0}
    for r in records:
        for tier, n in (r["details"] or {"device": r["cached"]}).items():
            hits[tier] += n
    out = {"requests": len(records), "duration_s": round(elapsed, 2),
           "requests_per_s": round(len(records) / elapsed, 4),
           "output_tokens_per_s": round(len(records) * args.output_len / elapsed, 2),
           "prompt_tokens": sum(r["prompt_len"] for r in records),
           "cached_tokens": sum(r["cached"] for r in records), "hit_tokens": hits,
           "ttft_p50_s": round(_pct(ttfts, 50), 4), "ttft_p90_s": round(_pct(ttfts, 90), 4),
           "latency_mean_s": round(statistics.mean(r["latency"] for r in records), 3),
           # turn 1 is a cold prefill with the tiers on or off; later turns show the cache
           "ttft_p50_by_turn_s": {t + 1: round(statistics.median(
               r["ttft"] for r in records if r["turn"] == t), 4)
               for t in sorted({r["turn"] for r in records})},
           "retractions": stats["retractions"], "forward_steps": stats["forward_steps"],
           "extend_steps": stats["extend_steps"], "busy_s": round(stats["busy_s"], 2),
           "engine_start_s": round(start_s, 1)}
    tiers = stats.get("hicache")
    if tiers:
        out["bytes_moved"] = {k[6:]: v for k, v in tiers.items() if k.startswith("bytes_")}
        out["storage_pages"] = {k: tiers["storage"].get(k) for k in
                                ("pages_written", "pages_read", "pages_corrupt", "pages_dropped")}
        out["storage_pages"]["pages_write_dropped"] = tiers.get("pages_write_dropped")
        # the scheduler thread's time on page writes (queueing them, or writing them itself)
        out["storage_write_scheduler_s"] = round(tiers.get("storage_write_scheduler_s", 0.0), 3)
        # reads from the store: prefetches started while requests waited, admissions that did
        # not wait because recomputing was faster, reads cut short by a missing or bad page
        out["prefetch"] = {k: tiers.get(k) for k in ("prefetch_started", "prefetch_dropped",
                                                     "storage_loads_skipped",
                                                     "storage_load_failures")}
        out["host_capacity_tokens"] = tiers["host"]["capacity"]
        # what a storage read delivered against what a prefill computes, in tokens/s
        read_bps = tiers.get("storage_read_bytes_per_s")
        out["storage_read_tokens_per_s"] = (round(read_bps / tiers["host"]["bytes_per_token"])
                                            if read_bps else None)
        out["prefill_tokens_per_s"] = (round(tiers["prefill_tokens_per_s"])
                                       if tiers.get("prefill_tokens_per_s") else None)
    return out, records


def _torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def _pct(sorted_vals: list[float], q: float) -> float:
    k = (len(sorted_vals) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return sorted_vals[lo] + (sorted_vals[hi] - sorted_vals[lo]) * (k - lo)


def _conversations(args) -> list:
    if args.conversations:
        with open(args.conversations) as f:
            convs = [ds.Conversation(**c) for c in json.load(f)]
        if (len(convs) < args.num_conversations
                or any(len(c.question_ids) < args.turns - 1 for c in convs)):
            raise SystemExit(f"{args.conversations}: fewer conversations or turns than asked")
        return [ds.Conversation(**dict(dataclasses.asdict(c),
                                       question_ids=c.question_ids[:args.turns - 1]))
                for c in convs[:args.num_conversations]]
    tok = ds.load_tokenizer(args.tokenizer_path or args.model_path)
    return ds.sample_sharegpt_conversations(tok, args.num_conversations, args.turns,
                                            args.first_turn_len, args.question_len, args.seed)


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.turns < 2:
        raise SystemExit("--turns must be >= 2 (the last turn is the restart phase's)")
    args.model_path = args.model_path or default_model_path()
    convs = _conversations(args)
    if args.dump_conversations:
        with open(args.dump_conversations, "w") as f:
            json.dump([dataclasses.asdict(c) for c in convs], f, separators=(",", ":"))
        print(json.dumps({"conversations": len(convs), "out": args.dump_conversations}))
        return {}
    per_conv = (args.first_turn_len + (args.turns - 1) * args.question_len
                + args.turns * args.output_len)
    working_set = per_conv * len(convs)
    device_pool = int(working_set * args.device_fraction)
    if device_pool < per_conv + args.output_len:
        raise SystemExit(f"a {device_pool}-token device pool cannot hold one {per_conv}-token "
                         f"conversation: raise --device-fraction")
    ratio = args.hicache_ratio or math.ceil(125 * working_set / device_pool) / 100
    base = dict(model_path=args.model_path, load_format=args.load_format, dtype=args.dtype,
                device=args.device, max_total_tokens=device_pool,
                context_length=per_conv + 64, tokenizer_path=args.tokenizer_path,
                disable_piecewise_cuda_graph=args.disable_piecewise_cuda_graph)
    store = args.storage_dir or tempfile.mkdtemp(prefix="multiturn-store-")
    empty = tempfile.mkdtemp(prefix="multiturn-empty-")

    def tiered(folder: str) -> dict:
        kw = dict(base, enable_hierarchical_cache=True, hicache_ratio=ratio,
                  hicache_write_policy=args.hicache_write_policy)
        if args.no_storage:
            return kw
        extra = {"file_storage_path": folder}
        if args.write_queue_pages is not None:
            extra["write_queue_pages"] = args.write_queue_pages
        if args.prefetch_policy is not None:
            kw["hicache_storage_prefetch_policy"] = args.prefetch_policy
        return dict(kw, hicache_storage_backend="file",
                    hicache_storage_backend_extra_config=json.dumps(extra))

    main_turns = range(args.turns - 1)
    load_start = os.getloadavg()
    res: dict = {"benchmark": "multiturn_long", "device": device_name(args),
                 "git_commit": git_commit(), "model": os.path.basename(args.model_path),
                 "dtype": args.dtype, "conversations": len(convs), "turns": args.turns,
                 "first_turn_len": args.first_turn_len, "question_len": args.question_len,
                 "output_len": args.output_len, "concurrency": args.concurrency,
                 "restart_concurrency": args.restart_concurrency,
                 "working_set_tokens": working_set, "device_pool_tokens": device_pool,
                 "hicache_ratio": ratio, "write_policy": args.hicache_write_policy,
                 "write_queue_pages": args.write_queue_pages,
                 "prefetch_policy": args.prefetch_policy, "server": args.server,
                 "torch_threads": _torch_threads()}
    try:
        if not args.skip_off:
            hist_off = [[] for _ in convs]
            res["off"], rec_off = _run(base, convs, hist_off, main_turns, args, args.concurrency)
        hist_on = [[] for _ in convs]
        res["on"], rec_on = _run(tiered(store), convs, hist_on, main_turns, args, args.concurrency)
        key = lambda r: (r["conv"], r["turn"])  # noqa: E731
        if not args.skip_off:
            res["tokens_identical"] = ({key(r): r["output_ids"] for r in rec_off}
                                       == {key(r): r["output_ids"] for r in rec_on})
        last, conc = range(args.turns - 1, args.turns), args.restart_concurrency
        if not args.no_storage:
            res["restart_warm"], _ = _run(tiered(store), convs, [list(h) for h in hist_on], last,
                                          args, conc)
            res["restart_cold"], _ = _run(tiered(empty), convs, [list(h) for h in hist_on], last,
                                          args, conc)
    finally:
        shutil.rmtree(empty, ignore_errors=True)
        if args.storage_dir is None:
            shutil.rmtree(store, ignore_errors=True)
    if not args.skip_off:
        res["throughput_ratio_on_off"] = round(res["on"]["requests_per_s"]
                                               / res["off"]["requests_per_s"], 3)
        res["ttft_p50_ratio_off_on"] = round(res["off"]["ttft_p50_s"] / res["on"]["ttft_p50_s"],
                                             3)
    if not args.no_storage:
        res["restart_ttft_p50_ratio_cold_warm"] = round(res["restart_cold"]["ttft_p50_s"]
                                                        / res["restart_warm"]["ttft_p50_s"], 3)
    res["storage"] = None if args.no_storage else "file"
    res["load_avg_start"] = [round(x, 2) for x in load_start]
    res["load_avg_end"] = [round(x, 2) for x in os.getloadavg()]
    if args.note:
        res["note"] = args.note
    kind = "cpu" if res["device"].startswith("cpu") else "gpu"
    out = os.path.join(_HERE, "results", f"multiturn_long-{kind}.jsonl") if args.save else None
    return emit_result(res, out, __file__)


if __name__ == "__main__":
    main()
