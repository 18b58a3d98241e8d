"""Chat templates rendered the way transformers' `apply_chat_template` renders them, without
importing transformers (~1 s of start-up; see tokenizer_light.py).

What must match transformers 5 (`utils/chat_template_utils.py`, `render_jinja_template`) so
that a prompt is byte-identical whichever tokenizer class rendered it:
  - the environment: an ImmutableSandboxedEnvironment with trim_blocks + lstrip_blocks and the
    loopcontrols extension (Hub templates are untrusted code: the sandbox stays on);
  - the globals templates call: `raise_exception` (a TemplateError, which the server turns into
    a 400), `strftime_now`, a `dict` constructor and a `namespace` that refuse dunder tricks;
  - `tojson` replaced: jinja's escapes HTML (`<` -> `\\u003c`) and takes no indent/separators;
  - the inputs: message keys whose value is None dropped, everything rebuilt from plain JSON
    types, reasoning copied under the names templates read, special tokens as variables.
What it does not do (`{% generation %}` blocks, continue_final_message, callable tools) the
caller hands to transformers instead (tokenizer_light.py decides).
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
from collections.abc import Mapping
from datetime import datetime
from functools import lru_cache
from typing import Any, Optional

# Templates with this tag need transformers' AssistantTracker extension (assistant token masks).
GENERATION_TAG = re.compile(r"\{\%-?\s*generation\s*-?\%\}")

# Names a message's reasoning is passed under; templates read the first (transformers' order).
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


@lru_cache(maxsize=16)
def compile_template(template: str):
    """The compiled template (cached: a server renders the same one for every request)."""
    import jinja2
    import jinja2.ext
    import jinja2.utils
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(format):
        return datetime.now().strftime(format)

    class TemplateDict:  # `dict(...)` without handing the template the dict type itself
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):  # no underscore attributes (CPython internals)
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check_name(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"Chat templates cannot store underscore-prefixed attributes on a namespace, "
                    f"but got {name!r}. Please rename the attribute.")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["dict"] = TemplateDict()
    env.globals["namespace"] = TemplateNamespace
    return env.from_string(template)


def plain_data(value: Any) -> Any:
    """`value` rebuilt from plain JSON types (what the sandbox sees); anything else becomes an
    inert "<TypeName>" placeholder. transformers' `_plain_template_data`, case for case."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {plain_data(k): plain_data(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain_data(v) for v in value]
    if isinstance(value, tuple):
        return tuple(plain_data(v) for v in value)
    np = sys.modules.get("numpy")  # a numpy scalar implies numpy is imported already
    if np is not None and isinstance(value, np.generic):
        return plain_data(value.item())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain_data(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):  # pydantic
        return plain_data(value.model_dump())
    return f"<{type(value).__name__}>"


def _alias_reasoning_fields(chat: list) -> list:
    out = []
    for message in chat:
        if isinstance(message, dict):
            reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None),
                             None)
            if reasoning is not None:
                message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def split_conversations(conversation) -> tuple[list, bool]:
    """(conversations, is_batched), None-valued message keys dropped, as apply_chat_template."""
    if isinstance(conversation, (list, tuple)) and len(conversation) == 0:
        raise ValueError("Cannot apply chat template to an empty conversation. "
                         "Provide at least one message.")
    batched = isinstance(conversation, (list, tuple)) and (
        isinstance(conversation[0], (list, tuple)) or hasattr(conversation[0], "messages"))
    convs = conversation if batched else [conversation]
    return [[{k: v for k, v in m.items() if v is not None} for m in c] for c in convs], batched


def render(template: str, conversations: list, tools: Optional[list], documents: Optional[list],
           add_generation_prompt: bool, **kwargs) -> list[str]:
    """One rendered string per conversation. `tools` must be JSON-schema dicts already."""
    compiled = compile_template(template)
    if documents is not None:
        for document in documents:
            if not isinstance(document, dict):
                raise TypeError("Documents should be a list of dicts with 'title' and 'text' keys!")
    tools, documents, kwargs = plain_data(tools), plain_data(documents), plain_data(kwargs)
    rendered = []
    for chat in conversations:
        if hasattr(chat, "messages"):
            chat = chat.messages
        chat = plain_data(chat)
        for message in chat:
            if not isinstance(message, dict):
                raise TypeError(f"Chat messages should be dicts, dataclasses or pydantic models, "
                                f"but got {message!r}.")
        rendered.append(compiled.render(messages=_alias_reasoning_fields(chat), tools=tools,
                                        documents=documents,
                                        add_generation_prompt=add_generation_prompt, **kwargs))
    return rendered
