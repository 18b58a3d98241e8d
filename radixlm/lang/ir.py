"""The frontend's intermediate representation: what `s += ...` appends to a program's stream.

Expressions are small immutable-ish nodes; the interpreter executes them in order, the tracer
records them into a graph. `a + b` builds an `ExprList`, so `s += "Q: " + gen("a")` is one append.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence, Union

REGEX_INT = r"[-+]?[0-9]+[ \n]*"
REGEX_FLOAT = r"[-+]?[0-9]*\.?[0-9]+[ \n]*"
REGEX_BOOL = r"(True|False)"
REGEX_STR = r"\"[\w\d\s]*\""  # a quoted string; used by dtype=str


@dataclass
class SamplingParams:
    """Frontend sampling parameters; None means 'not set here' (run-level defaults fill it)."""

    max_new_tokens: Optional[int] = None
    min_new_tokens: Optional[int] = None
    n: Optional[int] = None
    stop: Union[None, str, list[str]] = None
    stop_token_ids: Optional[list[int]] = None
    stop_regex: Union[None, str, list[str]] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    frequency_penalty: Optional[float] = None
    presence_penalty: Optional[float] = None
    ignore_eos: Optional[bool] = None
    return_logprob: Optional[bool] = None
    logprob_start_len: Optional[int] = None
    top_logprobs_num: Optional[int] = None
    return_text_in_logprobs: Optional[bool] = None
    json_schema: Optional[str] = None
    regex: Optional[str] = None
    dtype: Any = None

    DEFAULTS = dict(max_new_tokens=128, min_new_tokens=0, stop=(), stop_regex=(), temperature=1.0,
                    top_p=1.0, top_k=-1, min_p=0.0, frequency_penalty=0.0, presence_penalty=0.0,
                    ignore_eos=False)

    def merged(self, defaults: "SamplingParams") -> "SamplingParams":
        """self's set fields over `defaults`' set fields."""
        out = dataclasses.replace(defaults)
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if v is not None:
                setattr(out, f.name, v)
        return out

    def with_stops(self, extra: Sequence[str]) -> "SamplingParams":
        """A copy whose stop strings also include `extra` (a chat template's stop strings, as
        SGLang's interpreter adds them to every gen)."""
        if not extra:
            return self
        return dataclasses.replace(self, stop=as_list(self.stop) + list(extra))

    def resolved(self) -> dict[str, Any]:
        """Every field with library defaults filled in (None stays None for optional ones).

        A `dtype` becomes its regex (it wins over `regex`, as in SGLang); int and float also stop
        at a space or newline, as SGLang's RuntimeEndpoint does.
        """
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for k, v in self.DEFAULTS.items():
            if d[k] is None:
                d[k] = v
        if d["dtype"] is not None:
            d["regex"] = dtype_regex(d["dtype"])
            if d["dtype"] in (int, "int", float, "float"):
                d["stop"] = as_list(d["stop"]) + [" ", "\n"]
        return d

    def to_runtime(self) -> dict[str, Any]:
        """SGLang-native `sampling_params` for /generate (only what the runtime knows)."""
        d = self.resolved()
        out = {k: d[k] for k in ("max_new_tokens", "min_new_tokens", "temperature", "top_p",
                                 "top_k", "min_p", "frequency_penalty", "presence_penalty",
                                 "ignore_eos")}
        for k in ("stop", "stop_regex"):
            if d[k]:
                out[k] = as_list(d[k])
        if d["stop_token_ids"]:
            out["stop_token_ids"] = list(d["stop_token_ids"])
        for k in ("regex", "json_schema"):
            if d[k] is not None:
                out[k] = d[k]
        return out


def as_list(x) -> list:
    """None/()/"" -> [], a string -> [it], a sequence -> a list."""
    if not x:
        return []
    return [x] if isinstance(x, str) else list(x)


def dtype_regex(dtype) -> str:
    table = {int: REGEX_INT, "int": REGEX_INT, float: REGEX_FLOAT, "float": REGEX_FLOAT,
             bool: REGEX_BOOL, "bool": REGEX_BOOL, str: REGEX_STR, "str": REGEX_STR}
    if dtype not in table:
        raise ValueError(f"gen(dtype=...): unsupported dtype {dtype!r} (int, float, bool or str)")
    return table[dtype]


class Expr:
    """Base of everything `s += ...` accepts. `+` concatenates into an ExprList."""

    def __add__(self, other):
        return ExprList([self, as_expr(other)])

    def __radd__(self, other):
        return ExprList([as_expr(other), self])


@dataclass(eq=False)
class Text(Expr):
    value: str


@dataclass(eq=False)
class ExprList(Expr):
    items: list = field(default_factory=list)

    def __add__(self, other):
        return ExprList(self.items + [as_expr(other)])

    def __radd__(self, other):
        return ExprList([as_expr(other)] + self.items)


@dataclass(eq=False)
class Gen(Expr):
    name: Optional[str]
    params: SamplingParams


@dataclass(eq=False)
class Select(Expr):
    name: Optional[str]
    choices: list[str]
    temperature: float = 0.0
    choices_method: Any = None


@dataclass(eq=False)
class Image(Expr):
    path: str


@dataclass(eq=False)
class Video(Expr):
    path: str
    num_frames: int


@dataclass(eq=False)
class SeparateReasoning(Expr):
    """After the gen/select `expr` named `name` ran: split its reasoning (`<think>...`) from its
    answer; `name` keeps the answer, `{name}_reasoning_content` gets the reasoning."""

    model_type: Optional[str]
    name: str

    @property
    def reasoning_name(self) -> str:
        return reasoning_name(self.name)


def reasoning_name(name: str) -> str:
    return f"{name}_reasoning_content"


@dataclass(eq=False)
class RoleBegin(Expr):
    role: str


@dataclass(eq=False)
class RoleEnd(Expr):
    role: str


@dataclass(eq=False)
class VarScopeBegin(Expr):
    name: str


@dataclass(eq=False)
class VarScopeEnd(Expr):
    name: str


@dataclass(eq=False)
class CommitLazy(Expr):
    """Force the text so far to the backend (fork uses it so branches share a cached prefix)."""


@dataclass(eq=False)
class GetForkVariable(Expr):
    """`s += f["x"]` inside a program: the value of a variable of another (forked) state."""

    state: Any
    name: str


@dataclass(eq=False)
class FuncCall(Expr):
    """A lambda appended to a fork group: called with each branch's state."""

    fn: Callable


def as_expr(x) -> Expr:
    if isinstance(x, Expr):
        return x
    if isinstance(x, str):
        return Text(x)
    if isinstance(x, (int, float)):
        return Text(str(x))
    if callable(x):
        return FuncCall(x)
    raise TypeError(f"cannot append {type(x).__name__} to a program state "
                    "(strings, gen/select/roles and lists of them are allowed)")


def flatten(expr: Expr) -> list[Expr]:
    if isinstance(expr, ExprList):
        out = []
        for item in expr.items:
            out.extend(flatten(item))
        return out
    return [expr]
