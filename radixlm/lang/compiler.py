"""Compiling: run a program from its traced graph instead of re-running its Python body.

`compile_program(f, backend)` traces `f` once (placeholders for every unbound argument) and returns
a `CompiledProgram`. Its `run(**kwargs)` executes the graph: each stream (the program's state and
every fork branch) runs its nodes in order on its own thread, with the arguments substituted; a
node that reads another stream's variable (or a join) waits for the node that produces it, so the
streams run in a topological order of the graph and independent branches run concurrently. Fork nodes commit
the shared prefix to the backend once before the branches start; `run_batch` caches the program's
constant prefix once before the batch. Each stream executes on the interpreter's own StreamExecutor
code, so a compiled run produces the same text, variables and messages as `f.run(...)`.

A program whose text or control flow depends on concrete argument values or on generated values
cannot be compiled: `compile_program` raises CompileError naming the value and the operation.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional, Union

from radixlm.lang import ir
from radixlm.lang.global_config import global_config
from radixlm.lang.interpreter import StreamExecutor
from radixlm.lang.resolve import as_backend, resolve_backend, split_run_kwargs
from radixlm.lang.state import ProgramState
from radixlm.lang.tracer import (TracedArgument, TracedProgram, TracingError, _Placeholder,
                                 trace_program)


class CompileError(RuntimeError):
    """The program cannot be compiled; the message says why."""


def compile_program(program, backend=None) -> "CompiledProgram":
    name = getattr(program, "__name__", "program")
    try:
        graph = trace_program(program, {}, backend)
    except TracingError as e:
        raise CompileError(f"cannot compile program {name!r}: {e}") from e
    except Exception as e:
        raise CompileError(f"cannot compile program {name!r}: tracing its body failed with "
                           f"{type(e).__name__}: {e}") from e
    return CompiledProgram(program, graph, backend)


class _Aborted(Exception):
    pass


class CompiledProgram:
    def __init__(self, program, graph: TracedProgram, backend=None):
        self.program = program
        self.graph = graph
        self.backend = backend
        func = getattr(program, "func", program)
        self._signature = inspect.signature(func)
        self.__name__ = graph.name

    # --- running ---------------------------------------------------------------------------------
    def _backend(self, backend):
        if backend is not None:
            return as_backend(backend)
        return self.backend if self.backend is not None else resolve_backend(None)

    def _arguments(self, args: tuple, kwargs: dict) -> dict:
        fixed = set(self.graph.concrete) & set(kwargs)
        if fixed:
            names = ", ".join(sorted(fixed))
            raise ValueError(f"{self.graph.name}: argument(s) {names} were fixed "
                             "when the program was compiled (bound or traced concretely); "
                             "compile again to change them")
        try:
            bound = self._signature.bind(None, *args, **{**self.graph.concrete, **kwargs})
        except TypeError as e:
            raise TypeError(f"{self.graph.name}(): {e}") from None
        bound.apply_defaults()
        out = dict(bound.arguments)
        out.pop(next(iter(self._signature.parameters)))
        for p in self._signature.parameters.values():  # flatten **kwargs like a call would
            if p.kind == p.VAR_KEYWORD and p.name in out:
                out.update(out.pop(p.name))
        return out

    def run(self, *args, backend=None, **kwargs) -> ProgramState:
        """Run once; returns a finished ProgramState (text(), [var], messages()) like f.run()."""
        if "stream" in kwargs and "stream" not in self._signature.parameters:
            raise NotImplementedError(f"{self.graph.name}: a compiled program does not stream; "
                                      "use f.run(stream=True) on the interpreter")
        defaults, kwargs = split_run_kwargs(dict(kwargs), self._signature.parameters)
        arguments = self._arguments(args, kwargs)
        return _GraphRun(self.graph, self._backend(backend), arguments, defaults).run()

    def run_batch(self, batch_kwargs: list[dict], *, backend=None,
                  num_threads: Union[str, int] = "auto", progress_bar: bool = False,
                  **run_kwargs) -> list[ProgramState]:
        """Run once per kwargs dict on a thread pool, after caching the constant prefix once."""
        if not isinstance(batch_kwargs, list) or not all(isinstance(k, dict) for k in batch_kwargs):
            raise TypeError("run_batch: batch_kwargs must be a list of dicts")
        if not batch_kwargs:
            return []
        backend = self._backend(backend)
        if global_config.enable_precache_with_tracing and len(batch_kwargs) > 1:
            prefix = self.graph.constant_prefix(backend)
            if prefix:
                backend.cache_prefix(prefix)
        if num_threads == "auto":
            num_threads = max(96, (os.cpu_count() or 1) * 16)
        num_threads = max(1, min(int(num_threads), len(batch_kwargs)))
        with ThreadPoolExecutor(num_threads) as pool:
            futures = [pool.submit(self.run, backend=backend, **{**run_kwargs, **kw})
                       for kw in batch_kwargs]
            if progress_bar:
                from concurrent.futures import as_completed
                from tqdm import tqdm
                for _ in tqdm(as_completed(futures), total=len(futures)):
                    pass
            return [f.result() for f in futures]

    def __call__(self, *args, **kwargs) -> ProgramState:
        return self.run(*args, **kwargs)

    def pretty(self) -> str:
        return self.graph.pretty()

    def __repr__(self):
        return f"<CompiledProgram {self.graph.name}: {len(self.graph.nodes)} nodes>"


class _GraphRun:
    """One execution of a graph: a thread per stream, an event per node."""

    def __init__(self, graph: TracedProgram, backend, arguments: dict,
                 defaults: ir.SamplingParams):
        self.graph = graph
        self.arguments = arguments
        self.done = [threading.Event() for _ in graph.nodes]
        self.values: dict[tuple[int, str], Any] = {}  # (producer node, variable) -> value
        self.executors: dict[int, StreamExecutor] = {}
        self.threads: list[threading.Thread] = []
        self.lock = threading.Lock()
        self.error: Optional[BaseException] = None
        # inputs from other streams each node must wait for
        self.waits: dict[int, list[int]] = {}
        for e in graph.edges:
            src = graph.nodes[e.src]
            other_stream = src.stream is not None and src.stream != graph.nodes[e.dst].stream
            if other_stream and e.kind != "fork":
                self.waits.setdefault(e.dst, []).append(e.src)
        self.main = StreamExecutor(backend, arguments, defaults, None, stream=False,
                                   use_thread=False)
        self.executors[0] = self.main

    def run(self) -> ProgramState:
        self._run_stream(0)
        while True:
            with self.lock:
                pending = [t for t in self.threads if t.is_alive()]
            if not pending:
                break
            for t in pending:
                t.join()
        if self.error is not None:
            raise self.error
        return ProgramState(self.main)

    # --- streams ----------------------------------------------------------------------------------
    def _run_stream(self, sid: int) -> None:
        ex = self.executors[sid]
        try:
            for nid in self.graph.streams[sid].nodes:
                for dep in self.waits.get(nid, ()):
                    self._wait(dep)
                if self.error is not None:
                    raise _Aborted()
                self._execute(self.graph.nodes[nid], ex)
                self.done[nid].set()
        except _Aborted:
            pass
        except BaseException as e:  # first error wins; wake every waiter
            with self.lock:
                if self.error is None:
                    self.error = e
            for ev in self.done:
                ev.set()

    def _start_stream(self, sid: int) -> None:
        t = threading.Thread(target=self._run_stream, args=(sid,), daemon=True,
                             name=f"sgl-compiled-{sid}")
        with self.lock:
            self.threads.append(t)
        t.start()

    def _wait(self, nid: int) -> None:
        self.done[nid].wait()
        if self.error is not None:
            raise _Aborted()

    # --- values ----------------------------------------------------------------------------------
    def _value(self, p: _Placeholder):
        if isinstance(p, TracedArgument):
            v = self.arguments[p.name]
        else:
            self._wait(p.producer)
            v = self.values[(p.producer, p.name)]
        for step in p.path:
            if step[0] == "item":
                v = v[step[1]]
            elif step[0] == "attr":
                v = getattr(v, step[1])
            else:
                v = v(*self._resolve(step[1]), **self._resolve(step[2]))
        return v

    def _resolve(self, x):
        if isinstance(x, _Placeholder):
            return self._value(x)
        if isinstance(x, list):
            return [self._resolve(v) for v in x]
        if isinstance(x, tuple):
            return tuple(self._resolve(v) for v in x)
        if isinstance(x, dict):
            return {k: self._resolve(v) for k, v in x.items()}
        if isinstance(x, ir.SamplingParams):
            return dataclasses.replace(x, **{f.name: self._resolve(getattr(x, f.name))
                                             for f in dataclasses.fields(x)})
        return x

    def _record(self, node, ex: StreamExecutor) -> None:
        if node.name is not None:
            self.values[(node.id, node.name)] = ex.variables.get(node.name)

    # --- nodes -----------------------------------------------------------------------------------
    def _execute(self, node, ex: StreamExecutor) -> None:
        k = node.kind
        if k in ("text", "role_begin", "role_end", "var_scope_begin", "commit", "image", "video"):
            ex.submit(node.expr)
        elif k == "separate_reasoning":
            ex.submit(node.expr)
            self._record(node, ex)
            name = node.expr.reasoning_name
            self.values[(node.id, name)] = ex.variables.get(name)
        elif k == "var_scope_end":
            ex.submit(node.expr)
            self._record(node, ex)
        elif k == "gen":
            e = node.expr
            ex.submit(ir.Gen(e.name, self._resolve(e.params)) if node.attrs["dynamic"] else e)
            if e.name:
                self._record(node, ex)
        elif k == "select":
            e = node.expr
            ex.submit(ir.Select(e.name, self._resolve(e.choices), self._resolve(e.temperature),
                                e.choices_method))
            if e.name:
                self._record(node, ex)
        elif k in ("arg", "var", "get_fork_var"):
            ex.submit(ir.as_expr(self._value(node.attrs["placeholder"])))
        elif k == "set_var":
            ex.set_var(node.name, self._resolve(node.attrs["value"]))
            self._record(node, ex)
        elif k == "fork":
            branches = ex.fork(node.attrs["size"])  # commits the shared prefix once
            for sid, bex in zip(node.attrs["branches"], branches):
                self.executors[sid] = bex
            for sid in node.attrs["branches"]:
                self._start_stream(sid)
        elif k == "join":
            self._join(node, ex)
        else:
            raise CompileError(f"{self.graph.name}: cannot execute a {k!r} node (n{node.id})")

    def _join(self, node, ex: StreamExecutor) -> None:
        # the join edges (each branch's last node at the time of the join) were waited for
        branches = [self.executors[sid] for sid in node.attrs["branches"]]
        if node.attrs["mode"] == "gather_variable":
            before = set(ex.variables)
            for b in branches:
                for name, value in b.variables.items():
                    if name not in before:
                        ex.variables.setdefault(name, []).append(value)
            for name in set(ex.variables) - before:
                ex.variable_events.setdefault(name, threading.Event()).set()
            for name in node.attrs.get("variables", ()):
                self.values[(node.id, name)] = ex.variables.get(name)
        else:
            ex.submit(ir.Text("".join(b.text_[b.fork_start_text_pos:] for b in branches)))
