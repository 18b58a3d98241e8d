"""Process-wide frontend settings: `sgl.global_config`, with SGLang's names and meanings.

- `verbosity`: 0 prints nothing; 2 prints a program's final text after each `run`.
- `default_backend`: what `set_default_backend` sets and a program without `backend=` uses.
- `skip_special_tokens_in_output`, `spaces_between_special_tokens_in_out`: detokenization of
  every `gen` on a native backend (`RuntimeEndpoint`, `Runtime`, `Engine`): sent as the request's
  `skip_special_tokens` / `spaces_between_special_tokens`.
- `enable_precache_with_tracing`: `run_batch` (more than one run) first sends the program's
  constant prefix (found by tracing) so every run finds it in the cache.
- `enable_parallel_encoding`: SGLang's `join("concate_and_append")` asks a backend that declares
  `support_concate_and_append` to splice the branches' KV caches. No radixlm backend declares it
  (neither radixlm's server nor SGLang's own serves that route), so the branches' text is
  concatenated and appended whatever this says.
"""

from __future__ import annotations


class GlobalConfig:
    def __init__(self):
        self.verbosity = 0
        self.default_backend = None
        self.skip_special_tokens_in_output = True
        self.spaces_between_special_tokens_in_out = True
        self.enable_precache_with_tracing = True
        self.enable_parallel_encoding = True


global_config = GlobalConfig()

__all__ = ["GlobalConfig", "global_config"]
