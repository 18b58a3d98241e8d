"""Online serving benchmark: an async streaming HTTP client against a running radixlm server.

    python benchmarks/serving.py --base-url http://127.0.0.1:30000 --dataset-name random \
        --num-prompts 200 --random-input-len 512 --random-output-len 128 --request-rate 8

Requests arrive as a Poisson process (`--request-rate` per second, exponential gaps; `inf` sends
all at once), at most `--max-concurrency` in flight. Each one streams and is timed on the client:
- TTFT: from sending the request to the first event that carries new output tokens.
- ITL: the gap between consecutive token-carrying events; an event with k new tokens counts its
  gap / k, k times (SGLang's convention). The openai backend sees no ids, so each non-empty
  text chunk counts as one token there.
- TPOT per request: (e2e - ttft) / (output_tokens - 1), for requests with more than one token.
- output tokens and cached tokens: the server's own counts (meta_info / usage) of the last event.
Prints one JSON line (and appends it to --result-file). Flag names follow SGLang's bench_serving.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
import os
import random
import shlex
import sys
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Optional

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
# as in offline_throughput.py: benchmarks/datasets.py must not shadow HF's `datasets`
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import httpx  # noqa: E402

from benchmarks import datasets as ds  # noqa: E402
from benchmarks.offline_throughput import git_commit, sample_requests  # noqa: E402


@dataclass
class RequestResult:
    ok: bool = False
    prompt_len: int = 0  # tokens we sent
    server_prompt_len: Optional[int] = None  # tokens the server counted
    output_len: int = 0
    cached_tokens: int = 0
    ttft: float = 0.0  # seconds
    latency: float = 0.0  # seconds, end to end
    itl: list[float] = field(default_factory=list)  # seconds
    error: str = ""


# ------------------------------------------------------------------------------------ metric math

def percentile(values: list[float], q: float) -> float:
    """q-th percentile with linear interpolation between order statistics (numpy's default)."""
    if not values:
        return float("nan")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def tpot(r: RequestResult) -> Optional[float]:
    return (r.latency - r.ttft) / (r.output_len - 1) if r.output_len > 1 else None


class TokenTimer:
    """Turns (arrival time, new tokens) of stream events into TTFT and ITL."""

    def __init__(self, start: float):
        self.start, self.last, self.ttft, self.itl = start, None, None, []

    def add(self, t: float, n_new: int) -> None:
        if n_new <= 0:
            return
        if self.last is None:
            self.ttft = t - self.start
        else:
            self.itl.extend([(t - self.last) / n_new] * n_new)
        self.last = t


def _ms_stats(name: str, values: list[float]) -> dict:
    ms = [v * 1000 for v in values]
    mean = sum(ms) / len(ms) if ms else float("nan")
    return {f"mean_{name}_ms": mean, f"median_{name}_ms": percentile(ms, 50),
            f"p99_{name}_ms": percentile(ms, 99)}


def summarize(results: list[RequestResult], duration: float) -> dict:
    done = [r for r in results if r.ok]
    n_in = sum(r.prompt_len for r in done)
    n_out = sum(r.output_len for r in done)
    server_prompt = sum(r.prompt_len if r.server_prompt_len is None else r.server_prompt_len for r in done)
    out = {
        "completed": len(done), "failed": len(results) - len(done), "duration_s": duration,
        "total_input_tokens": n_in, "total_output_tokens": n_out,
        "request_throughput": len(done) / duration, "input_throughput": n_in / duration,
        "output_throughput": n_out / duration, "total_token_throughput": (n_in + n_out) / duration,
    }
    out.update(_ms_stats("ttft", [r.ttft for r in done]))
    out.update(_ms_stats("itl", [x for r in done for x in r.itl]))
    out.update(_ms_stats("tpot", [t for t in map(tpot, done) if t is not None]))
    out.update(_ms_stats("e2e_latency", [r.latency for r in done]))
    out["cache_hit_rate"] = sum(r.cached_tokens for r in done) / server_prompt if server_prompt else 0.0
    out["concurrency"] = sum(r.latency for r in done) / duration
    errors = sorted({r.error for r in results if not r.ok})
    if errors:
        out["errors"] = errors[:5]  # distinct messages, a few
    return {k: (round(v, 4) if isinstance(v, float) and math.isfinite(v) else
                (None if isinstance(v, float) else v)) for k, v in out.items()}


# ------------------------------------------------------------------------------------ HTTP client

async def iter_sse(resp: httpx.Response) -> AsyncIterator[dict]:
    """The JSON objects of an SSE body's `data:` lines, up to `data: [DONE]`."""
    async for line in resp.aiter_lines():
        line = line.strip()
        if not line.startswith("data:"):
            continue  # blank separators, `event:` lines, comments
        payload = line[5:].strip()
        if payload == "[DONE]":
            return
        yield json.loads(payload)


def build_request(args, req: ds.BenchRequest) -> tuple[str, dict]:
    """(path, JSON body). Prompts go as token ids unless --send-text (see datasets.py)."""
    prompt: Any = req.prompt if args.send_text else req.prompt_ids
    extra = {} if args.disable_ignore_eos else {"ignore_eos": True}
    if args.backend == "radixlm":
        body = {"text" if args.send_text else "input_ids": prompt, "stream": True,
                "sampling_params": {"max_new_tokens": req.output_len, "temperature": 0.0, **extra}}
        return "/generate", body
    body = {"prompt": prompt, "max_tokens": req.output_len, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}, **extra}
    if args.model:
        body["model"] = args.model
    return "/v1/completions", body


