"""Character-level scanners the streaming tool-call parser is built from: one JSON value, one
call object ({"name": ..., "arguments": ...}), and a marker finder that holds back text which may
still turn out to be a marker. See parsers.py for the contract they serve."""

from __future__ import annotations

import json
from typing import Optional

_WS = " \t\r\n"
# inside a JSON container, outside strings, only these characters can occur
_JSON_STRUCTURAL = set(_WS + "{}[],:.+-0123456789eEtrufalsn")
_PRIMITIVE = set("0123456789.+-eEtrufalsn")


class _Value:
    """Scans one JSON value char by char; knows when it ends, not whether it is valid."""

    def __init__(self, first: str):
        self.kind = ("container" if first in "{[" else "string" if first == '"'
                     else "primitive" if first in _PRIMITIVE else None)
        self.depth = 1 if self.kind == "container" else 0
        self.in_str = self.kind == "string"
        self.esc = False
        self.done = self.kind is None
        self.error = self.kind is None
        self.raw = [first] if self.kind else []

    def feed(self, c: str) -> bool:
        """Consume c (True) or, for a primitive, end before it (False: c is not part of it)."""
        if self.kind == "primitive":
            if c in _PRIMITIVE:
                self.raw.append(c)
                return True
            self.done = True
            return False
        self.raw.append(c)
        if self.in_str:
            if self.esc:
                self.esc = False
            elif c == "\\":
                self.esc = True
            elif c == '"':
                self.in_str = False
                if self.kind == "string":
                    self.done = True
            return True
        if c == '"':
            self.in_str = True
        elif c in "{[":
            self.depth += 1
        elif c in "}]":
            self.depth -= 1
            self.done = self.depth == 0
        elif c not in _JSON_STRUCTURAL:
            self.raw.pop()
            self.done = self.error = True
            return False
        return True

    def text(self) -> str:
        return "".join(self.raw)


class _CallObject:
    """Scans one call object {"name": ..., "arguments": {...}, ...} char by char, reporting the
    name (once complete) and argument fragments to its parser as they become known."""

    NAME_KEYS = ("name",)
    ARGS_KEYS = ("arguments", "parameters")

    def __init__(self, parser):  # the StreamingToolParser it reports to
        self.p = parser
        self.state = "open"
        self.key: Optional[str] = None
        self.val: Optional[_Value] = None
        self.index: Optional[int] = None  # assigned when the name is known
        self.held_args: list[str] = []  # argument text seen before the name
        self.args_seen = False
        self.streaming_args = False
        self.done = False
        self.error = False

    # name / argument events
    def _name(self, name: str) -> None:
        if self.index is None:
            self.index = self.p._new_call(name, "".join(self.held_args))
            self.held_args = []

    def _args(self, frag: str) -> None:
        if not frag:
            return
        if self.index is None:
            self.held_args.append(frag)
        else:
            self.p._call_args(self.index, frag)

    def _end_value(self) -> None:
        val, key, self.val = self.val, self.key, None
        if key in self.NAME_KEYS and val.kind == "string" and self.index is None:
            try:
                name = json.loads(val.text())
            except ValueError:
                name = None
            if isinstance(name, str) and name:
                self._name(name)
        elif key in self.ARGS_KEYS and not self.args_seen:
            self.args_seen = True
            if not self.streaming_args:  # a JSON string holding the arguments, or a primitive
                text = val.text()
                if val.kind == "string":
                    try:
                        text = json.loads(text)
                    except ValueError:
                        pass
                self._args(text if isinstance(text, str) else val.text())

    def close(self) -> None:
        """The object is over (complete or not): settle what the stream still owes."""
        if self.index is not None and not self.args_seen and not self.streaming_args:
            self.p._call_args(self.index, "{}")
        self.args_seen = True

    def feed(self, c: str) -> bool:
        """Consume c; False means c is not part of this object (it is done or broken)."""
        if self.done:
            return False
        st = self.state
        if st == "value":
            consumed = self.val.feed(c)
            if consumed and self.streaming_args:
                self._args(c)
            if self.val.error:
                return self._fail()
            if self.val.done:
                self._end_value()
                self.state = "after"
            if consumed:
                return True
            st = self.state = "after"
        if c in _WS and st != "in_key":
            return True
        if st == "open":
            if c == "{":
                self.state = "key0"
                return True
            return self._fail()
        if st in ("key0", "key"):
            if c == '"':
                self.val, self.state = _Value(c), "in_key"
                return True
            if c == "}" and st == "key0":
                return self._finish()
            return self._fail()
        if st == "in_key":
            self.val.feed(c)
            if self.val.done:
                try:
                    self.key = json.loads(self.val.text())
                except ValueError:
                    self.key = None
                self.state = "colon"
            return True
        if st == "colon":
            if c == ":":
                self.state = "value0"
                return True
            return self._fail()
        if st == "value0":
            self.val = _Value(c)
            if self.val.error:
                return self._fail()
            self.state = "value"
            self.streaming_args = (self.key in self.ARGS_KEYS and not self.args_seen
                                   and self.val.kind == "container" and c == "{")
            if self.streaming_args:
                self._args(c)
            return True
        if st == "after":
            if c == ",":
                self.state = "key"
                return True
            if c == "}":
                return self._finish()
            return self._fail()
        return False  # done or failed

    def _finish(self) -> bool:
        self.state, self.done = "done", True
        self.close()
        return True

    def _fail(self) -> bool:
        self.state, self.done, self.error = "failed", True, True
        self.close()
        return False


class _Marker:
    """Finds a marker in a char stream, holding back text that may be its beginning."""

    def __init__(self, markers: tuple[str, ...]):
        self.markers = markers
        self.buf = ""

    def feed(self, c: str) -> tuple[str, Optional[str]]:
        """(text that is certainly not part of a marker, the marker completed by c or None)."""
        self.buf += c
        for m in self.markers:
            if self.buf.endswith(m):
                before, self.buf = self.buf[:-len(m)], ""
                return before, m
        keep = 0
        for k in range(min(len(self.buf), max(map(len, self.markers))), 0, -1):
            tail = self.buf[-k:]
            if any(m.startswith(tail) for m in self.markers):
                keep = k
                break
        out = self.buf[:len(self.buf) - keep]
        self.buf = self.buf[len(self.buf) - keep:]
        return out, None

    def flush(self) -> str:
        out, self.buf = self.buf, ""
        return out
