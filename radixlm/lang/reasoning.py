"""Splitting a reasoning model's output into reasoning and answer, for `sgl.separate_reasoning`.

Model types are SGLang's `--reasoning-parser` names. A *forced* format (DeepSeek-R1 and kin)
reasons from the first token whether or not it writes the start tag; the others reason only
inside an explicit start tag. Reasoning cut off before its end tag is all reasoning.
"""

from __future__ import annotations

from typing import NamedTuple, Optional


class ReasoningFormat(NamedTuple):
    start: str
    end: str
    forced: bool


_THINK = ("<think>", "</think>")
FORMATS: dict[str, ReasoningFormat] = {
    **{name: ReasoningFormat(*_THINK, forced=True)
       for name in ("deepseek-r1", "step3", "step3p5", "gigachat35", "qwen3-thinking",
                    "minimax")},
    **{name: ReasoningFormat(*_THINK, forced=False)
       for name in ("qwen3", "glm45", "nanbeige", "interns1", "dots")},
    "kimi": ReasoningFormat("◁think▷", "◁/think▷", forced=False),
    "mistral": ReasoningFormat("[THINK]", "[/THINK]", forced=False),
}


def check_model_type(model_type: Optional[str]) -> None:
    if (model_type or "").lower() not in FORMATS:
        raise ValueError(f"separate_reasoning: unsupported model_type {model_type!r} "
                         f"(supported: {', '.join(sorted(FORMATS))})")


def split_reasoning(text: str, model_type: Optional[str]) -> tuple[str, str]:
    """(reasoning, answer) of a complete output."""
    check_model_type(model_type)
    fmt = FORMATS[model_type.lower()]
    if not fmt.forced and fmt.start not in text:
        return "", text
    body = text
    while body.startswith(fmt.start):
        body = body[len(fmt.start):]
    if fmt.end not in body:
        return body, ""
    reasoning, answer = body.split(fmt.end, 1)
    return reasoning, answer
