"""The scoring workloads over HTTP, the way an evaluation harness sends them, against one server.

Each prompt is one OpenAI `/v1/completions` request: `prompt` = its token ids, `echo: true`,
`logprobs: 1`, `max_tokens: 0`, `temperature: 0` (lm-evaluation-harness's loglikelihood request
on a completions endpoint), `--concurrency` requests in flight (httpx, one client process). A
round's time is the first request sent to the last answer read. Each answer must carry one logprob
per prompt token (+ max_tokens); the continuation's values (the prompt's last `cont_len` entries)
are kept so compare.py can check both servers scored the same tokens to about the same values.

`run_side` starts the server (serve_and_run.py's command: radixlm's `serve` with its defaults, or
`vllm`'s api_server with prefix caching), runs every workload and round, records the server's
prompt / cached token counters around each round (radixlm: /get_server_info; vLLM: the prefix
cache counters of /metrics) and stops it. `scoring_lines` pairs the two sides into result lines.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import subprocess
import sys
import time

from benchmarks.peers import serve_and_run as sr
from benchmarks.peers.scoring_workloads import ScoringWorkload


async def _score(base_url: str, prompts: list, concurrency: int, max_tokens: int,
                 logprobs: int) -> tuple[list, float]:
    import httpx

    sem = asyncio.Semaphore(concurrency)
    url = base_url + "/v1/completions"
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=3600.0, limits=limits) as client:
        async def one(ids: list) -> list:
            body = {"model": sr.SERVED_NAME, "prompt": ids, "echo": True, "logprobs": logprobs,
                    "max_tokens": max_tokens, "temperature": 0.0}
            async with sem:
                r = await client.post(url, json=body)
            if r.status_code != 200:
                raise RuntimeError(f"{url}: HTTP {r.status_code}: {r.text[:500]}")
            return r.json()["choices"][0]["logprobs"]["token_logprobs"]

        t0 = time.perf_counter()
        out = await asyncio.gather(*(one(p) for p in prompts))
        return out, time.perf_counter() - t0


def score_round(base_url: str, w: ScoringWorkload, concurrency: int = 16, max_tokens: int = 0,
                logprobs: int = 1) -> dict:
    lps, elapsed = asyncio.run(_score(base_url, w.prompts, concurrency, max_tokens, logprobs))
    bad = [i for i, (p, lp) in enumerate(zip(w.prompts, lps)) if len(lp) != len(p) + max_tokens]
    if bad:
        i = bad[0]
        raise RuntimeError(f"{w.name} round {w.round}: {len(bad)} answers with a wrong number of "
                           f"logprobs (prompt {i}: {len(lps[i])} for {len(w.prompts[i])} tokens "
                           f"+ {max_tokens})")
    conts = [lp[len(p) - n:len(p)] for p, lp, n in zip(w.prompts, lps, w.cont_lens)]
    return {"workload": w.name, "round": w.round, "elapsed_s": round(elapsed, 4),
            **w.summary(), "concurrency": concurrency, "max_tokens": max_tokens,
            "logprobs": logprobs, "cont_logprobs": conts}


def _counters(side: str, base_url: str) -> dict:
    """The server's own cumulative prompt / cached token counts (what it says it reused)."""
    if side == "radixlm":
        status, body = sr._get(base_url + "/get_server_info", timeout=30)
        if status != 200:
            return {}
        st = (json.loads(body).get("internal_states") or [{}])[0]
        return {k: st.get(k) for k in ("prompt_tokens", "cached_tokens") if k in st}
    status, body = sr._get(base_url + "/metrics", timeout=30)
    out = {}
    for key, name in (("prefix_cache_queries", "vllm:prefix_cache_queries_total"),
                      ("prefix_cache_hits", "vllm:prefix_cache_hits_total"),
                      ("prompt_tokens", "vllm:prompt_tokens_total")):
        vals = re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+]+)$", body, re.M)
        if vals:
            out[key] = sum(float(v) for v in vals)
    return out


