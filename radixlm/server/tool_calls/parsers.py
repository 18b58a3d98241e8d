"""Tool-call formats by model family, and one streaming parser that serves them all.

A format says how a model writes its calls:

    hermes   <tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>   (Hermes, Qwen, SmolLM)
    llama3   {"name": "f", "parameters": {...}}  at the start of the reply, or after
             <|python_tag|>; several calls separated by ';'                  (Llama 3.1+)
    mistral  [TOOL_CALLS] [{"name": "f", "arguments": {...}}, ...]           (Mistral <= v7)
             [TOOL_CALLS]f[ARGS]{...}                                         (Mistral v11+)

`StreamingToolParser.feed(text)` takes the model's output in pieces of any size and returns
(content delta, call deltas). Contract, tested at every split point of every format:
- nothing that may still turn out to be markup is ever returned as content (a possible marker
  prefix is held back until it is decided), and markup itself never is;
- a call's first delta carries its name (only once the name string is complete), later ones
  carry fragments of its arguments, which are the model's own JSON text, verbatim;
- the result does not depend on how the text was split: `parse(text)` is `feed(text)` plus
  `finish()`, so a streamed reply reassembles to exactly the non-streamed one.

Content is trimmed: whitespace at its start and end, and around calls, is dropped (it only
separates markup). A call whose JSON breaks off after its name stands with the arguments written
so far (the stream cannot take the name back); one that breaks off before a name is dropped.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Optional

_WS = " \t\r\n"
# inside a JSON container, outside strings, only these characters can occur
_JSON_STRUCTURAL = set(_WS + "{}[],:.+-0123456789eEtrufalsn")
_PRIMITIVE = set("0123456789.+-eEtrufalsn")


@dataclass
class ToolCallDelta:
    """What one call gained: `name` on its first delta only; `arguments` a JSON text fragment."""

    index: int
    name: Optional[str] = None
    arguments: str = ""


@dataclass
class ParsedToolCall:
    name: str
    arguments: str  # the JSON text of the arguments (verbatim from the model)


@dataclass(frozen=True)
class ToolCallFormat:
    """A model family's way of writing calls (see the module docstring)."""

    name: str
    region: str  # "tagged" (one block per marker pair) | "sequence" | "mistral"
    open_markers: tuple[str, ...]
    drop_markers: tuple[str, ...] = ()  # stray markup removed from content
    close_marker: Optional[str] = None  # "tagged" only
    json_at_start: bool = False  # a reply that opens with {"name" is a call (llama3)
    args_key: str = "arguments"  # the key the format writes the arguments under
    needs_special_tokens: bool = False  # the open marker is a special token: keep it in the text
    description: str = ""


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

    def __init__(self, parser: "StreamingToolParser"):
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


_LLAMA_START = re.compile(r'\{\s*"name"')
_LLAMA_START_PREFIX = re.compile(r'\{\s*(?:"(?:n(?:a(?:m(?:e)?)?)?)?)?')


