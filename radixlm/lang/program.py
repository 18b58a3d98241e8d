"""SglFunction: what `@sgl.function` makes of a program body, with SGLang's methods (`run`,
`run_batch`, `bind`, `trace`, `cache`) and radixlm's `compile`."""

from __future__ import annotations

import inspect
import os
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import Callable, Optional, Union

from radixlm.lang.compiler import compile_program
from radixlm.lang.global_config import global_config
from radixlm.lang.interpreter import run_program
from radixlm.lang.resolve import as_backend, resolve_backend, split_run_kwargs
from radixlm.lang.state import ProgramState
from radixlm.lang.tracer import extract_prefix_by_tracing, trace_program


class SglFunction:
    def __init__(self, func: Callable, num_api_spec_tokens: Optional[int] = None,
                 bind_arguments: Optional[dict] = None):
        self.func = func
        self.num_api_spec_tokens = num_api_spec_tokens
        self.bind_arguments = dict(bind_arguments or {})
        self.__name__ = getattr(func, "__name__", "program")
        self.__doc__ = getattr(func, "__doc__", None)
        spec = inspect.getfullargspec(func)
        self.arg_names = spec.args[1:]  # SGLang's: the parameters after the state
        self.arg_defaults = list(spec.defaults or [])
        self._own = set(spec.args[1:]) | set(spec.kwonlyargs)

    def bind(self, **kwargs) -> "SglFunction":
        return SglFunction(self.func, self.num_api_spec_tokens, {**self.bind_arguments, **kwargs})

    def run(self, *args, stream: bool = False, backend=None, use_thread: bool = True, **kwargs):
        defaults, kwargs = split_run_kwargs(dict(kwargs), self._own)
        return run_program(self.func, resolve_backend(backend), args,
                           {**self.bind_arguments, **kwargs}, defaults, stream, use_thread)

    def _as_kwargs(self, batch: list) -> list[dict]:
        """run_batch's items: dicts of arguments, or (as in SGLang) lists/tuples of positional
        arguments."""
        out = []
        required = len(self.arg_names) - len(self.arg_defaults)
        for item in batch:
            if isinstance(item, dict):
                out.append(item)
            elif isinstance(item, (list, tuple)) and required <= len(item) <= len(self.arg_names):
                out.append(dict(zip(self.arg_names, item)))
            else:
                raise TypeError(f"run_batch: {item!r} does not match {self.__name__}'s "
                                f"parameters {self.arg_names}")
        return out

    def run_batch(self, batch_kwargs: list, *, backend=None,
                  num_threads: Union[str, int] = "auto", progress_bar: bool = False,
                  generator_style: bool = False, **run_kwargs):
        """Run the program once per item on a thread pool. With more than one item (and
        global_config.enable_precache_with_tracing), the program's constant prefix, found by
        tracing, is sent once first so every run hits the cache."""
        if not isinstance(batch_kwargs, (list, tuple)):
            raise TypeError("run_batch: batch_kwargs must be a list of dicts")
        batch = self._as_kwargs(list(batch_kwargs))
        backend = resolve_backend(backend)
        if not batch:
            return []
        if global_config.enable_precache_with_tracing and len(batch) > 1:
            self.cache(backend)
        if num_threads == "auto":
            num_threads = max(96, (os.cpu_count() or 1) * 16)
        num_threads = max(1, min(int(num_threads), len(batch)))

        def one(kw):
            return self.run(backend=backend, **{**run_kwargs, **kw})

        pool = ThreadPoolExecutor(num_threads)
        futures = [pool.submit(one, kw) for kw in batch]
        if generator_style:
            def gen_results():
                try:
                    for f in futures:
                        yield f.result()
                finally:
                    pool.shutdown(wait=False)
            return gen_results()
        try:
            if progress_bar:
                from tqdm import tqdm
                for _ in tqdm(as_completed(futures), total=len(futures)):
                    pass
            return [f.result() for f in futures]
        finally:
            pool.shutdown(wait=True)

    def cache(self, backend=None) -> None:
        """Send the program's constant prefix (found by tracing) to the backend's cache."""
        backend = resolve_backend(backend)
        prefix = extract_prefix_by_tracing(self, backend)
        if prefix:
            backend.cache_prefix(prefix)

    def trace(self, *, backend=None, **kwargs):
        b = backend if backend is not None else global_config.default_backend
        return trace_program(self, kwargs, as_backend(b) if b is not None else None)

    def compile(self, *, backend=None):
        # no backend given: the default is looked up when the compiled program runs
        return compile_program(self, as_backend(backend) if backend else None)

    def __call__(self, *args, **kwargs):
        """`other(s, ...)` inside a program runs other's body on state s; otherwise it is run()."""
        if args and isinstance(args[0], ProgramState):
            return self.func(args[0], *args[1:], **{**self.bind_arguments, **kwargs})
        return self.run(*args, **kwargs)


def function(func: Optional[Callable] = None, num_api_spec_tokens: Optional[int] = None):
    """Decorator: `@function def prog(s, ...): s += ...`."""
    if func is None:
        return lambda f: SglFunction(f, num_api_spec_tokens)
    return SglFunction(func, num_api_spec_tokens)
