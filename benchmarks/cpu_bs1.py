"""One user on the CPU: radixlm's Engine against llama.cpp (llama-cpp-python) on the same GGUF.

    python3 -m venv /work/llamacpp-venv && /work/llamacpp-venv/bin/pip install llama-cpp-python==0.3.36
    .venv/bin/python benchmarks/cpu_bs1.py --llama-python /work/llamacpp-venv/bin/python --save

Both sides take the same ChatML prompt (the default system prompt of SmolLM2's template, one user
turn) and generate 256 new tokens greedily, EOS ignored (radixlm: ignore_eos; llama.cpp: its
`generate` loop, which never stops by itself), `--runs` times; the figure is the best run's
tokens / second of the whole call (prefill of the ~40-token prompt included; each run starts with
an empty cache on both sides: radixlm flushes its radix cache, llama.cpp resets its context).
Each side runs in its own fresh process, one after the other, never both at once, with its
default thread count (what a new user gets: llama-cpp-python takes half the cores, radixlm all),
unless --llama-threads / --radixlm-threads say otherwise. Load time: the constructor (`Engine()`, `Llama(...)`),
after the imports, on a warm cache (radixlm's start-up cache exists after the first run; the
script starts one radixlm process first to make sure). `--hf-folder` adds radixlm alone on an HF
safetensors folder in bf16 (benchmarks/peers/convert_model.py writes one from the GGUF).

The greedy texts of the two are compared: Q4_1 kernels differ (llama.cpp quantizes activations to
8 bits, radixlm multiplies the exact bf16 activations), so they may part after some tokens; the
line records how many leading characters agree. Prints one JSON line; --save appends it to
benchmarks/results/cpu_bs1-cpu.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
sys.path.insert(0, _ROOT)

from benchmarks.peers.compare import cpu_info, git_commit, load_avg  # noqa: E402

RESULT_FILE = os.path.join(_HERE, "results", "cpu_bs1-cpu.jsonl")
USER_TURN = "Write a short story about a robot who learns to paint."
# SmolLM2's chat template with its default system prompt (what Engine's chat path renders)
PROMPT = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
          "Face<|im_end|>\n<|im_start|>user\n" + USER_TURN + "<|im_end|>\n<|im_start|>assistant\n")

# The child processes: each prints one JSON line last.
_RADIXLM_CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
import radixlm
t1 = time.perf_counter()
kw = json.loads(sys.argv[1])
import torch
if kw.get("threads"):
    torch.set_num_threads(kw["threads"])
engine = radixlm.Engine(**kw["engine"])
t2 = time.perf_counter()
sp = {"temperature": 0, "max_new_tokens": kw["n"], "ignore_eos": True}
engine.generate(kw["prompt"], dict(sp, max_new_tokens=8))  # first-call costs out of the runs
runs = []
for _ in range(kw["runs"]):
    engine.flush_cache()
    t = time.perf_counter()
    out = engine.generate(kw["prompt"], sp)
    runs.append(len(out["output_ids"]) / (time.perf_counter() - t))
print(json.dumps({"tok_s": max(runs), "runs": runs, "import_s": t1 - t0, "load_s": t2 - t1,
                  "threads": torch.get_num_threads(), "n": len(out["output_ids"]),
                  "text": out["text"], "ids": out["output_ids"][:32]}))
engine.shutdown()
"""

_LLAMA_CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
from llama_cpp import Llama, __version__
t1 = time.perf_counter()
kw = json.loads(sys.argv[1])
extra = {"n_threads": kw["threads"]} if kw["threads"] else {}
llm = Llama(model_path=kw["model"], n_ctx=2048, verbose=False, **extra)
t2 = time.perf_counter()
prompt = llm.tokenize(kw["prompt"].encode(), add_bos=False, special=True)

def run(n):
    llm.reset()  # an empty context: the prompt is evaluated again, as radixlm's flushed cache
    ids = []
    for tok in llm.generate(prompt, temp=0.0, top_k=1, reset=True):
        ids.append(tok)
        if len(ids) == n:
            return ids

run(8)
runs = []
for _ in range(kw["runs"]):
    t = time.perf_counter()
    ids = run(kw["n"])
    runs.append(len(ids) / (time.perf_counter() - t))
