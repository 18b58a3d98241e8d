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
    is_chat_model = False
    # SGLang's flag for backends that splice fork branches' KV caches on
    # join("concate_and_append"); none of radixlm's do (the branches' text is appended instead)
    support_concate_and_append = False

    def get_model_name(self) -> str:
        raise UnsupportedPrimitive(self, "get_model_name")

    def get_chat_template(self) -> ChatTemplate:
        return self.chat_template

    def cache_prefix(self, prefix: str) -> None:
        """Warm the cache with a prefix (run_batch does this with the program's constant prefix)."""

    # SGLang's life-cycle hooks; nothing to do for a backend that keeps no per-program state
    def begin_program(self, s) -> None:
        pass

    def end_program(self, s) -> None:
        pass

    def end_request(self, rid) -> None:
        pass

    def uncache_prefix(self, rid: str) -> None:
        pass

    def fork_program(self, src, dst, position_ids_offset=None) -> None:
        pass

    def fill_image(self, s) -> None:
        pass

    def concatenate_and_append(self, src_rids, dst_rid) -> None:
        raise UnsupportedPrimitive(self, "concatenate_and_append", "join(\"concate_and_append\") "
                                   "appends the branches' text instead")

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