class StreamingToolParser:
    """Incremental parser of one reply in one format (see the module docstring)."""

    def __init__(self, fmt: ToolCallFormat):
        self.fmt = fmt
        self.mode = "start" if fmt.json_at_start else "text"
        self.text_marker = _Marker(fmt.open_markers + fmt.drop_markers)
        self.start_buf = ""
        self.region: Optional[str] = None  # sub-state inside a call region
        self.call: Optional[_CallObject] = None
        self.close_marker = _Marker((fmt.close_marker,)) if fmt.close_marker else None
        self.v11_name = ""
        self.n_calls = 0
        # per-feed output
        self._content: list[str] = []
        self._deltas: list[ToolCallDelta] = []
        # content whitespace handling
        self._ws_hold = ""
        self._content_started = False

    # --- callbacks of _CallObject -----------------------------------------------------------
    def _new_call(self, name: str, args: str) -> int:
        index = self.n_calls
        self.n_calls += 1
        self._ws_hold = ""
        self._deltas.append(ToolCallDelta(index, name, args))
        return index

    def _call_args(self, index: int, frag: str) -> None:
        last = self._deltas[-1] if self._deltas else None
        if last is not None and last.index == index:
            last.arguments += frag
        else:
            self._deltas.append(ToolCallDelta(index, None, frag))

    # --- content ------------------------------------------------------------------------------
    def _emit_text(self, s: str) -> None:
        if not s:
            return
        s = self._ws_hold + s
        body = s.rstrip(_WS)
        self._ws_hold = s[len(body):]
        if not self._content_started:
            body = body.lstrip(_WS)
        if body:
            self._content.append(body)
            self._content_started = True

    # --- the char loop ------------------------------------------------------------------------
    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        for c in text:
            self._char(c)
        return self._take()

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """End of the reply: release held text that turned out not to be markup."""
        if self.mode == "start":
            self.mode = "text"
            for c in self.start_buf:
                self._char(c)
        if self.mode == "text":
            self._emit_text(self.text_marker.flush())
        elif self.call is not None:
            if self.call.state == "value" and self.call.val.kind == "primitive":
                self.call.feed(" ")  # a trailing primitive ends with the text
            self.call.close()
        self._ws_hold = ""
        return self._take()

    def _take(self) -> tuple[str, list[ToolCallDelta]]:
        content, deltas = "".join(self._content), self._deltas
        self._content, self._deltas = [], []
        return content, deltas

    def _char(self, c: str) -> None:
        if self.mode == "start":
            return self._start_char(c)
        if self.mode == "text":
            before, marker = self.text_marker.feed(c)
            self._emit_text(before)
            if marker in self.fmt.open_markers:
                self._open_region()
            return None
        return self._region_char(c)

    def _start_char(self, c: str) -> None:
        self.start_buf += c
        s = self.start_buf.lstrip(_WS)
        if not s:
            return
        if _LLAMA_START.fullmatch(s):
            self.mode, self.start_buf = "text", ""
            self._open_region()
            for ch in s:
                self._region_char(ch)
        elif not _LLAMA_START_PREFIX.fullmatch(s):
            buf, self.start_buf, self.mode = self.start_buf, "", "text"
            for ch in buf:
                self._char(ch)

    def _open_region(self) -> None:
        self.mode = "region"
        self._ws_hold = ""
        self.call = None
        self.region = {"tagged": "call_wait", "sequence": "between",
                       "mistral": "mistral_start"}[self.fmt.region]

    def _exit_region(self, reprocess: Optional[str] = None) -> None:
        self.mode, self.region, self.call = "text", None, None
        self.text_marker = _Marker(self.fmt.open_markers + self.fmt.drop_markers)
        if self.close_marker is not None:
            self.close_marker.buf = ""
        if reprocess is not None:
            self._char(reprocess)

    def _start_call(self, c: str) -> bool:
        self.call = _CallObject(self)
        return self.call.feed(c)

    def _region_char(self, c: str) -> None:
        r = self.region
        if self.fmt.region == "tagged":
            # the close marker ends the block wherever it appears outside a call's JSON
            if r == "in_call":
                if self.call.feed(c):
                    if self.call.done:
                        self.region = "call_wait"
                    return
                self.region = "skip"  # broken JSON: drop the rest of the block
            _, marker = self.close_marker.feed(c)
            if marker is not None:
                return self._exit_region()
            if self.region == "call_wait" and c == "{" and self.close_marker.buf == "":
                self.region = "in_call"
                self._start_call(c)
            elif self.region == "call_wait" and c not in _WS and self.close_marker.buf == "":
                self.region = "skip"
            return None
        if self.fmt.region == "sequence":
            if r == "in_call":
                if self.call.feed(c):
                    if self.call.done:
                        self.region = "between"
                    return None
                self.region = "dead"  # broken JSON: the rest of the reply is not content
                return None
            if r == "between":
                if c in _WS or c == ";":
                    return None
                if c == "{":
                    self.region = "in_call"
                    self._start_call(c)
                    return None
                return self._exit_region(reprocess=c)
            return None  # dead
        # mistral
        if r == "mistral_start":
            if c in _WS:
                return None
            if c == "[":
                self.region = "array_item"
            elif c == "{":
                self.region = "single"
                self._start_call(c)
            elif c.isalnum() or c in "_-.":
                self.region, self.v11_name = "v11_name", c
            else:
                self.region = "dead"
            return None
        if r in ("single", "array_call"):
            if self.call.feed(c):
                if self.call.done:
                    self.region = "array_after" if r == "array_call" else None
                    if r == "single":
                        self._exit_region()
                return None
            self.region = "dead"
            return None
        if r == "array_item":
            if c in _WS:
                return None
            if c == "{":
                self.region = "array_call"
                self._start_call(c)
            elif c == "]":
                self._exit_region()
            else:
                self.region = "dead"
            return None
        if r == "array_after":
            if c in _WS:
                return None
            if c == ",":
                self.region = "array_item"
            elif c == "]":
                self._exit_region()
            else:
                self.region = "dead"
            return None
        if r == "v11_name":
            self.v11_name += c
            if self.v11_name.endswith("[ARGS]"):
                name = self.v11_name[:-len("[ARGS]")].split("[CALL_ID]")[0].strip()
                self.region = "v11_args0"
                if not name:
                    self.region = "dead"
                    return None
                self.call = _CallObject(self)
                self.call._name(name)
                self.call.key, self.call.state = "arguments", "value0"
            elif len(self.v11_name) > 256:
                self.region = "dead"
            return None
        if r == "v11_args0":
            if c in _WS:
                return None
            self.region = "v11_args"
            self.call.feed(c)
            return None
        if r == "v11_args":
            consumed = self.call.feed(c)
            if self.call.state == "after" or self.call.done:  # the arguments value ended
                self.call.close()
                self._exit_region(reprocess=None if consumed else c)
            return None
        return None  # dead: swallow the rest


