"""NGRAM drafts: the tokens that followed the current suffix elsewhere.

Two tables, both keyed by an n-gram (a tuple of n token ids, min_match <= n <= max_match):
- `OwnIndex`, one per request, over its own prompt + output: n-gram -> the position right after
  its latest occurrence. Kept incrementally: each appended token adds the n-grams it continues
  (max_match - min_match + 1 dict writes), nothing is rebuilt. A draft is the text after that
  position. An n-gram is only entered once a token follows it, so the current suffix never
  matches itself.
- `SharedIndex`, one per scheduler, over the text of finished requests (what entered the radix
  tree): n-gram -> the (up to max_draft) tokens that followed it in an output. Bounded: at most
  `capacity` n-grams, least recently written first out. It drafts for requests that repeat or
  continue another request's answer (n > 1, retries, templated outputs).
A lookup tries the longest suffix first, the request's own text before the shared table at each
length: at most 2 * (max_match - min_match + 1) dict reads per request per step.
Memory: the own index holds ~(max_match - min_match + 1) entries per token of the request (~0.6
KB a token at the defaults, against 23 KB of bf16 KV per token for SmolLM2), built once from the
prompt at the request's first draft and dropped when it finishes; the shared table `capacity`.
Drafts are guesses: a stale or wrong entry costs acceptance, never correctness.
"""

from __future__ import annotations

from collections import OrderedDict


class OwnIndex:
    __slots__ = ("tokens", "table", "min_n", "max_n", "n_prompt", "n_out", "jumps")

    def __init__(self, prompt: list[int], min_n: int, max_n: int):
        self.tokens: list[int] = []
        self.table: dict[tuple, int] = {}
        self.min_n, self.max_n = min_n, max_n
        self.n_prompt = len(prompt)
        self.n_out = 0  # output tokens mirrored so far
        self.jumps = 0  # the request's jump-forward count when last synced
        self.extend(prompt)

    def extend(self, new: list[int]) -> None:
        toks, table, lo, hi = self.tokens, self.table, self.min_n, self.max_n
        for t in new:
            i = len(toks)  # t's position: it continues the n-grams ending at i - 1
            for n in range(lo, min(hi, i) + 1):
                table[tuple(toks[i - n : i])] = i
            toks.append(t)

    def sync(self, output_ids: list[int], jumps: int) -> None:
        """Mirror the request's output. A jump-forward re-tokenizes the output's tail: cut the
        mirror where it differs (entries pointing past the cut stay; they only give worse
        drafts until overwritten)."""
        if jumps != self.jumps:
            self.jumps = jumps
            mirror = self.tokens
            base, i = self.n_prompt, 0
            limit = min(self.n_out, len(output_ids))
            while i < limit and mirror[base + i] == output_ids[i]:
                i += 1
            del mirror[base + i :]
            self.n_out = i
        if len(output_ids) > self.n_out:
            self.extend(output_ids[self.n_out :])
            self.n_out = len(output_ids)


class SharedIndex:
    def __init__(self, min_n: int, max_n: int, max_draft: int, capacity: int):
        self.min_n, self.max_n, self.max_draft = min_n, max_n, max_draft
        self.capacity = capacity
        self.table: OrderedDict[tuple, tuple] = OrderedDict()

    def add(self, tokens: list[int], start: int) -> None:
        """Enter the n-grams of `tokens` whose continuation starts at `start` or later (a
        finished request: its output, continuing its prompt's end)."""
        if self.capacity == 0:
            return
        table, lo, hi, k = self.table, self.min_n, self.max_n, self.max_draft
        for i in range(max(start, lo), len(tokens)):
            cont = tuple(tokens[i : i + k])  # one tuple shared by the n-grams ending at i - 1
            for n in range(lo, min(hi, i) + 1):
                key = tuple(tokens[i - n : i])
                table[key] = cont
                table.move_to_end(key)
        while len(table) > self.capacity:
            table.popitem(last=False)


def propose(own: OwnIndex, shared: SharedIndex, max_len: int) -> tuple[list[int], int]:
    """(draft tokens, length of the matched suffix n-gram); ([], 0) without a match."""
    if max_len <= 0:
        return [], 0
    toks = own.tokens
    end = len(toks)
    for n in range(min(own.max_n, end), own.min_n - 1, -1):
        key = tuple(toks[end - n :])
        p = own.table.get(key)
        if p is not None and p < end:
            return toks[p : p + max_len], n
        cont = shared.table.get(key)
        if cont:
            return list(cont[:max_len]), n
    return [], 0
