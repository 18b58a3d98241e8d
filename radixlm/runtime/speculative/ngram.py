"""NGRAM drafts: the tokens that followed the current suffix elsewhere.

Two tables, both keyed by an n-gram (n token ids, min_match <= n <= max_match; as a hash):
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

# n-grams are keyed by a 64-bit polynomial hash, H(a_1..a_n) = H(a_1..a_n-1) * P + (a_n + 1):
# the hashes of all suffix lengths roll forward with one multiply-add each per token (a tuple
# per length cost ~13 us a token). A collision only makes a wrong draft, which verification
# rejects.
_P = 0x9E3779B97F4A7C15
_MASK = (1 << 64) - 1


def suffix_hashes(tokens: list[int], max_n: int) -> list[int]:
    """[H(last 1 token), H(last 2), ..., H(last min(max_n, len) tokens)]."""
    out, h, pw = [], 0, 1
    for n in range(1, min(max_n, len(tokens)) + 1):
        h = (h + (tokens[-n] + 1) * pw) & _MASK
        pw = pw * _P & _MASK
        out.append(h)
    return out


def roll(suffix: list[int], token: int, max_n: int) -> list[int]:
    """The suffix hashes after appending `token`."""
    t = token + 1
    return [t] + [(h * _P + t) & _MASK for h in suffix[: max_n - 1]]


class OwnIndex:
    """`lazy`: the prompt is indexed by `build` calls (a few hundred tokens at a time, ~3 us a
    token) rather than at once: on a GPU that work runs while a step is in flight, where 64
    prompts indexed in one step cost ~10% of the steps of a 128-token run at batch 64. Lookups
    and `sync` need it `ready`."""

    __slots__ = ("tokens", "table", "suffix", "min_n", "max_n", "n_prompt", "n_out", "jumps",
                 "prompt")

    def __init__(self, prompt: list[int], min_n: int, max_n: int, lazy: bool = False):
        self.tokens: list[int] = []
        self.table: dict[int, int] = {}  # n-gram hash -> the position after its last occurrence
        self.suffix: list[int] = []  # suffix_hashes(tokens, max_n), kept rolling
        self.min_n, self.max_n = min_n, max_n
        self.n_prompt = len(prompt)
        self.n_out = 0  # output tokens mirrored so far
        self.jumps = 0  # the request's jump-forward count when last synced
        self.prompt = prompt
        self.build(0 if lazy else len(prompt))

    @property
    def ready(self) -> bool:
        return len(self.tokens) >= self.n_prompt

    def build(self, max_tokens: int) -> int:
        """Index up to `max_tokens` more prompt tokens; returns how many it did."""
        if self.prompt is None:
            return 0
        start = len(self.tokens)
        part = self.prompt[start : start + max_tokens]
        self.extend(part)
        if self.ready:
            self.prompt = None  # (the tokens list holds it now)
        return len(part)

    def extend(self, new: list[int]) -> None:
        toks, table, lo, hi = self.tokens, self.table, self.min_n, self.max_n
        suffix = self.suffix
        for t in new:
            i = len(toks)  # t's position: it continues the n-grams ending at i - 1
            for n in range(lo, len(suffix) + 1):
                table[suffix[n - 1]] = i
            suffix = roll(suffix, t, hi)
            toks.append(t)
        self.suffix = suffix

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
            self.suffix = suffix_hashes(mirror, self.max_n)
        if len(output_ids) > self.n_out:
            self.extend(output_ids[self.n_out :])
            self.n_out = len(output_ids)


class SharedIndex:
    def __init__(self, min_n: int, max_n: int, max_draft: int, capacity: int):
        self.min_n, self.max_n, self.max_draft = min_n, max_n, max_draft
        self.capacity = capacity
        self.table: OrderedDict[int, tuple] = OrderedDict()  # n-gram hash -> continuation

    def add(self, tokens: list[int], start: int) -> None:
        """Enter the n-grams of `tokens` whose continuation starts at `start` or later (a
        finished request: its output, continuing its prompt's end)."""
        if self.capacity == 0 or start >= len(tokens):
            return
        table, lo, hi, k = self.table, self.min_n, self.max_n, self.max_draft
        suffix = suffix_hashes(tokens[:start], hi)
        for i in range(start, len(tokens)):
            cont = tuple(tokens[i : i + k])  # one tuple shared by the n-grams ending at i - 1
            for n in range(lo, len(suffix) + 1):
                table[suffix[n - 1]] = cont
                table.move_to_end(suffix[n - 1])
            suffix = roll(suffix, tokens[i], hi)
        while len(table) > self.capacity:
            table.popitem(last=False)


def propose(own: OwnIndex, shared: SharedIndex, max_len: int) -> tuple[list[int], int]:
    """(draft tokens, length of the matched suffix n-gram); ([], 0) without a match."""
    if max_len <= 0:
        return [], 0
    toks, suffix = own.tokens, own.suffix
    end = len(toks)
    for n in range(len(suffix), own.min_n - 1, -1):
        key = suffix[n - 1]
        p = own.table.get(key)
        if p is not None and p < end:
            return toks[p : p + max_len], n
        cont = shared.table.get(key)
        if cont:
            return list(cont[:max_len]), n
    return [], 0
