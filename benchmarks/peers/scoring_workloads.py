"""The peer benchmark's scoring workloads: prompts whose own tokens' logprobs are asked for, as
lm-evaluation-harness's loglikelihood requests ask them (context + continuation, echo, logprobs,
no new tokens), built as token ids from real text (ShareGPT replies).

- `hellaswag-style`: N questions; each prompt = one few-shot context shared by every question
  (`hs_shared_len` tokens: whole ShareGPT replies as shots, "\\n\\n" between them) + the
  question's own context (the head of another reply) + one of 4 endings (one the reply's true
  next tokens, three slices of other replies, in a drawn order). Scored: the ending's tokens.
- `scoring`: C contexts of `sc_context_len` tokens (replies joined by "\\n\\n"), each followed by
  `sc_continuations` continuations (slices of other replies). Scored: the continuation's tokens.

Deterministic in (base seed, round, workload) like workloads.py: round r draws new shots, new
questions, new contexts, so nothing but what is meant to be shared is shared across rounds.
Lengths are exact token counts ([lo, hi] ranges drawn per item); prompt ids never hold special
tokens (a reply whose ids contain one is skipped). `TextPool` tokenizes the replies once; the
builders only slice ids, so building every round of both workloads costs milliseconds.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field
from typing import Iterator, Optional

from benchmarks import datasets as ds
from benchmarks.peers import workloads as wl


@dataclass
class ScoringWorkload:
    name: str
    round: int
    seed: int
    prompts: list = field(default_factory=list)  # list[list[int]]: context + continuation ids
    cont_lens: list = field(default_factory=list)  # list[int]: scored tokens, at each prompt's end
    groups: list = field(default_factory=list)  # list[int]: the question / context of each prompt
    answers: list = field(default_factory=list)  # per group: the true ending's index (hellaswag)
    params: dict = field(default_factory=dict)  # the sizes that shaped it, for the result line

    def summary(self) -> dict:
        return {"num_requests": len(self.prompts), "num_groups": len(set(self.groups)),
                "prompt_tokens": sum(len(p) for p in self.prompts),
                "scored_tokens": sum(self.cont_lens)}

    def to_json(self) -> dict:
        return asdict(self)


class TextPool:
    """Tokenized ShareGPT replies (the first `num_passages` of at least `min_tokens` tokens, in
    file order) and the ids of the separator between shots / joined replies."""

    def __init__(self, tokenizer, num_passages: int = 800, min_tokens: int = 64,
                 path: Optional[str] = None, sep: str = "\n\n"):
        special = ds._special_ids(tokenizer)
        texts: list[str] = []
        for conv in ds.iter_sharegpt(path):
            for turn in conv.get("conversations") or []:
                v = turn.get("value")
                if turn.get("from") == "gpt" and isinstance(v, str) and len(v) >= 4 * min_tokens:
                    texts.append(v.strip())
            if len(texts) >= 2 * num_passages:  # twice: some fall to the filters below
                break
        self.passages = [ids for ids in ds._encode(tokenizer, texts)
                         if len(ids) >= min_tokens and not special.intersection(ids)][:num_passages]
        self.sep = list(ds._encode(tokenizer, [sep])[0])
        if len(self.passages) < 64:
            raise ValueError(f"only {len(self.passages)} usable ShareGPT replies")


class _Draw:
    """The pool's passages in a seeded order, each handed out once."""

    def __init__(self, pool: TextPool, rng: random.Random):
        self.pool, self.rng = pool, rng
        order = list(range(len(pool.passages)))
        rng.shuffle(order)
        self._it: Iterator[int] = iter(order)

    def passage(self, min_len: int = 1) -> list[int]:
        for i in self._it:
            if len(self.pool.passages[i]) >= min_len:
                return self.pool.passages[i]
        raise ValueError(f"the text pool ran out of replies of >= {min_len} tokens: "
                         "a larger TextPool(num_passages=...) or smaller sizes")

    def joined(self, n: int, max_per_passage: int) -> list[int]:
        """Exactly n tokens: passages (each cut to max_per_passage) joined by the separator."""
        out: list[int] = []
        while len(out) < n:
            out += self.passage()[:max_per_passage] + self.pool.sep
        return out[:n]

    def slice(self, n: int) -> list[int]:
        """n consecutive tokens from a fresh passage, at a drawn offset."""
        p = self.passage(n)
        start = self.rng.randrange(len(p) - n + 1)
        return p[start:start + n]


def hellaswag_workload(round_: int, pool: TextPool, sz: Optional[wl.Sizes] = None,
                       base_seed: int = 0) -> ScoringWorkload:
    sz = sz or wl.sizes()
    seed = wl.round_seed(base_seed, round_, "hellaswag-style")
    rng = random.Random(seed)
    draw = _Draw(pool, rng)
    # shots of at most 200 tokens: ~8 shots in 1.4k, the shape of a 10-20-shot HellaSwag prompt
    shared = draw.joined(sz.hs_shared_len - len(pool.sep), 200) + pool.sep
    out = ScoringWorkload("hellaswag-style", round_, seed, params={
        "shared_len": sz.hs_shared_len, "ctx_len": list(sz.hs_ctx_len),
        "ending_len": list(sz.hs_ending_len), "endings": sz.hs_endings})
    for q in range(sz.hs_num):
        c, e = rng.randint(*sz.hs_ctx_len), rng.randint(*sz.hs_ending_len)
        head = draw.passage(c + e)
        endings = [draw.slice(rng.randint(*sz.hs_ending_len)) for _ in range(sz.hs_endings - 1)]
        answer = rng.randrange(sz.hs_endings)
        endings.insert(answer, head[c:c + e])
        for ending in endings:
            out.prompts.append(shared + head[:c] + ending)
            out.cont_lens.append(len(ending))
            out.groups.append(q)
        out.answers.append(answer)
    return out


def scoring_workload(round_: int, pool: TextPool, sz: Optional[wl.Sizes] = None,
                     base_seed: int = 0) -> ScoringWorkload:
    sz = sz or wl.sizes()
    seed = wl.round_seed(base_seed, round_, "scoring")
    rng = random.Random(seed)
    draw = _Draw(pool, rng)
    out = ScoringWorkload("scoring", round_, seed, params={
        "context_len": sz.sc_context_len, "continuations": sz.sc_continuations,
        "continuation_len": list(sz.sc_continuation_len)})
    for g in range(sz.sc_num_contexts):
        ctx = draw.joined(sz.sc_context_len, 10 ** 9)
        for _ in range(sz.sc_continuations):
            cont = draw.slice(rng.randint(*sz.sc_continuation_len))
            out.prompts.append(ctx + cont)
            out.cont_lens.append(len(cont))
            out.groups.append(g)
    return out


def scoring_workloads(names: list[str], rounds: list[int], pool: TextPool,
                      sz: Optional[wl.Sizes] = None, base_seed: int = 0) -> list[ScoringWorkload]:
    build = {"hellaswag-style": hellaswag_workload, "scoring": scoring_workload}
    unknown = [n for n in names if n not in build]
    if unknown:
        raise ValueError(f"unknown scoring workload(s) {unknown} (known: {', '.join(build)})")
    return [build[n](r, pool, sz, base_seed) for n in names for r in rounds]
