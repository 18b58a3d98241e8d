"""Chat templates for the frontend's roles: the text each role's turn begins and ends with.

A program's text is built turn by turn (`with s.user(): ...`), so a template here is a pair of
strings per role rather than a Jinja program. The registry covers the common model families;
`chat_template_for_model(path)` picks one from a model's name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class ChatTemplate:
    name: str
    roles: dict  # role -> (prefix, suffix)
    default_system_prompt: Optional[str] = None
    begin: str = ""  # text before the first turn (e.g. a BOS string)
    stop_str: tuple = ()
    style: str = "plain"  # "plain": roles become text; "messages": API backends take messages
    image_token: str = "<image>"

    def prefix_and_suffix(self, role: str, history: list[dict]) -> tuple[str, str]:
        """The text a `role` turn begins and ends with, after the turns in `history`. (A template's
        default system prompt is a turn of its own: the interpreter inserts it, as SGLang does.)"""
        if role not in self.roles:
            raise ValueError(f"chat template {self.name!r} has no role {role!r}")
        prefix, suffix = self.roles[role]
        if not history:
            prefix = self.begin + prefix
        return prefix, suffix

    get_prefix_and_suffix = prefix_and_suffix  # SGLang's name

    @property
    def role_prefix_and_suffix(self) -> dict:  # SGLang's name
        return self.roles


_CHATML = {"system": ("<|im_start|>system\n", "<|im_end|>\n"),
           "user": ("<|im_start|>user\n", "<|im_end|>\n"),
           "assistant": ("<|im_start|>assistant\n", "<|im_end|>\n")}

TEMPLATES: dict[str, ChatTemplate] = {t.name: t for t in [
    ChatTemplate("default", {"system": ("SYSTEM:", "\n"), "user": ("USER:", "\n"),
                             "assistant": ("ASSISTANT:", "\n")}),
    ChatTemplate("chatml", _CHATML, stop_str=("<|im_end|>",)),
    ChatTemplate("smollm2", _CHATML, stop_str=("<|im_end|>",),
                 default_system_prompt="You are a helpful AI assistant named SmolLM, trained by Hugging Face"),
    ChatTemplate("qwen", _CHATML, stop_str=("<|im_end|>",),
                 default_system_prompt="You are a helpful assistant."),
    ChatTemplate("llama-3-instruct", {
        "system": ("<|start_header_id|>system<|end_header_id|>\n\n", "<|eot_id|>"),
        "user": ("<|start_header_id|>user<|end_header_id|>\n\n", "<|eot_id|>"),
        "assistant": ("<|start_header_id|>assistant<|end_header_id|>\n\n", "<|eot_id|>")},
        begin="<|begin_of_text|>", stop_str=("<|eot_id|>",)),
    ChatTemplate("llama-2-chat", {"system": ("<<SYS>>\n", "\n<</SYS>>\n\n"),
                                  "user": ("[INST] ", " [/INST]"), "assistant": (" ", " </s><s>")}),
    ChatTemplate("mistral", {"system": ("[SYSTEM_PROMPT] ", "[/SYSTEM_PROMPT]"),
                             "user": ("[INST] ", " [/INST]"), "assistant": (" ", "</s>")}),
    # API backends (OpenAI, Anthropic) receive messages, not text: no markup
    ChatTemplate("messages", {"system": ("", ""), "user": ("", ""), "assistant": ("", "")},
                 style="messages"),
]}

_BY_NAME = [("smollm", "smollm2"), ("qwen", "qwen"), ("llama-3", "llama-3-instruct"),
            ("llama3", "llama-3-instruct"), ("llama-2", "llama-2-chat"), ("mistral", "mistral"),
            ("chatml", "chatml"), ("hermes", "chatml")]


def get_chat_template(name: str) -> ChatTemplate:
    if name not in TEMPLATES:
        raise ValueError(f"unknown chat template {name!r} (known: {', '.join(TEMPLATES)})")
    return TEMPLATES[name]


def chat_template_for_model(model_path: str) -> ChatTemplate:
    low = (model_path or "").lower()
    for needle, name in _BY_NAME:
        if needle in low:
            return TEMPLATES[name]
    return TEMPLATES["default"]