text = llm.detokenize(ids, special=True).decode("utf-8", "replace")
print(json.dumps({"tok_s": max(runs), "runs": runs, "import_s": t1 - t0, "load_s": t2 - t1,
                  "threads": llm.n_threads if hasattr(llm, "n_threads") else llm.context_params.n_threads,
                  "n": len(ids), "text": text, "ids": ids[:32], "version": __version__}))
"""


def _child(python: str, code: str, kw: dict, timeout: float, env=None) -> dict:
    p = subprocess.run([python, "-c", code, json.dumps(kw)], cwd=_ROOT, capture_output=True,
                       text=True, timeout=timeout, env=env)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if p.returncode != 0 or not lines:
        raise RuntimeError(f"{python} child failed (rc {p.returncode}):\n{p.stderr[-3000:]}")
    return json.loads(lines[-1])


def common_prefix(a: str, b: str) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--llama-python", default=None,
                   help="python of a venv with llama-cpp-python (omit: radixlm only)")
    p.add_argument("--llama-threads", type=int, default=0, help="0: llama-cpp-python's default")
    p.add_argument("--radixlm-threads", type=int, default=0, help="0: radixlm's default (all cores)")
    p.add_argument("--model", default=None, help="GGUF file (default: the bundled SmolLM2)")
    p.add_argument("--hf-folder", default=None,
                   help="also radixlm on this HF folder in bf16 ('convert': write it from the GGUF)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--timeout", type=float, default=900.0, help="per child process, seconds")
    p.add_argument("--label", default="", help="a note kept in the line (e.g. which build)")
    p.add_argument("--save", action="store_true", help=f"append the line to {RESULT_FILE}")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    from radixlm.runtime.models import loader

    model = args.model or loader.default_model_path()
    line: dict = {"benchmark": "cpu_bs1", "label": args.label, "model": os.path.basename(model),
                  "prompt": "ChatML, default system prompt, user: " + USER_TURN,
                  "max_new_tokens": args.max_new_tokens, "runs": args.runs,
                  "load_avg_start": load_avg()}
    rl_kw = {"engine": {"model_path": model}, "prompt": PROMPT, "n": args.max_new_tokens,
             "runs": args.runs, "threads": args.radixlm_threads}
    # the start-up cache: made by a first process if missing, so the measured one is warm
    _child(sys.executable, _RADIXLM_CHILD, dict(rl_kw, runs=1, n=8), args.timeout)
    rl = _child(sys.executable, _RADIXLM_CHILD, rl_kw, args.timeout)
    line["radixlm"] = {k: rl[k] for k in ("tok_s", "runs", "import_s", "load_s", "threads", "n")}
    if args.llama_python:
        lc = _child(args.llama_python, _LLAMA_CHILD,
                    {"model": model, "prompt": PROMPT, "n": args.max_new_tokens,
                     "runs": args.runs, "threads": args.llama_threads}, args.timeout)
        line["llama_cpp"] = {k: lc[k] for k in ("tok_s", "runs", "import_s", "load_s",
                                                 "threads", "n", "version")}
        line["ratio_radixlm_vs_llama_cpp"] = round(rl["tok_s"] / lc["tok_s"], 3)
        agree = common_prefix(rl["text"], lc["text"])
        line["greedy_text"] = {"common_prefix_chars": agree, "radixlm": rl["text"][:160],
                               "llama_cpp": lc["text"][:160],
                               "same_first_ids": common_prefix(rl["ids"], lc["ids"])}
    if args.hf_folder:
        folder = args.hf_folder
        if folder == "convert":
            from benchmarks.peers.convert_model import convert

            folder = convert(model)
        hf = _child(sys.executable, _RADIXLM_CHILD,
                    dict(rl_kw, engine={"model_path": folder, "dtype": "bfloat16"}), args.timeout)
        line["radixlm_hf_bf16"] = {k: hf[k] for k in ("tok_s", "runs", "import_s", "load_s",
                                                      "threads", "n")}
    line.update(cpu_info(), load_avg_end=load_avg(), date=_now(), git_commit=git_commit(),
                command=" ".join(shlex.quote(a) for a in ["python", "benchmarks/cpu_bs1.py",
                                                          *(argv or sys.argv[1:])]))
    print(json.dumps(line))
    if args.save:
        with open(RESULT_FILE, "a") as f:
            f.write(json.dumps(line) + "\n")
    return line


def _now() -> str:
    import datetime

    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


if __name__ == "__main__":
    main()