def parse_tool_calls(fmt: ToolCallFormat, text: str) -> tuple[str, list[ParsedToolCall]]:
    """The whole reply at once: (content, calls). Exactly what streaming it would give."""
    p = StreamingToolParser(fmt)
    c1, d1 = p.feed(text)
    c2, d2 = p.finish()
    calls: list[ParsedToolCall] = []
    for d in d1 + d2:
        if d.name is not None:
            calls.append(ParsedToolCall(d.name, d.arguments))
        else:
            calls[d.index].arguments += d.arguments
    return c1 + c2, calls


# --- registry ---------------------------------------------------------------------------------

HERMES = ToolCallFormat(
    name="hermes", region="tagged", open_markers=("<tool_call>",),
    drop_markers=("</tool_call>", "<tool_response>", "</tool_response>"),
    close_marker="</tool_call>", description="<tool_call>{json}</tool_call> (Hermes, Qwen, SmolLM)")
LLAMA3 = ToolCallFormat(
    name="llama3", region="sequence", open_markers=("<|python_tag|>",), json_at_start=True,
    args_key="parameters", description='{"name": ..., "parameters": ...} (Llama 3.1+)')
MISTRAL = ToolCallFormat(
    name="mistral", region="mistral", open_markers=("[TOOL_CALLS]",), needs_special_tokens=True,
    description="[TOOL_CALLS] [{json}, ...] (Mistral)")

FORMATS: dict[str, ToolCallFormat] = {f.name: f for f in (HERMES, LLAMA3, MISTRAL)}
ALIASES = {"qwen": "hermes", "qwen25": "hermes", "smollm": "hermes", "llama": "llama3",
           "llama3_json": "llama3"}
PARSER_NAMES = tuple(FORMATS) + tuple(ALIASES)


def get_format(name: str) -> ToolCallFormat:
    key = ALIASES.get(name.lower(), name.lower())
    if key not in FORMATS:
        raise ValueError(f"unknown tool call parser {name!r}; known: {', '.join(PARSER_NAMES)}")
    return FORMATS[key]


def template_text(template) -> str:
    """A chat template as text (tokenizers may hold a dict of named templates)."""
    if isinstance(template, dict):
        return "\n".join(str(v) for v in template.values())
    if isinstance(template, (list, tuple)):  # [{"name": ..., "template": ...}]
        return "\n".join(str(t.get("template", "")) if isinstance(t, dict) else str(t)
                         for t in template)
    return template or ""


def detect_format(template) -> ToolCallFormat:
    """The format a chat template teaches its model; Hermes-style when it says nothing."""
    text = template_text(template)
    if "[TOOL_CALLS]" in text:
        return MISTRAL
    if "<tool_call>" in text:
        return HERMES
    if "<|python_tag|>" in text or ("<|start_header_id|>" in text and "parameters" in text):
        return LLAMA3
    return HERMES


def template_supports_tools(template) -> bool:
    """Whether the template renders `tools` itself (else radixlm renders them, see render.py)."""
    return bool(re.search(r"\btools\b", template_text(template)))
