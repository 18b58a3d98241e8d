"""Frontend programs over HTTP against one running server: few-shot, multi-turn chat, tree-of-thought.

    .venv/bin/python benchmarks/peers/run_programs.py --base-url http://127.0.0.1:30000 \
        --backend openai --model SmolLM2-135M-Instruct --size small --out R.json

Programs are written with radixlm's frontend (`import radixlm as sgl`) and run with `run_batch`
(all programs of a workload at once, the frontend's default thread pool). Backends:
- `--backend radixlm`: `sgl.RuntimeEndpoint(url)` (radixlm's native /generate API);
- `--backend openai`: `sgl.OpenAI(model, base_url=url/v1, is_chat_model=False)`, a completion
  model through `/v1/completions` (works against radixlm's and vLLM's servers alike).
Every gen is greedy with `ignore_eos` and a fixed `max_tokens`, so each server generates exactly
the same number of tokens whatever its numerics (bf16 kernels differ, so greedy texts can differ
after a few tokens; the text fed back into later turns can differ too, lengths cannot).

The OpenAI backend is used as `HarnessOpenAI` below, which differs from `sgl.OpenAI` in one place,
on both servers alike: the prefix `run_batch` sends first to warm the cache is sent with
`max_tokens=1` instead of 0 (vLLM rejects `max_tokens=0` without `echo`). SGLang's extras
(`ignore_eos`) are sent to both (`server_extras=True`: vLLM's /v1/completions accepts
`ignore_eos`, but it does not answer radixlm's `/get_model_info` probe).

Prints one JSON line per (workload, round) and writes them all to --out.
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

import radixlm as sgl  # noqa: E402
from benchmarks.peers import workloads as wl  # noqa: E402

CHAT_TEMPLATE = "smollm2"  # the bundled model's (ChatML + its default system prompt)


# ------------------------------------------------------------------------------------- programs

@sgl.function
def few_shot(s, shots, question, max_tokens):
    s += shots + question
    s += sgl.gen("answer", max_tokens=max_tokens)


@sgl.function
def multi_turn_chat(s, turns, max_tokens):
    for i, turn in enumerate(turns):
        s += sgl.user(turn)
        s += sgl.assistant(sgl.gen(f"answer_{i}", max_tokens=max_tokens))


@sgl.function
def tree_of_thought(s, question, branches, sub_branches, max_tokens):
    s += "Question: " + question + "\nLet us think about this in several different ways.\n"
    plans = s.fork(branches)
    plans += lambda i: f"Approach {i + 1}: " + sgl.gen("plan", max_tokens=max_tokens) + "\n"
    leaves = []
    for plan in plans:  # each plan forks again: its steps share the plan's text
        steps = plan.fork(sub_branches)
        steps += lambda j: f"Step {j + 1}: " + sgl.gen("step", max_tokens=max_tokens) + "\n"
        leaves.extend(steps)
    # join: the main branch reads every leaf and concludes
    s += "Candidate conclusions:\n" + "".join(f"- {leaf['step'].strip()}\n" for leaf in leaves)
    s += "Final answer:" + sgl.gen("answer", max_tokens=max_tokens)


def gens_per_program(workload: str, sz: wl.Sizes) -> int:
    if workload == "few-shot":
        return 1
    if workload == "multi-turn-chat":
        return sz.chat_turns
    if workload == "tree-of-thought":
        return sz.tot_branches * (1 + sz.tot_sub_branches) + 1
    raise ValueError(workload)


def batch_for(workload: str, round_: int, sz: wl.Sizes, base_seed: int) -> tuple:
    """(program, list of kwargs, max_tokens per gen) for one round of a workload."""
    if workload == "few-shot":
        shots, qs = wl.fewshot_args(round_, sz, base_seed)
        # shots bound: tracing sees them as constant, so run_batch warms the cache with them once
        return few_shot.bind(shots=shots, max_tokens=sz.fewshot_max_tokens), qs, sz.fewshot_max_tokens
    if workload == "multi-turn-chat":
        args = [{**a, "max_tokens": sz.chat_max_tokens} for a in wl.chat_args(round_, sz, base_seed)]
        return multi_turn_chat, args, sz.chat_max_tokens
    if workload == "tree-of-thought":
        prog = tree_of_thought.bind(branches=sz.tot_branches, sub_branches=sz.tot_sub_branches,
                                    max_tokens=sz.tot_max_tokens)
        return prog, wl.tot_args(round_, sz, base_seed), sz.tot_max_tokens
    raise ValueError(f"unknown program workload {workload!r} (known: {', '.join(wl.PROGRAMS)})")


# ------------------------------------------------------------------------------------- backends

def make_backend(kind: str, base_url: str, model: str):
    base_url = base_url.rstrip("/")
    if kind == "radixlm":
        return sgl.RuntimeEndpoint(base_url, chat_template=CHAT_TEMPLATE)
    if kind == "openai":
        from radixlm.lang.backend.openai import OpenAI

        class HarnessOpenAI(OpenAI):
            def cache_prefix(self, prefix: str) -> None:
                # sgl.OpenAI sends max_tokens=0, which vLLM refuses without echo
                if prefix and not self.is_chat_model:
                    self.client.completions.create(model=self.model_name, prompt=prefix,
                                                   max_tokens=1, temperature=0.0)

        return HarnessOpenAI(model, base_url=base_url + "/v1", is_chat_model=False,
                             chat_template=CHAT_TEMPLATE, server_extras=True, timeout=3600, max_retries=0)
    raise ValueError(f"unknown backend {kind!r} (radixlm, openai)")


def run_workload(backend, workload: str, round_: int, sz: wl.Sizes, base_seed: int = 0) -> dict:
    prog, batch, max_tokens = batch_for(workload, round_, sz, base_seed)
    t0 = time.perf_counter()
    states = prog.run_batch(batch, backend=backend, temperature=0.0, ignore_eos=True)
    elapsed = time.perf_counter() - t0
    errors = [repr(e) for e in (st.error() for st in states) if e is not None]
    if errors:
        raise RuntimeError(f"{workload} round {round_}: {len(errors)} programs failed, first: {errors[0]}")
    n_gens = gens_per_program(workload, sz) * len(batch)
    return {"workload": workload, "round": round_, "elapsed_s": round(elapsed, 4),
            "num_programs": len(batch), "num_gens": n_gens,
            "generated_tokens": n_gens * max_tokens,  # exact: ignore_eos, fixed max_tokens
            "program_throughput": round(len(batch) / elapsed, 3),
            "sample_text_tail": states[0].text()[-160:]}


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--base-url", required=True, help="server root, e.g. http://127.0.0.1:30000")
    p.add_argument("--backend", choices=["radixlm", "openai"], default="openai")
    p.add_argument("--model", default="SmolLM2-135M-Instruct", help="served model name (openai)")
    p.add_argument("--workloads", default=",".join(wl.PROGRAMS))
    p.add_argument("--rounds", default="1,2")
    p.add_argument("--size", default="full", choices=["full", "small"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    sz = wl.sizes(args.size)
    backend = make_backend(args.backend, args.base_url, args.model)
    results = []
    try:
        for name in args.workloads.split(","):
            for r in args.rounds.split(","):
                res = {**run_workload(backend, name, int(r), sz, args.seed), "backend": args.backend}
                print(json.dumps(res), flush=True)
                results.append(res)
    finally:
        backend.shutdown()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f)
    return results


if __name__ == "__main__":
    main()
