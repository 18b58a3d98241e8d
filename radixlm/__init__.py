"""radixlm: a fast serving system for LLM programs.

Heavy pieces (torch, the runtime) are imported lazily, so `import radixlm` stays cheap for
programs that only talk to a remote server.
"""

__version__ = "0.1.0"


def __getattr__(name):
    if name == "Engine":
        from radixlm.runtime.engine import Engine
        return Engine
    raise AttributeError(f"module 'radixlm' has no attribute {name!r}")
