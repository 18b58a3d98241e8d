"""Which backend a program runs on, and which `run()` keywords are sampling defaults.

Shared by the interpreter's entry points (`SglFunction`) and compiled programs; imports no other
entry point, so neither needs the other.
"""

from __future__ import annotations

from typing import Collection

from radixlm.lang import ir
from radixlm.lang.global_config import global_config

# run(...) keywords that set every gen's default sampling parameters (SGLang's list, plus ours)
RUN_PARAMS = ("max_new_tokens", "min_new_tokens", "n", "stop", "stop_token_ids", "stop_regex",
              "temperature", "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty",
              "ignore_eos", "return_logprob", "logprob_start_len", "top_logprobs_num",
              "return_text_in_logprobs")


def as_backend(backend):
    """A frontend backend: SGLang's `Runtime` objects are used through their `.endpoint`; an
    in-process radixlm.Engine is wrapped (once) into EngineBackend."""
    if type(backend).__name__ == "Engine" and type(backend).__module__ == "radixlm.runtime.engine":
        wrapper = getattr(backend, "_frontend_backend", None)
        if wrapper is None:
            from radixlm.lang.backend.engine import EngineBackend
            wrapper = backend._frontend_backend = EngineBackend(backend)
        return wrapper
    endpoint = getattr(backend, "endpoint", None)
    return endpoint if endpoint is not None else backend


def resolve_backend(backend=None):
    """`backend` if given, else the default one (set_default_backend / global_config)."""
    b = backend if backend is not None else global_config.default_backend
    if b is None:
        raise RuntimeError("no backend: pass backend=... or call set_default_backend(...)")
    return as_backend(b)


def split_run_kwargs(kwargs: dict, own: Collection[str] = ()) -> tuple[ir.SamplingParams, dict]:
    """(default sampling parameters, the program's own arguments) of run()'s keywords. A name the
    program declares as a parameter of its own (`own`) stays the program's."""
    run = {k: kwargs.pop(k) for k in list(kwargs) if k in RUN_PARAMS and k not in own}
    return ir.SamplingParams(**run), kwargs
