"""Tracing's placeholders: the values a traced program body sees instead of its arguments and
generated variables (see radixlm.lang.tracer). Appending one is fine; converting it to a concrete
value raises TracingError, because the program's text or control flow would then depend on a value
tracing does not have."""

from __future__ import annotations

import dataclasses
from typing import Optional

from radixlm.lang import ir


class TracingError(RuntimeError):
    """The program does something tracing cannot follow (see the message for what and why)."""

    def __init__(self, message: str, placeholder: Optional["_Placeholder"] = None,
                 operation: Optional[str] = None):
        super().__init__(message)
        self.placeholder = placeholder
        self.operation = operation


# --- placeholders ---------------------------------------------------------------------------------
def _consume(op: str):
    def method(self, *args, **kwargs):
        raise self._error(op)
    method.__name__ = f"_consume_{op}"
    return method


class _Placeholder(ir.Expr):
    """A value tracing does not have. Appending it is fine; converting it to a concrete value is
    not.

    `path` records item/attribute access and calls made on it (`item["q"]`, `q.strip()`), replayed
    on the real value at run time.
    """

    def __init__(self, tracer, name: str, path: tuple = ()):
        object.__setattr__(self, "_tracer", tracer)
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "path", path)

    # derived placeholders
    def _derive(self, step) -> "_Placeholder":
        raise NotImplementedError

    def __getitem__(self, key):
        if isinstance(key, _Placeholder):
            raise key._error("use as an index")
        return self._derive(("item", key))

    def __getattr__(self, attr):
        if attr.startswith("_"):
            raise AttributeError(attr)
        return self._derive(("attr", attr))

    def __call__(self, *args, **kwargs):
        return self._derive(("call", args, kwargs))

    def __setattr__(self, key, value):
        raise self._error("attribute assignment")

    @property
    def display(self) -> str:
        out = self.name
        for step in self.path:
            if step[0] == "item":
                out += f"[{step[1]!r}]"
            elif step[0] == "attr":
                out += f".{step[1]}"
            else:
                out += "(...)"
        return out

    def _error(self, op: str) -> TracingError:
        raise NotImplementedError

    # concrete conversions: each is a point where the program's text or control flow would depend
    # on the value
    __str__ = _consume("str() or %-formatting")
    __format__ = _consume("an f-string or str.format()")
    __bytes__ = _consume("bytes()")
    __len__ = _consume("len()")
    __iter__ = _consume("iteration (a for loop, list(), unpacking or str.join())")
    __reversed__ = _consume("reversed()")
    __contains__ = _consume("an `in` test")
    __bool__ = _consume("a truth test (if / while / and / or / not)")
    __eq__ = _consume("a comparison (==)")
    __ne__ = _consume("a comparison (!=)")
    __lt__ = _consume("a comparison (<)")
    __le__ = _consume("a comparison (<=)")
    __gt__ = _consume("a comparison (>)")
    __ge__ = _consume("a comparison (>=)")
    __int__ = _consume("int()")
    __float__ = _consume("float()")
    __complex__ = _consume("complex()")
    __index__ = _consume("use as an integer index")
    __round__ = _consume("round()")
    __mul__ = __rmul__ = _consume("multiplication")
    __mod__ = __rmod__ = _consume("%-formatting")
    __sub__ = __rsub__ = _consume("subtraction")
    __truediv__ = __rtruediv__ = _consume("division")
    __floordiv__ = __rfloordiv__ = _consume("division")
    __pow__ = __rpow__ = _consume("exponentiation")
    __neg__ = __pos__ = __abs__ = _consume("arithmetic")
    __hash__ = object.__hash__


class TracedArgument(_Placeholder):
    """The placeholder for a program argument (named after the parameter)."""

    def _derive(self, step):
        return TracedArgument(self._tracer, self.name, self.path + (step,))

    def _error(self, op: str) -> TracingError:
        t = self._tracer
        err = TracingError(
            f"tracing program {t.program_name!r}: argument {self.display!r} is converted to a "
            f"concrete value by {op}, so the program's text depends on it in a way tracing cannot "
            "follow (tracing runs the body with placeholders, not real values). Append the "
            f"argument as an expression instead: `s += \"...\" + {self.name}` or a separate "
            f"`s += {self.name}`; or give it a fixed value (f.trace({self.name}=...) or "
            f"f.bind({self.name}=...)).", self, op)
        t.note_error(err)
        return err

    def __repr__(self):
        return f"TracedArgument({self.display})"


class TracedVariable(_Placeholder):
    """What `s["x"]` returns while tracing: the value node `producer` gives x at run time."""

    def __init__(self, tracer, name, producer: int, reader_stream: int, path: tuple = ()):
        super().__init__(tracer, name, path)
        object.__setattr__(self, "producer", producer)
        object.__setattr__(self, "reader_stream", reader_stream)

    def _derive(self, step):
        return TracedVariable(self._tracer, self.name, self.producer, self.reader_stream,
                              self.path + (step,))

    def _error(self, op: str) -> TracingError:
        t = self._tracer
        err = TracingError(
            f"tracing program {t.program_name!r}: the generated variable {self.display!r} (node "
            f"n{self.producer}) is used as a concrete Python value by {op}, e.g. control flow on "
            "the model's output or formatting it into a string. Its value exists only at run "
            "time, so the program's text and control flow cannot be traced. Append it as an "
            f"expression instead (`s += s[{self.name!r}]`), or run the program with the "
            "interpreter (f.run / f.run_batch) instead.", self, op)
        t.note_error(err)
        return err

    def __repr__(self):
        return f"TracedVariable({self.display} <- n{self.producer})"


def placeholders_in(x) -> list[_Placeholder]:
    """Every placeholder inside x (lists, tuples, dicts, SamplingParams, call arguments)."""
    out: list[_Placeholder] = []

    def walk(v):
        if isinstance(v, _Placeholder):
            out.append(v)
            for step in v.path:
                if step[0] == "call":
                    walk(step[1])
                    walk(step[2])
        elif isinstance(v, (list, tuple)):
            for item in v:
                walk(item)
        elif isinstance(v, dict):
            for item in v.values():
                walk(item)
        elif isinstance(v, ir.SamplingParams):
            for f in dataclasses.fields(v):
                walk(getattr(v, f.name))

    walk(x)
    return out
