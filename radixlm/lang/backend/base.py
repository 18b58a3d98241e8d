"""The backend contract of the frontend language.

A backend turns a program state's text (or chat messages) into generations. Every method receives
the StreamExecutor `s` (its `text_`, `messages_`, `chat_template`). A backend that cannot do a
primitive raises `UnsupportedPrimitive` naming it; the interpreter reports it to the program.
"""

from __future__ import annotations

from typing import Iterator, Optional

from radixlm.lang.chat_template import ChatTemplate, get_chat_template
from radixlm.lang.choices import ChoicesDecision
from radixlm.lang.ir import SamplingParams


class UnsupportedPrimitive(NotImplementedError):
    def __init__(self, backend, primitive: str, why: str = ""):
        super().__init__(f"the {type(backend).__name__} backend does not support {primitive}"
                         + (f": {why}" if why else ""))


class BaseBackend:
    chat_template: ChatTemplate = get_chat_template("default")

    def get_model_name(self) -> str:
        raise UnsupportedPrimitive(self, "get_model_name")

    def get_chat_template(self) -> ChatTemplate:
        return self.chat_template

    def cache_prefix(self, prefix: str) -> None:
        """Warm the cache with a prefix (run_batch does this with the program's constant prefix)."""

    def commit_lazy_operations(self, s) -> None:
        """Make the backend compute s.text_ now (fork calls it so branches share the prefix)."""

    def generate(self, s, params: SamplingParams) -> tuple[str, Optional[dict]]:
        raise UnsupportedPrimitive(self, "gen")

    def generate_stream(self, s, params: SamplingParams) -> Iterator[tuple[str, Optional[dict]]]:
        text, meta = self.generate(s, params)
        yield text, meta

    def select(self, s, choices: list[str], temperature: float, choices_method) -> ChoicesDecision:
        raise UnsupportedPrimitive(self, "select")

    def flush_cache(self) -> None:
        raise UnsupportedPrimitive(self, "flush_cache")

    def get_server_info(self) -> dict:
        raise UnsupportedPrimitive(self, "get_server_info")

    def shutdown(self) -> None:
        """Release resources (servers started by the backend, clients)."""
