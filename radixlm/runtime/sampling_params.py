"""Per-request sampling parameters, named as in SGLang's `sampling_params` dict.

Every field of SGLang's `SamplingParams` (python/sglang/srt/sampling/sampling_params.py, 0.5.x) is
known here: `FIELDS` says for each whether it is honoured or refused, and why. SGLang's frontend
sends all of them on every call, unset ones as null (or [] for the stop lists), so a null means
"default" for every field, as in SGLang. `SamplingParams.from_dict` rejects unknown keys and
`verify()` rejects bad values with a `ValueError` that names the field, so bad input fails before
the request is queued.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from radixlm.runtime.request_limits import DEFAULT_LIMITS, RequestLimits

# Below this temperature a request is sampled greedily (argmax); SGLang uses the same cut-off.
GREEDY_TEMPERATURE = 1e-6

# field -> what this server does with it (the unit test walks SGLang's list against this)
FIELDS: dict[str, str] = {
    "max_new_tokens": "honoured; null: up to the context length",
    "min_new_tokens": "honoured (stop tokens are masked until reached)",
    "stop": "honoured; the matched string is trimmed unless no_stop_trim",
    "stop_token_ids": "honoured",
    "stop_regex": "honoured: the request stops once its output text matches (re.search); the "
                  "output keeps the matched text; finish_reason.matched is the pattern",
    "temperature": "honoured", "top_p": "honoured", "top_k": "honoured (-1 or >= vocab: off)",
    "min_p": "honoured", "frequency_penalty": "honoured", "presence_penalty": "honoured",
    "repetition_penalty": "honoured", "n": "honoured (n requests per prompt)",
    "json_schema": "honoured (xgrammar)", "regex": "honoured (xgrammar)",
    "ebnf": "honoured (xgrammar)", "structural_tag": "honoured (xgrammar structural tag)",
    "ignore_eos": "honoured", "skip_special_tokens": "honoured",
    "spaces_between_special_tokens": "honoured", "no_stop_trim": "honoured",
    "stream_interval": "honoured: a stream sends an update every this many tokens",
    "logit_bias": "honoured: {token id: bias} added to the logits before sampling",
    "sampling_seed": "honoured: per-request RNG (alias: seed)",
    "custom_params": "accepted and ignored: they only feed a custom_logit_processor, which this "
                     "server does not run (a custom_logit_processor itself is a 400)",
    "beam_width": "refused unless null or 1: beam search is not implemented",
    "watermark": "refused unless null: watermarking is not implemented",
}
ALIASES = {"seed": "sampling_seed"}  # our older name for sampling_seed


@dataclass
class SamplingParams:
    max_new_tokens: Optional[int] = 128  # None: resolved to the room left in the context
    min_new_tokens: int = 0
    stop: Union[None, str, list[str]] = None
    stop_token_ids: Optional[list[int]] = None
    stop_regex: Union[None, str, list[str]] = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: whole vocabulary
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False  # keep the matched stop string in the output text
    seed: Optional[int] = None  # per-request seed (SGLang: sampling_seed)
    n: int = 1
    regex: Optional[str] = None
    json_schema: Optional[str] = None
    ebnf: Optional[str] = None
    structural_tag: Optional[str] = None
    logit_bias: Optional[dict] = None  # {token id (str or int): bias}; normalized to int keys
    stream_interval: Optional[int] = None
    custom_params: Optional[dict] = None
    beam_width: Optional[int] = None
    watermark: Any = None
    stop_strs: list[str] = field(default_factory=list, init=False, repr=False)
    stop_regex_strs: list[str] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self):
        self.stop_strs = _as_list(self.stop)
        self.stop_regex_strs = _as_list(self.stop_regex)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @staticmethod
    def from_dict(d: Optional[dict[str, Any]]) -> "SamplingParams":
        d = dict(d or {})
        for ours, theirs in ALIASES.items():
            if ours in d:
                if d.get(theirs) is not None and d[ours] is not None and d[theirs] != d[ours]:
                    raise ValueError(f"sampling_params: {ours} and {theirs} disagree")
                if d.get(theirs) is None:
                    d[theirs] = d[ours]
                del d[ours]
        d["seed"] = d.pop("sampling_seed", None)
        names = {f.name for f in dataclasses.fields(SamplingParams) if f.init}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"sampling_params: unknown field(s) {unknown}")
        defaults = SamplingParams()
        for k in list(d):  # null means "default" (SGLang's frontend sends every field) ...
            if d[k] is None and k != "max_new_tokens":  # ... but a null max_new_tokens: no limit
                d[k] = getattr(defaults, k)
        return SamplingParams(**d)

    def verify(self, vocab_size: int, limits: RequestLimits = DEFAULT_LIMITS) -> None:
        def bad(name, why):
            raise ValueError(f"sampling_params.{name}: {why} (got {getattr(self, name)!r})")

        def check_number(name, integer=False):
            v = getattr(self, name)
            ok = isinstance(v, int) if integer else isinstance(v, (int, float))
            if isinstance(v, bool) or not ok:
                bad(name, "must be an integer" if integer else "must be a number")
            if not integer and not math.isfinite(v):
                bad(name, "must be finite")

        for name in ("min_new_tokens", "top_k", "n"):
            check_number(name, integer=True)
        if self.max_new_tokens is not None:
            check_number("max_new_tokens", integer=True)
        for name in ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty",
                     "repetition_penalty"):
            check_number(name)
        for name in ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens",
                     "no_stop_trim"):
            if not isinstance(getattr(self, name), bool):
                bad(name, "must be true or false")
        if self.max_new_tokens is not None and self.max_new_tokens < 0:
            bad("max_new_tokens", "must be >= 0")
        if self.min_new_tokens < 0 or (self.max_new_tokens is not None
                                       and self.min_new_tokens > self.max_new_tokens):
            bad("min_new_tokens", "must be in [0, max_new_tokens]")
        if self.temperature < 0:
            bad("temperature", "must be >= 0")
        if not 0 < self.top_p <= 1:
            bad("top_p", "must be in (0, 1]")
        if self.top_k < 1 and self.top_k != -1:
            bad("top_k", "must be -1 (disabled) or >= 1")
        if not 0 <= self.min_p <= 1:
            bad("min_p", "must be in [0, 1]")
        if not -2 <= self.frequency_penalty <= 2:
            bad("frequency_penalty", "must be in [-2, 2]")
        if not -2 <= self.presence_penalty <= 2:
            bad("presence_penalty", "must be in [-2, 2]")
        if not 0 < self.repetition_penalty <= 2:
            bad("repetition_penalty", "must be in (0, 2]")
        limits.check_n(self.n)
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not -2**63 <= self.seed < 2**63):
            raise ValueError(f"sampling_params.sampling_seed: must be a 64-bit integer "
                             f"(got {self.seed!r})")
        limits.check_stops(self.stop_strs, self.stop_regex_strs)  # before compiling any
        self._verify_stops(vocab_size)
        self._verify_extras(vocab_size)
        n_constraints = sum(x is not None for x in (self.regex, self.json_schema, self.ebnf,
                                                    self.structural_tag))
        if n_constraints > 1:
            raise ValueError("sampling_params: at most one of regex, json_schema, ebnf, "
                             "structural_tag may be set")

    def _verify_stops(self, vocab_size: int) -> None:
        if not isinstance(self.stop_strs, list):
            raise ValueError(f"sampling_params.stop: must be a string or a list of strings "
                             f"(got {self.stop!r})")
        for s in self.stop_strs:
            if not isinstance(s, str) or not s:
                raise ValueError(f"sampling_params.stop: must be a non-empty string or a list "
                                 f"of them (got {self.stop!r})")
        if not isinstance(self.stop_token_ids, (list, tuple, set, type(None))):
            raise ValueError("sampling_params.stop_token_ids: must be a list of token ids")
        for t in self.stop_token_ids or []:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
                raise ValueError(f"sampling_params.stop_token_ids: ids must be integers in "
                                 f"[0, {vocab_size}) (got {t!r})")
        pats = self.stop_regex_strs
        if not isinstance(pats, list):
            raise ValueError(f"sampling_params.stop_regex: must be a pattern or a list of "
                             f"patterns (got {self.stop_regex!r})")
        for p in pats:
            if not isinstance(p, str) or not p:
                raise ValueError(f"sampling_params.stop_regex: must be a non-empty pattern or a "
                                 f"list of them (got {p!r})")
            try:
                re.compile(p)
            except (re.error, RecursionError, OverflowError) as e:
                raise ValueError(f"sampling_params.stop_regex: invalid pattern {p!r}: {e}") from None

    def _verify_extras(self, vocab_size: int) -> None:
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError("sampling_params.logit_bias: must be an object "
                                 "{token id: bias}")
            norm = {}
            for k, v in self.logit_bias.items():
                try:
                    tid = int(k)
                except (TypeError, ValueError):
                    tid = None
                if tid is None or isinstance(k, bool) or not 0 <= tid < vocab_size:
                    raise ValueError(f"sampling_params.logit_bias: keys must be token ids in "
                                     f"[0, {vocab_size}) (got {k!r})")
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                    raise ValueError(f"sampling_params.logit_bias: the bias of {k!r} must be a "
                                     f"finite number (got {v!r})")
                norm[tid] = float(v)
            self.logit_bias = norm or None
        si = self.stream_interval
        if si is not None and (isinstance(si, bool) or not isinstance(si, int) or si < 1):
            raise ValueError(f"sampling_params.stream_interval: must be an integer >= 1 "
                             f"(got {si!r})")
        if self.custom_params is not None and not isinstance(self.custom_params, dict):
            raise ValueError("sampling_params.custom_params: must be an object")
        if self.beam_width is not None and self.beam_width != 1:
            raise ValueError(f"sampling_params.beam_width: beam search is not supported by this "
                             f"server (got {self.beam_width!r}; use null or 1)")
        if self.watermark is not None:
            raise ValueError("sampling_params.watermark: watermarking is not supported by this "
                             "server (use null)")
        if self.structural_tag is not None and not isinstance(self.structural_tag, (str, dict)):
            raise ValueError("sampling_params.structural_tag: must be a JSON string or object")


def _as_list(v) -> list:
    if v is None:
        return []
    if isinstance(v, str):
        return [v]
    if isinstance(v, (list, tuple)):
        return list(v)
    return v  # not a list: verify() names the field