def _error_text(ev: dict) -> str:
    err = ev.get("error")
    return (err.get("message") if isinstance(err, dict) else None) or json.dumps(err)


async def send_request(client: httpx.AsyncClient, args, req: ds.BenchRequest) -> RequestResult:
    path, body = build_request(args, req)
    res = RequestResult(prompt_len=len(req.prompt_ids))
    start = time.perf_counter()
    timer = TokenTimer(start)
    n_seen = 0  # radixlm: output ids so far; openai: non-empty chunks so far
    try:
        async with client.stream("POST", path, json=body) as resp:
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode(errors='replace')[:300]}"
                return res
            async for ev in iter_sse(resp):
                now = time.perf_counter()
                if "error" in ev:
                    res.error = _error_text(ev)
                    return res
                if args.backend == "radixlm":
                    ids = ev.get("output_ids") or []
                    timer.add(now, len(ids) - n_seen)
                    n_seen = max(n_seen, len(ids))
                    meta = ev.get("meta_info") or {}
                    res.output_len = meta.get("completion_tokens", len(ids))
                    res.cached_tokens = meta.get("cached_tokens", 0)
                    res.server_prompt_len = meta.get("prompt_tokens")
                    finish = meta.get("finish_reason")
                    if isinstance(finish, dict) and finish.get("type") == "abort":
                        res.error = f"aborted: {finish.get('message')}"
                        return res
                else:
                    choices = ev.get("choices") or []
                    if choices and choices[0].get("text"):
                        timer.add(now, 1)
                        n_seen += 1
                    usage = ev.get("usage") or {}
                    if usage:
                        res.output_len = usage.get("completion_tokens", n_seen)
                        res.server_prompt_len = usage.get("prompt_tokens")
                        res.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        res.latency = time.perf_counter() - start
        if args.backend == "openai" and res.output_len == 0:
            res.output_len = n_seen  # the server sent no usage
        if timer.ttft is None:
            res.error = "the stream carried no output tokens"
            return res
        res.ttft, res.itl, res.ok = timer.ttft, timer.itl, True
    except Exception as e:  # connection refused, reset, bad JSON, ...: count it, keep going
        res.error = f"{type(e).__name__}: {e}"
    return res


async def _get_json(client: httpx.AsyncClient, path: str) -> Optional[dict]:
    try:
        r = await client.get(path)
        return r.json() if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


