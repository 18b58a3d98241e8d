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

import re
from typing import Optional

from radixlm.server.tool_calls.formats import (ALIASES, FORMATS, HERMES, LLAMA3, MISTRAL,
                                               PARSER_NAMES, ParsedToolCall, ToolCallDelta,
                                               ToolCallFormat, detect_format, get_format,
                                               template_supports_tools, template_text)
from radixlm.server.tool_calls.json_scan import _WS, _CallObject, _Marker

__all__ = ["ALIASES", "FORMATS", "HERMES", "LLAMA3", "MISTRAL", "PARSER_NAMES", "ParsedToolCall",
           "StreamingToolParser", "ToolCallDelta", "ToolCallFormat", "detect_format",
           "get_format", "parse_tool_calls", "template_supports_tools", "template_text"]

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