def run_side(side: str, workloads: list[ScoringWorkload], port: int, hf_model: str,
             concurrency: int = 16, max_tokens: int = 0, log_path: str | None = None,
             startup_timeout_s: float = 1800.0) -> dict:
    base_url = f"http://127.0.0.1:{port}"
    if sr._get(base_url + "/health", timeout=2.0)[0]:
        raise RuntimeError(f"something already answers on {base_url}; pick another port")
    env = sr.vllm_env() if side == "vllm" else dict(os.environ)
    cmd = sr.server_command(side, port, hf_model)
    log = open(log_path or os.devnull, "ab")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                            cwd=sr.radixlm_tree() if side == "radixlm" else sr._ROOT,
                            start_new_session=True)
    out = {"side": side, "command": cmd, "results": []}
    try:
        out["startup_s"] = round(sr.wait_healthy(base_url, proc, startup_timeout_s), 3)
        status, body = sr._get(base_url + ("/version" if side == "vllm" else "/get_server_info"))
        try:
            out["version"] = json.loads(body).get("version") if status == 200 else None
        except (ValueError, AttributeError):
            out["version"] = None
        for w in workloads:
            before = _counters(side, base_url)
            res = score_round(base_url, w, concurrency, max_tokens)
            after = _counters(side, base_url)
            res["server_counters"] = {k: after[k] - before.get(k, 0) for k in after
                                      if isinstance(after[k], (int, float))}
            res["load_avg"] = [round(x, 2) for x in os.getloadavg()]
            print(json.dumps({k: v for k, v in res.items() if k != "cont_logprobs"}),
                  file=sys.stderr, flush=True)
            out["results"].append(res)
    finally:
        sr.stop(proc)
        log.close()
    return out


def agreement(w: ScoringWorkload, a: list, b: list) -> dict:
    """How close two sides' continuation logprobs are, and whether they pick the same one."""
    diffs = [abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb)
             if x is not None and y is not None]
    n_vals = sum(len(r) for r in a)

    def choice(lps: list) -> dict:  # group -> index (within the group) of the highest sum
        out: dict = {}
        seen: dict = {}
        for g, lp in zip(w.groups, lps):
            k = seen.get(g, 0)
            seen[g] = k + 1
            s = sum(v for v in lp if v is not None)
            if g not in out or s > out[g][0]:
                out[g] = (s, k)
        return {g: k for g, (s, k) in out.items()}

    ca, cb = choice(a), choice(b)
    res = {"logprobs_compared": len(diffs), "logprobs_per_side": n_vals,
           "max_abs_diff": round(max(diffs), 5) if diffs else None,
           "mean_abs_diff": round(sum(diffs) / len(diffs), 5) if diffs else None,
           "same_choice": sum(ca[g] == cb.get(g) for g in ca), "num_choices": len(ca)}
    if w.answers:  # the true ending's share of picks: a sanity check of the text, not a score
        res["radixlm_correct"] = sum(ca[g] == w.answers[g] for g in ca)
        res["vllm_correct"] = sum(cb[g] == w.answers[g] for g in cb)
    assert all(math.isfinite(d) for d in diffs)
    return res


def scoring_lines(workloads: list[ScoringWorkload], rl: dict, v: dict) -> list[dict]:
    by_key = {(w.name, w.round): w for w in workloads}
    vk = {(r["workload"], r["round"]): r for r in v["results"]}
    lines = []
    for a in rl["results"]:
        key = (a["workload"], a["round"])
        b, w = vk.get(key), by_key[key]
        if b is None:
            continue
        lines.append({
            "workload": a["workload"], "round": a["round"], "kind": "scoring",
            "api": f"/v1/completions echo logprobs={a['logprobs']} max_tokens={a['max_tokens']}, "
                   f"token-id prompts, {a['concurrency']} in flight, both servers",
            "radixlm_s": a["elapsed_s"], "vllm_s": b["elapsed_s"],
            "ratio": round(b["elapsed_s"] / a["elapsed_s"], 3) if a["elapsed_s"] else None,
            **w.summary(), "params": w.params,
            **agreement(w, a["cont_logprobs"], b["cont_logprobs"]),
            "radixlm_counters": a.get("server_counters"), "vllm_counters": b.get("server_counters"),
            "radixlm_load_avg": a.get("load_avg"), "vllm_load_avg": b.get("load_avg"),
            "radixlm_startup_s": rl.get("startup_s"), "vllm_startup_s": v.get("startup_s"),
            "radixlm": rl.get("version"), "vllm": v.get("version"),
        })
    return lines