async def run_benchmark(args, reqs: list[ds.BenchRequest], warmup: list[ds.BenchRequest] = ()) -> dict:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    # no read timeout (long generations), no pool limit (--max-concurrency is the limit)
    async with httpx.AsyncClient(base_url=args.base_url.rstrip("/"), headers=headers,
                                 timeout=httpx.Timeout(None, connect=30.0),
                                 limits=httpx.Limits(max_connections=None,
                                                     max_keepalive_connections=None)) as client:
        info = await _get_json(client, "/get_server_info") or {}
        if args.backend == "openai" and not args.model:
            models = await _get_json(client, "/v1/models") or {}
            args.model = ((models.get("data") or [{}])[0]).get("id")
        if warmup:
            outs = await asyncio.gather(*(send_request(client, args, w) for w in warmup))
            bad = [o.error for o in outs if not o.ok]
            if len(bad) == len(outs):
                raise SystemExit(f"every warm-up request failed, e.g.: {bad[0]}")
        if args.flush_cache:
            r = await client.post("/flush_cache")
            if r.status_code != 200:
                print(f"warning: /flush_cache answered {r.status_code}: {r.text[:200]}", file=sys.stderr)

        sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None

        async def one(req):
            if sem is None:
                return await send_request(client, args, req)
            async with sem:
                return await send_request(client, args, req)

        rng = random.Random(args.seed)
        tasks = []
        start = time.perf_counter()
        for i, req in enumerate(reqs):
            tasks.append(asyncio.create_task(one(req)))
            if math.isfinite(args.request_rate) and i + 1 < len(reqs):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    out = summarize(results, duration)
    out["server_info"] = {k: info.get(k) for k in ("device", "dtype", "model_path")} if info else None
    return out


# ------------------------------------------------------------------------------------------- CLI

def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:30000")
    p.add_argument("--backend", default="radixlm", choices=["radixlm", "openai"],
                   help="radixlm: POST /generate (SGLang native); openai: POST /v1/completions")
    p.add_argument("--model", default=None, help="openai backend: model name (default: first of /v1/models)")
    p.add_argument("--tokenizer-path", default=None, help="default: the bundled SmolLM2 GGUF")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    ds.add_dataset_args(p)
    p.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (Poisson); inf: all at once")
    p.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    p.add_argument("--disable-ignore-eos", action="store_true",
                   help="let requests stop at EOS (default: ignore_eos, so outputs have the sampled lengths)")
    p.add_argument("--send-text", action="store_true", help="send prompt text instead of token ids")
    p.add_argument("--warmup-requests", type=int, default=1, metavar="N", help="short throwaway requests first")
    p.add_argument("--flush-cache", action="store_true", help="POST /flush_cache before the measured run")
    p.add_argument("--result-file", default=None, help="append the JSON line to this file")
    args = p.parse_args(argv)
    if args.request_rate <= 0:
        p.error("--request-rate must be > 0 (inf: all at once)")
    if args.max_concurrency is not None and args.max_concurrency <= 0:
        p.error("--max-concurrency must be > 0")
    return args


def main(argv=None, tokenizer=None) -> dict:
    args = parse_args(argv)
    if tokenizer is None:
        from radixlm.runtime.models.loader import default_model_path, load_tokenizer

        tokenizer = load_tokenizer(args.tokenizer_path or default_model_path())
    reqs = sample_requests(args, tokenizer)
    # random ids share no prefix with the measured prompts, so warm-up cannot pre-fill the cache
    warm = ds.sample_random(tokenizer, args.warmup_requests, 32, 8, 1.0, args.seed + 10_000)
    res = asyncio.run(run_benchmark(args, reqs, warm))
    info = res.pop("server_info")
    result = {"backend": args.backend, "dataset": args.dataset_name,
              "request_rate": args.request_rate if math.isfinite(args.request_rate) else "inf",
              "max_concurrency": args.max_concurrency, "num_prompts": len(reqs), **res,
              "base_url": args.base_url,
              "device": info and info.get("device"), "dtype": info and info.get("dtype"),
              "model_path": info and info.get("model_path"),
              "ignore_eos": not args.disable_ignore_eos, "seed": args.seed,
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "git_commit": git_commit(),
              "command": "python " + " ".join(map(shlex.quote, sys.argv if argv is None else [__file__, *argv]))}
    line = json.dumps(result)
    print(line)
    if args.result_file:
        os.makedirs(os.path.dirname(os.path.abspath(args.result_file)), exist_ok=True)
        with open(args.result_file, "a") as f:
            f.write(line + "\n")
    if result["completed"] == 0:
        raise SystemExit("every request failed")
    return result


if __name__ == "__main__":
    main()
