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

import numpy as np

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


VECTOR_MIN = 64  # tokens from which ngram_hashes' numpy pass beats rolling them one by one


def ngram_hashes(context: list[int], new: list[int], max_n: int) -> np.ndarray:
    """(len(new), max_n) uint64: row j, column n - 1 = H of the n tokens ending at new[j] in
    context + new (the same values `roll` gives; uint64 arithmetic wraps mod 2**64 as the
    masked ints do), 0 where fewer than n tokens end there. `context`: at most the max_n - 1
    tokens before `new` that matter. Indexing a 600-token prompt at max_n = 6 cost 1.5 us a
    token rolled in Python, 0.6 with these hashes and one dict update (Zen 4, 2026-11-28): a
    prompt is indexed at its request's first lookup, on the step's critical path."""
    a = np.asarray(context[-(max_n - 1):] if max_n > 1 else [], dtype=np.uint64)
    c = a.shape[0]
    t = np.concatenate([a, np.asarray(new, dtype=np.uint64)]) + np.uint64(1)  # (c + L,)
    out = np.zeros((t.shape[0], max_n), dtype=np.uint64)
    out[:, 0] = t
    for n in range(1, max_n):  # H_n+1 ending at k = H_n ending at k - 1 times P, plus t_k
        out[n:, n] = out[n - 1 : -1, n - 1] * np.uint64(_P) + t[n:]
    return out[c:]


class OwnIndex:
    """`lazy`: the prompt is indexed by `build` calls (a few hundred tokens at a time, ~0.6 us a
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
        if len(new) > VECTOR_MIN and not toks:  # the first token continues no n-gram
            self.extend(new[:1])
            new = new[1:]
        if len(new) >= VECTOR_MIN and toks:
            # token j (position i0 + j) continues the n-grams ending at i0 + j - 1: row j of
            # the hashes ending at [last old token] + new[:-1]
            i0 = len(toks)
            h = ngram_hashes(toks[:-1], [toks[-1]] + new[:-1], hi)  # (L, hi)
            avail = np.minimum(np.arange(i0, i0 + len(new)), hi)  # tokens ending there
            keep = np.arange(1, hi + 1)[None, :] <= avail[:, None]
            keep[:, : lo - 1] = False
            pos = np.broadcast_to(np.arange(i0, i0 + len(new))[:, None], h.shape)
            table.update(zip(h[keep].tolist(), pos[keep].tolist()))  # (row-major: j, then n)
            toks.extend(new)
            last = ngram_hashes(toks[-hi:-1], toks[-1:], hi)[0]
            self.suffix = last[: min(hi, len(toks))].tolist()
            return
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
        if start == 0:  # the first token continues no n-gram
            start = 1
        # row i - start: the hashes of the n-grams ending at i - 1, n = 1..hi (0: too short)
        h = ngram_hashes(tokens[: start - 1], tokens[start - 1 : -1], hi).tolist()
        for i in range(start, len(tokens)):
            cont = tuple(tokens[i : i + k])  # one tuple shared by the n-grams ending at i - 1
            row = h[i - start]
            for n in range(lo, min(hi, i) + 1):
                table[row[n - 1]] = cont
                table.move_to_end(row[n - 1])
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
