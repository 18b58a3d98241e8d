"""radixlm: a fast serving system for LLM programs.

The frontend language (SGLang-compatible: `import radixlm as sgl`) is imported eagerly and is
light; the runtime (torch) and the API backends (openai, anthropic SDKs) load on first use.
"""

from radixlm.lang.api import (SglFunction, assistant, assistant_begin, assistant_end,
                              flush_cache, function, gen, gen_int, gen_string, get_server_info,
                              global_config, image, select, separate_reasoning,
                              set_default_backend, system, system_begin, system_end, user,
                              user_begin, user_end, video)
from radixlm.lang.choices import (greedy_token_selection, token_length_normalized,
                                  unconditional_likelihood_normalized)

__version__ = "0.1.0"

_LAZY = {
    "Engine": ("radixlm.runtime.engine", "Engine"),
    "RuntimeEndpoint": ("radixlm.lang.backend.runtime_endpoint", "RuntimeEndpoint"),
    "Runtime": ("radixlm.lang.backend.runtime", "Runtime"),
    "OpenAI": ("radixlm.lang.backend.openai", "OpenAI"),
    "Anthropic": ("radixlm.lang.backend.anthropic", "Anthropic"),
    "LiteLLM": ("radixlm.lang.backend.litellm", "LiteLLM"),
    "VertexAI": ("radixlm.lang.backend.vertexai", "VertexAI"),
    "Gemini": ("radixlm.lang.backend.vertexai", "Gemini"),
}


def __getattr__(name):
    if name in _LAZY:
        import importlib
        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'radixlm' has no attribute {name!r}")
