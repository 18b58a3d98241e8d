"""--reasoning-parser: split a `<think>` model's output into reasoning and answer (SGLang's
`separate_reasoning` -> `reasoning_content` in the OpenAI chat response, streamed too).

The formats are SGLang's think-tag family: reasoning sits between a start and an end tag. With
`force` the chat template already opened the tag, so the output starts inside the reasoning
(DeepSeek-R1 writes no `<think>` itself); otherwise reasoning begins only at a start tag. A
response cut off before the end tag is all reasoning, as in SGLang.

Streaming never leaks part of a tag: text that could still become a tag is held back until it
is ruled out (or the stream ends).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ReasoningFormat:
    start: str
    end: str
    force: bool  # the output begins inside the reasoning block


_THINK, _END = "<think>", "</think>"
FORMATS: dict[str, ReasoningFormat] = {
    "deepseek-r1": ReasoningFormat(_THINK, _END, True),
    "deepseek-v3": ReasoningFormat(_THINK, _END, False),
    "qwen3": ReasoningFormat(_THINK, _END, False),
    "qwen3-thinking": ReasoningFormat(_THINK, _END, True),
    "glm45": ReasoningFormat(_THINK, _END, False),
    "dots": ReasoningFormat(_THINK, _END, False),
    "nanbeige": ReasoningFormat(_THINK, _END, False),
    "interns1": ReasoningFormat(_THINK, _END, False),
    "minimax": ReasoningFormat(_THINK, _END, True),
    "step3": ReasoningFormat(_THINK, _END, True),
    "step3p5": ReasoningFormat(_THINK, _END, True),
    "gigachat35": ReasoningFormat(_THINK, _END, True),
    "kimi": ReasoningFormat("\u25c1think\u25b7", "\u25c1/think\u25b7", False),
}
PARSER_NAMES = tuple(FORMATS)


def get_format(name: str) -> ReasoningFormat:
    fmt = FORMATS.get(name.lower())
    if fmt is None:
        raise ValueError(f"--reasoning-parser {name!r} is not supported "
                         f"(supported: {', '.join(PARSER_NAMES)})")
    return fmt


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ReasoningParser:
    """One response's parser. `parse(text)` for a whole text; `feed(delta)` then `finish()` for
    a stream. Both return (reasoning, content)."""

    def __init__(self, fmt: ReasoningFormat, stream_reasoning: bool = True):
        self.fmt = fmt
        self.stream_reasoning = stream_reasoning
        self.in_reasoning = fmt.force
        self.done = False  # the end tag was seen (or no block opened): the rest is content
        self.opened = False  # past the point where a start tag could appear
        self.buf = ""  # held-back text (a possible tag, or reasoning when not streamed)

    def parse(self, text: str) -> tuple[str, str]:
        f = self.fmt
        stripped = text.lstrip()
        if not f.force and not stripped.startswith(f.start):
            return "", text
        if stripped.startswith(f.start):
            stripped = stripped[len(f.start):]
        if f.end not in stripped:
            return stripped, ""
        reasoning, content = stripped.split(f.end, 1)
        return reasoning, content

    def feed(self, delta: str) -> tuple[str, str]:
        if self.done:
            return "", delta
        f = self.fmt
        buf = self.buf + delta
        if not self.opened:
            # Only a start tag at the very beginning opens a block (a forced block is already
            # open; the model may still repeat the tag, which is dropped).
            head = buf.lstrip()
            if head.startswith(f.start):
                self.opened, self.in_reasoning, buf = True, True, head[len(f.start):]
            elif f.start.startswith(head):  # could still become the start tag
                self.buf = buf
                return "", ""
            elif not self.in_reasoning:
                self.done, self.buf = True, ""
                return "", buf
            else:
                self.opened = True
        if f.end in buf:
            reasoning, content = buf.split(f.end, 1)
            self.done, self.in_reasoning, self.buf = True, False, ""
            return reasoning, content
        if not self.stream_reasoning:
            self.buf = buf
            return "", ""
        keep = _partial_suffix(buf, f.end)
        self.buf = buf[len(buf) - keep:]
        return buf[: len(buf) - keep], ""

    def finish(self) -> tuple[str, str]:
        """End of stream: held text is reasoning inside an open block, else content."""
        out, self.buf = self.buf, ""
        if self.done:
            return "", out
        if self.in_reasoning:
            return out, ""
        return "", out
