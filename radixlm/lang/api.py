"""The public frontend API, shaped like SGLang's `sglang.lang.api`: `function`, `gen`, `select`,
roles, backends, `global_config`."""

from __future__ import annotations

from radixlm.lang.global_config import global_config
from radixlm.lang.primitives import (assistant, assistant_begin, assistant_end, gen, gen_int,
                                     gen_string, image, select, separate_reasoning, system,
                                     system_begin, system_end, user, user_begin, user_end, video)
from radixlm.lang.program import SglFunction, function
from radixlm.lang.resolve import as_backend

__all__ = ["SglFunction", "function", "gen", "gen_int", "gen_string", "select", "image", "video",
           "separate_reasoning", "system", "user", "assistant", "system_begin", "system_end",
           "user_begin", "user_end", "assistant_begin", "assistant_end", "set_default_backend",
           "get_default_backend", "flush_cache", "get_server_info", "global_config", "Runtime",
           "Engine"]


def set_default_backend(backend) -> None:
    global_config.default_backend = as_backend(backend) if backend is not None else None


def get_default_backend():
    return global_config.default_backend


def flush_cache(backend=None):
    """Flush the backend's prefix cache; with no backend given and no default: False (SGLang)."""
    backend = backend if backend is not None else global_config.default_backend
    if backend is None:
        return False
    return as_backend(backend).flush_cache()


def get_server_info(backend=None):
    """The server's info dict; with no backend given and no default: None (SGLang)."""
    backend = backend if backend is not None else global_config.default_backend
    if backend is None:
        return None
    return as_backend(backend).get_server_info()


def Runtime(*args, **kwargs):
    """Start a radixlm server subprocess and connect to it (radixlm.lang.backend.runtime)."""
    from radixlm.lang.backend.runtime import Runtime as _Runtime
    return _Runtime(*args, **kwargs)


def Engine(*args, **kwargs):
    """An in-process radixlm engine (radixlm.runtime.engine); usable as a frontend backend."""
    from radixlm.runtime.engine import Engine as _Engine
    return _Engine(*args, **kwargs)
