"""Grammar-constrained decoding through xgrammar: validation, asynchronous compilation, masks.

- `validate_constraint` parses a request's regex / JSON schema / EBNF in the caller's thread
  (cheap, tokenizer-independent), so a bad one is a 400 before anything is queued.
- `GrammarCompilerPool` compiles against the tokenizer on a worker thread, off the scheduler loop,
  deduplicating by (kind, spec). Its cache of compiled grammars keeps at most `cache_size` of
  them, least recently used out (xgrammar's own, unbounded, cache is off); a request whose
  grammar is not ready by --grammar-compile-timeout is aborted by the scheduler.
- `apply_grammar_masks` fills one bitmask row per constrained request and applies all of them to
  the batch's logits in one call.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Optional

import torch

from radixlm.runtime.sampling_params import SamplingParams
from radixlm.runtime.constrained.json_schema_strings import json_schema_grammar


def _xgr():
    import xgrammar

    return xgrammar


def constraint_of(sp: SamplingParams) -> Optional[tuple[str, str]]:
    """(kind, spec) of a request's constraint, or None. JSON schemas are normalized to a string."""
    if sp.regex is not None:
        return "regex", sp.regex
    if sp.json_schema is not None:
        schema = sp.json_schema
        if not isinstance(schema, str):
            schema = json.dumps(schema)
        return "json", schema
    if sp.ebnf is not None:
        return "ebnf", sp.ebnf
    if sp.structural_tag is not None:
        tag = sp.structural_tag
        return "structural_tag", tag if isinstance(tag, str) else json.dumps(tag)
    return None


def structural_tag_arg(spec: str):
    """SGLang's structural_tag JSON -> what xgrammar takes: the legacy form
    {"structures": [{"begin", "schema", "end"}], "triggers": [...]} becomes a StructuralTag;
    the current form ({"type": "structural_tag", "format": ...}) is passed as JSON text."""
    xgr = _xgr()
    obj = json.loads(spec)
    if not isinstance(obj, dict):
        raise ValueError("must be a JSON object")
    if obj.get("structures") is None:
        if obj.get("format") is None:
            raise ValueError("needs either structures + triggers (legacy) or format")
        return spec
    if not isinstance(obj.get("triggers"), list):
        raise ValueError("a legacy structural tag (structures) needs triggers")
    for s in obj["structures"]:
        if not isinstance(s, dict) or "begin" not in s or "end" not in s:
            raise ValueError("each of structures needs begin and end")
    items = [xgr.StructuralTagItem(begin=s["begin"], end=s["end"],
                                   schema=json.dumps(s.get("schema") or {}))
             for s in obj["structures"]]
    tag = xgr.StructuralTag.from_legacy_structural_tag(items, obj["triggers"])
    tag.format.at_least_one = bool(obj.get("at_least_one", False))
    return tag


def validate_constraint(sp: SamplingParams) -> None:
    """Raise ValueError naming the field if the request's regex/json_schema/ebnf is invalid."""
    c = constraint_of(sp)
    if c is None:
        return
    kind, spec = c
    field = {"regex": "regex", "json": "json_schema", "ebnf": "ebnf",
             "structural_tag": "structural_tag"}[kind]
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"sampling_params.{field}: must be a non-empty string")
    xgr = _xgr()
    try:
        if kind == "regex":
            xgr.Grammar.from_regex(spec)
        elif kind == "json":
            json.loads(spec)
            xgr.Grammar.from_json_schema(spec)
        elif kind == "structural_tag":
            xgr.Grammar.from_structural_tag(structural_tag_arg(spec))
        else:
            xgr.Grammar.from_ebnf(spec)
    except (RuntimeError, ValueError, TypeError, KeyError, AttributeError) as e:
        msg = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        # xgrammar prefixes messages with "[time] file.cc:line:"; keep the human part
        raise ValueError(f"sampling_params.{field}: invalid {kind}: {msg.split(': ', 1)[-1]}") from None


class GrammarCompilerPool:
    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: tuple[int, ...] = (),
                 workers: int = 1, cache_size: int = 256):
        from radixlm.runtime.tokenizer_light import LightTokenizer

        xgr = _xgr()  # imports transformers anyway: the light tokenizer's HF twin costs ~0.4 s more
        if isinstance(tokenizer, LightTokenizer):  # xgrammar reads HF tokenizer internals
            tokenizer = tokenizer.hf
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=list(stop_token_ids) or None)
        self.compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="grammar-compile")
        self.vocab_size = vocab_size
        self.cache_size = max(1, cache_size)
        self._futures: OrderedDict[tuple[str, str], Future] = OrderedDict()  # LRU last
        self._lock = threading.Lock()

    def submit(self, kind: str, spec: str) -> Future:
        key = (kind, spec)
        with self._lock:
            fut = self._futures.get(key)
            if fut is None or (fut.done() and fut.exception() is not None):
                fut = self._futures[key] = self.pool.submit(self._compile, kind, spec)
            self._futures.move_to_end(key)
            while len(self._futures) > self.cache_size:  # in-flight ones finish for their owner
                self._futures.popitem(last=False)
            return fut

    def _compile(self, kind: str, spec: str):
        if kind == "regex":
            return self.compiler.compile_regex(spec)
        if kind == "json":
            # strict separators: longer forced strings for jump-forward, still valid JSON
            return self.compiler.compile_grammar(json_schema_grammar(spec))
        if kind == "structural_tag":
            return self.compiler.compile_structural_tag(structural_tag_arg(spec))
        return self.compiler.compile_grammar(spec)

    @staticmethod
    def matcher(compiled):
        return _xgr().GrammarMatcher(compiled)  # rollback is unlimited in xgrammar >= 0.2

    def shutdown(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


class MaskBuffer:
    """A reusable (B, ceil(V/32)) int32 bitmask, grown as batches grow."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self.buf: Optional[torch.Tensor] = None

    def get(self, rows: int) -> torch.Tensor:
        if self.buf is None or self.buf.shape[0] < rows:
            self.buf = _xgr().allocate_token_bitmask(max(rows, 16), self.vocab_size)
        return self.buf[:rows]


def apply_grammar_masks(logits: torch.Tensor, reqs: list, masks: MaskBuffer,
                        on_error=None) -> None:
    """logits (B, V): rows of requests with a grammar keep only the tokens it allows. With
    `on_error(req, exc)`, a request whose grammar raises is handed to it and its row left
    unmasked (its token is dropped by the caller) instead of failing the whole batch."""
    rows = [i for i, r in enumerate(reqs) if r.grammar is not None and not r.finished]
    if not rows:
        return
    bitmask = masks.get(len(reqs))
    failed = []
    for i in rows:
        try:
            reqs[i].grammar.fill_next_token_bitmask(bitmask, i)
        except Exception as e:
            if on_error is None:
                raise
            on_error(reqs[i], e)
            failed.append(i)
    if failed:  # a half-filled row could block every token: those rows stay unmasked
        rows = [i for i in rows if i not in failed]
        if not rows:
            return
    apply_bitmask_rows(logits, bitmask, rows, masks.vocab_size)


def apply_bitmask_rows(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int],
                       vocab_size: int) -> None:
    """logits (N, V): rows `rows` keep only the tokens their row of the host bitmask allows."""
    device_mask = bitmask.to(logits.device, non_blocking=True) if logits.is_cuda else bitmask
    _xgr().apply_token_bitmask_inplace(logits, device_mask, vocab_size=vocab_size, indices=rows)
