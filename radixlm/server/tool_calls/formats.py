"""Tool-call formats by model family (what markup a model writes its calls in), the registry of
--tool-call-parser names, and the data the parser returns. The parser itself is in parsers.py.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional


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
