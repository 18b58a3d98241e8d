"""Per-request sampling parameters, named as in SGLang's `sampling_params` dict.

`SamplingParams.from_dict` rejects unknown keys and `verify()` rejects bad values with a
`ValueError` that names the field, so bad input fails before the request is queued.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional, Union

# Below this temperature a request is sampled greedily (argmax); SGLang uses the same cut-off.
GREEDY_TEMPERATURE = 1e-6
MAX_N = 128  # samples per prompt; each is a full request


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    min_new_tokens: int = 0
    stop: Union[None, str, list[str]] = None
    stop_token_ids: Optional[list[int]] = None
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
    stop_strs: list[str] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self):
        if self.stop is None:
            self.stop_strs = []
        elif isinstance(self.stop, str):
            self.stop_strs = [self.stop]
        else:
            self.stop_strs = list(self.stop)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @staticmethod
    def from_dict(d: Optional[dict[str, Any]]) -> "SamplingParams":
        d = dict(d or {})
        if "sampling_seed" in d:  # SGLang's name for the per-request seed
            d["seed"] = d.pop("sampling_seed")
        names = {f.name for f in dataclasses.fields(SamplingParams) if f.init}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"sampling_params: unknown field(s) {unknown}")
        return SamplingParams(**d)

    def verify(self, vocab_size: int) -> None:
        def bad(name, why):
            raise ValueError(f"sampling_params.{name}: {why} (got {getattr(self, name)!r})")

        def check_number(name, integer=False):
            v = getattr(self, name)
            ok = isinstance(v, int) if integer else isinstance(v, (int, float))
            if isinstance(v, bool) or not ok:
                bad(name, "must be an integer" if integer else "must be a number")

        for name in ("max_new_tokens", "min_new_tokens", "top_k", "n"):
            check_number(name, integer=True)
        for name in ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty",
                     "repetition_penalty"):
            check_number(name)
        if self.max_new_tokens < 0:
            bad("max_new_tokens", "must be >= 0")
        if self.min_new_tokens < 0 or self.min_new_tokens > self.max_new_tokens:
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
        if not 1 <= self.n <= MAX_N:
            bad("n", f"must be in [1, {MAX_N}]")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            bad("seed", "must be an integer")
        for s in self.stop_strs:
            if not isinstance(s, str) or not s:
                bad("stop", "must be a non-empty string or a list of them")
        for t in self.stop_token_ids or []:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
                bad("stop_token_ids", f"ids must be integers in [0, {vocab_size})")
        n_constraints = sum(x is not None for x in (self.regex, self.json_schema, self.ebnf))
        if n_constraints > 1:
            raise ValueError("sampling_params: at most one of regex, json_schema, ebnf may be set")
