"""The public frontend API, shaped like SGLang's: `function`, `gen`, `select`, roles, backends."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Optional, Union

from radixlm.lang import ir
from radixlm.lang.interpreter import run_program

_default_backend = None


def as_backend(backend):
    """A frontend backend; an in-process radixlm.Engine is wrapped (once) into EngineBackend."""
    if type(backend).__name__ == "Engine" and type(backend).__module__ == "radixlm.runtime.engine":
        wrapper = getattr(backend, "_frontend_backend", None)
        if wrapper is None:
            from radixlm.lang.backend.engine import EngineBackend
            wrapper = backend._frontend_backend = EngineBackend(backend)
        return wrapper
    return backend


def set_default_backend(backend) -> None:
    global _default_backend
    _default_backend = as_backend(backend)


def get_default_backend():
    return _default_backend


def _backend(backend):
    b = as_backend(backend) if backend is not None else _default_backend
    if b is None:
        raise RuntimeError("no backend: pass backend=... or call set_default_backend(...)")
    return b


def flush_cache(backend=None) -> None:
    _backend(backend).flush_cache()


def get_server_info(backend=None) -> dict:
    return _backend(backend).get_server_info()


# --- expressions --------------------------------------------------------------------------------
def gen(name: Optional[str] = None, max_tokens: Optional[int] = None,
        min_tokens: Optional[int] = None, n: Optional[int] = None,
        stop: Union[None, str, list[str]] = None, stop_token_ids: Optional[list[int]] = None,
        temperature: Optional[float] = None, top_p: Optional[float] = None,
        top_k: Optional[int] = None, min_p: Optional[float] = None,
        frequency_penalty: Optional[float] = None, presence_penalty: Optional[float] = None,
        ignore_eos: Optional[bool] = None, return_logprob: Optional[bool] = None,
        logprob_start_len: Optional[int] = None, top_logprobs_num: Optional[int] = None,
        return_text_in_logprobs: Optional[bool] = None, dtype: Any = None,
        choices: Optional[list[str]] = None, choices_method=None,
        regex: Optional[str] = None, json_schema: Optional[str] = None) -> ir.Expr:
    """Generate text into variable `name`; `choices=[...]` makes it a select."""
    if choices is not None:
        return ir.Select(name, list(choices), temperature or 0.0, choices_method)
    if sum(x is not None for x in (regex, json_schema, dtype)) > 1:
        raise ValueError("gen: at most one of regex, json_schema, dtype")
    if dtype is not None:
        ir.dtype_regex(dtype)  # validate now, in the caller's frame
    params = ir.SamplingParams(
        max_new_tokens=max_tokens, min_new_tokens=min_tokens, n=n, stop=stop,
        stop_token_ids=stop_token_ids, temperature=temperature, top_p=top_p, top_k=top_k,
        min_p=min_p, frequency_penalty=frequency_penalty, presence_penalty=presence_penalty,
        ignore_eos=ignore_eos, return_logprob=return_logprob, logprob_start_len=logprob_start_len,
        top_logprobs_num=top_logprobs_num, return_text_in_logprobs=return_text_in_logprobs,
        json_schema=json_schema, regex=regex, dtype=dtype)
    return ir.Gen(name, params)


def gen_int(name: Optional[str] = None, **kwargs) -> ir.Expr:
    return gen(name, dtype=int, **kwargs)


def gen_string(name: Optional[str] = None, **kwargs) -> ir.Expr:
    return gen(name, dtype=str, **kwargs)


def select(name: Optional[str] = None, choices: Optional[list[str]] = None,
           temperature: float = 0.0, choices_method=None) -> ir.Expr:
    if not choices:
        raise ValueError("select: choices must be a non-empty list of strings")
    return ir.Select(name, list(choices), temperature, choices_method)


def image(path: str) -> ir.Expr:
    return ir.Image(path)


def _role(role: str, expr=None) -> ir.Expr:
    if expr is None:
        return ir.ExprList([ir.RoleBegin(role), ir.RoleEnd(role)])
    return ir.RoleBegin(role) + expr + ir.RoleEnd(role)


def system(expr=None):
    return _role("system", expr)


def user(expr=None):
    return _role("user", expr)


def assistant(expr=None):
    return _role("assistant", expr)


def system_begin():
    return ir.RoleBegin("system")


def system_end():
    return ir.RoleEnd("system")


def user_begin():
    return ir.RoleBegin("user")


def user_end():
    return ir.RoleEnd("user")


def assistant_begin():
    return ir.RoleBegin("assistant")


def assistant_end():
    return ir.RoleEnd("assistant")


# --- programs -----------------------------------------------------------------------------------
_RUN_PARAMS = ("max_new_tokens", "stop", "stop_token_ids", "temperature", "top_p", "top_k",
               "min_p", "frequency_penalty", "presence_penalty", "ignore_eos", "return_logprob",
               "logprob_start_len", "top_logprobs_num", "return_text_in_logprobs")


class SglFunction:
    def __init__(self, func: Callable, num_api_spec_tokens: Optional[int] = None,
                 bind_arguments: Optional[dict] = None):
        self.func = func
        self.num_api_spec_tokens = num_api_spec_tokens
        self.bind_arguments = dict(bind_arguments or {})
        self.__name__ = getattr(func, "__name__", "program")
        self.__doc__ = getattr(func, "__doc__", None)

    def bind(self, **kwargs) -> "SglFunction":
        return SglFunction(self.func, self.num_api_spec_tokens, {**self.bind_arguments, **kwargs})

    @staticmethod
    def _split_run_kwargs(kwargs: dict) -> tuple[ir.SamplingParams, dict]:
        run = {k: kwargs.pop(k) for k in list(kwargs) if k in _RUN_PARAMS}
        return ir.SamplingParams(**run), kwargs

    def run(self, *args, stream: bool = False, backend=None, use_thread: bool = True, **kwargs):
        defaults, kwargs = self._split_run_kwargs(dict(kwargs))
        return run_program(self.func, _backend(backend), args, {**self.bind_arguments, **kwargs},
                           defaults, stream, use_thread)

    def run_batch(self, batch_kwargs: list[dict], *, backend=None,
                  num_threads: Union[str, int] = "auto", progress_bar: bool = False,
                  generator_style: bool = False, **run_kwargs):
        """Run the program once per kwargs dict on a thread pool; the program's constant prefix
        (found by tracing) is sent once first so every run hits the cache."""
        if not isinstance(batch_kwargs, list) or not all(isinstance(k, dict) for k in batch_kwargs):
            raise TypeError("run_batch: batch_kwargs must be a list of dicts")
        backend = _backend(backend)
        if not batch_kwargs:
            return []
        from radixlm.lang.tracer import extract_prefix_by_tracing
        prefix = extract_prefix_by_tracing(self, backend)
        if prefix:
            backend.cache_prefix(prefix)
        if num_threads == "auto":
            num_threads = max(96, (os.cpu_count() or 1) * 16)
        num_threads = max(1, min(int(num_threads), len(batch_kwargs)))

        def one(kw):
            return self.run(backend=backend, **{**run_kwargs, **kw})

        pool = ThreadPoolExecutor(num_threads)
        futures = [pool.submit(one, kw) for kw in batch_kwargs]
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
                from concurrent.futures import as_completed
                from tqdm import tqdm
                for _ in tqdm(as_completed(futures), total=len(futures)):
                    pass
            return [f.result() for f in futures]
        finally:
            pool.shutdown(wait=True)

    def trace(self, *, backend=None, **kwargs):
        from radixlm.lang.tracer import trace_program
        return trace_program(self, kwargs, as_backend(backend) if backend else _default_backend)

    def compile(self, *, backend=None):
        from radixlm.lang.compiler import compile_program
        # no backend given: the default is looked up when the compiled program runs
        return compile_program(self, as_backend(backend) if backend else None)

    def __call__(self, *args, **kwargs):
        """`other(s, ...)` inside a program runs other's body on state s; otherwise it is run()."""
        from radixlm.lang.state import ProgramState
        if args and isinstance(args[0], ProgramState):
            return self.func(args[0], *args[1:], **{**self.bind_arguments, **kwargs})
        return self.run(*args, **kwargs)


def function(func: Optional[Callable] = None, num_api_spec_tokens: Optional[int] = None):
    """Decorator: `@function def prog(s, ...): s += ...`."""
    if func is None:
        return lambda f: SglFunction(f, num_api_spec_tokens)
    return SglFunction(func, num_api_spec_tokens)
