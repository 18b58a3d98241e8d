"""Tracing: run a program's body once on placeholders and record its dataflow graph.

`trace_program` calls the @function body with a *tracing* state. Every argument the caller did not
give a value for becomes a `TracedArgument` placeholder; `s += ...` records nodes instead of
executing them; `s["x"]` returns a `TracedVariable` placeholder for the value the node that produces
`x` will have at run time. Placeholders can be appended (`s += q`, `s += "Q: " + q`), indexed
(`item["question"]`), and passed as gen/select parameters; anything that needs their concrete value
(str(), f-strings, len(), iteration, truth tests, comparisons, ...) raises `TracingError`, because
the program's text or control flow would then depend on a value tracing does not have.

The graph format is described in radixlm.lang.tracer_graph.

`extract_prefix_by_tracing` gives the constant text every run begins with (run_batch caches it
once).
"""

from __future__ import annotations

import inspect
import logging
from typing import Any, Optional

from radixlm.lang import ir
from radixlm.lang.state import ProgramState, ProgramStateGroup
from radixlm.lang.tracer_graph import Edge, Node, Stream, TracedProgram
from radixlm.lang.tracer_placeholders import (TracedArgument, TracedVariable, TracingError,
                                              _Placeholder, placeholders_in)

__all__ = ["Edge", "Node", "Stream", "TracedArgument", "TracedProgram", "TracedVariable",
           "TracingError", "TracingState", "TracingStateGroup", "extract_prefix_by_tracing",
           "placeholders_in", "program_parameters", "trace_program"]

logger = logging.getLogger(__name__)


# --- recording ------------------------------------------------------------------------------------
class _Tracer:
    def __init__(self, program_name: str):
        self.program_name = program_name
        self.nodes: list[Node] = []
        self.edges: list[Edge] = []
        self.streams: list[Stream] = []
        self.arguments: dict[str, int] = {}
        self.variables: dict[str, list[int]] = {}
        self.first_error: Optional[TracingError] = None
        self._edge_set: set = set()

    def note_error(self, err: TracingError) -> None:
        if self.first_error is None:
            self.first_error = err

    def new_stream(self, parent=None, fork_node=None, branch=None) -> Stream:
        st = Stream(len(self.streams), parent, fork_node, branch)
        self.streams.append(st)
        return st

    def add_node(self, kind: str, stream: Optional[int], **kw) -> Node:
        n = Node(len(self.nodes), kind, stream, **kw)
        self.nodes.append(n)
        if stream is not None:
            st = self.streams[stream]
            if st.nodes:
                self.add_edge(st.nodes[-1], n.id, "seq")
            elif st.fork_node is not None:
                self.add_edge(st.fork_node, n.id, "fork")
            st.nodes.append(n.id)
        return n

    def add_edge(self, src: int, dst: int, kind: str) -> None:
        e = Edge(src, dst, kind)
        if e not in self._edge_set:
            self._edge_set.add(e)
            self.edges.append(e)

    def source_of(self, p: _Placeholder) -> int:
        if isinstance(p, TracedArgument):
            return self.arguments[p.name]
        return p.producer

    def declare(self, name: str, node: Node) -> None:
        self.variables.setdefault(name, []).append(node.id)

    def result(self, parameters, concrete) -> TracedProgram:
        return TracedProgram(self.program_name, parameters, self.arguments, concrete, self.nodes,
                             self.edges, self.streams, self.variables)


class _TracingExecutor:
    """Stands where a StreamExecutor stands under a ProgramState, recording instead of executing."""

    stream = False
    error_ = None

    def __init__(self, tracer: _Tracer, stream: Stream, variables: Optional[dict] = None,
                 concrete_vars: Optional[dict] = None):
        self.tracer = tracer
        self.stream_id = stream.id
        self.variables: dict[str, int] = dict(variables or {})  # name -> producer node id
        self.concrete_vars: dict[str, Any] = dict(concrete_vars or {})  # set_var with a plain value
        self.variable_events: dict = {}  # ProgramState.var_scope touches it
        self.arguments = {}

    # what ProgramState reads but tracing cannot give
    def _no(self, what: str):
        err = TracingError(f"tracing program {self.tracer.program_name!r}: the program reads "
                           f"{what} while tracing; the text exists only at run time")
        self.tracer.note_error(err)
        raise err

    @property
    def text_(self):
        self._no("s.text()")

    @property
    def messages_(self):
        self._no("s.messages()")

    @property
    def meta_info(self):
        self._no("meta info")

    def sync(self) -> None:
        pass

    def end(self) -> None:
        pass

    # --- recording -------------------------------------------------------------------------------
    def submit(self, expr: ir.Expr) -> None:
        for e in ir.flatten(expr):
            self._record(e)

    def _add(self, kind: str, expr=None, **kw) -> Node:
        return self.tracer.add_node(kind, self.stream_id, expr=expr, **kw)

    def _param_edges(self, node: Node, x) -> None:
        for p in placeholders_in(x):
            self.tracer.add_edge(self.tracer.source_of(p), node.id, "param")

    def _record(self, e: ir.Expr) -> None:
        t = self.tracer
        if isinstance(e, ir.Text):
            self._add("text", e, text=e.value)
        elif isinstance(e, TracedArgument):
            n = self._add("arg", e, name=e.name, attrs={"placeholder": e})
            t.add_edge(t.arguments[e.name], n.id, "arg")
            self._param_edges(n, [s[1:] for s in e.path if s[0] == "call"])
        elif isinstance(e, TracedVariable):
            kind = "var" if e.reader_stream == self.stream_id else "get_fork_var"
            n = self._add(kind, e, name=e.name, attrs={"placeholder": e})
            t.add_edge(e.producer, n.id, "var")
            self._param_edges(n, [s[1:] for s in e.path if s[0] == "call"])
        elif isinstance(e, ir.Gen):
            n = self._add("gen", e, name=e.name,
                          attrs={"params": e.params, "dynamic": bool(placeholders_in(e.params))})
            self._param_edges(n, e.params)
            if e.name:
                self._produce(e.name, n)
        elif isinstance(e, ir.Select):
            n = self._add("select", e, name=e.name, attrs={"choices": e.choices})
            self._param_edges(n, [e.choices, e.temperature])
            if e.name:
                self._produce(e.name, n)
        elif isinstance(e, ir.RoleBegin):
            self._add("role_begin", e, name=e.role)
        elif isinstance(e, ir.RoleEnd):
            self._add("role_end", e, name=e.role)
        elif isinstance(e, ir.VarScopeBegin):
            self._add("var_scope_begin", e, name=e.name)
        elif isinstance(e, ir.VarScopeEnd):
            self._produce(e.name, self._add("var_scope_end", e, name=e.name))
        elif isinstance(e, ir.CommitLazy):
            self._add("commit", e)
        elif isinstance(e, ir.Image):
            self._add("image", e, attrs={"path": e.path})
        elif isinstance(e, ir.Video):
            self._add("video", e, attrs={"path": e.path})
        elif isinstance(e, ir.SeparateReasoning):
            n = self._add("separate_reasoning", e, name=e.name,
                          attrs={"model_type": e.model_type})
            if e.name in self.variables:
                t.add_edge(self.variables[e.name], n.id, "var")
            self._produce(e.name, n)
            self._produce(e.reasoning_name, n)
        elif isinstance(e, ir.GetForkVariable) and isinstance(e.state, _TracingExecutor):
            self._record(e.state.get_var(e.name))
        elif isinstance(e, ir.FuncCall):
            result = e.fn(TracingState(self))
            if result is not None:
                self.submit(ir.as_expr(result))
        else:
            err = TracingError(f"tracing program {t.program_name!r}: cannot trace the expression "
                               f"{type(e).__name__}")
            t.note_error(err)
            raise err

    def _produce(self, name: str, node: Node) -> None:
        self.variables[name] = node.id
        self.concrete_vars.pop(name, None)
        self.tracer.declare(name, node)

    def get_var(self, name: str):
        if name in self.concrete_vars:
            return self.concrete_vars[name]
        if name not in self.variables:
            err = TracingError(f"tracing program {self.tracer.program_name!r}: the program reads "
                               f"variable {name!r} before anything defines it")
            self.tracer.note_error(err)
            raise err
        return TracedVariable(self.tracer, name, self.variables[name], self.stream_id)

    def set_var(self, name: str, value) -> None:
        n = self._add("set_var", None, name=name, attrs={"value": value})
        self._param_edges(n, value)
        self._produce(name, n)
        if not placeholders_in(value):
            self.concrete_vars[name] = value

    def fork(self, size: int) -> list["_TracingExecutor"]:
        t = self.tracer
        node = self._add("fork", ir.CommitLazy(), attrs={"size": size, "branches": []})
        out = []
        for i in range(size):
            st = t.new_stream(parent=self.stream_id, fork_node=node.id, branch=i)
            node.attrs["branches"].append(st.id)
            out.append(_TracingExecutor(t, st, self.variables, self.concrete_vars))
        return out

    def last_node(self) -> Optional[int]:
        nodes = self.tracer.streams[self.stream_id].nodes
        return nodes[-1] if nodes else None


class TracingState(ProgramState):
    """The `s` a program body sees while it is traced."""

    def fork(self, size: int = 1, position_ids_offset=None) -> "TracingStateGroup":
        if isinstance(size, _Placeholder):
            raise size._error("fork(size)")
        if size < 1:
            raise ValueError(f"fork: size must be >= 1 (got {size})")
        return TracingStateGroup([TracingState(ex) for ex in self.stream_executor.fork(size)], self)

    def get_meta_info(self, name: str):
        self.stream_executor._no(f"the meta info of {name!r}")

    @property
    def variables(self):
        self.stream_executor._no("s.variables")

    def text_iter(self, var_name=None):
        self.stream_executor._no("s.text_iter()")

    def error(self):
        return None

    def __repr__(self):
        return f"TracingState(stream {self.stream_executor.stream_id})"


class TracingStateGroup(ProgramStateGroup):
    def join(self, mode: str = "gather_variable"):
        if mode not in ("gather_variable", "concate_and_append"):
            raise ValueError(f"join: unknown mode {mode!r} (gather_variable, concate_and_append)")
        src: _TracingExecutor = self.src_state.stream_executor
        branches = [s.stream_executor for s in self.states]
        node = src._add("join", None, attrs={"mode": mode,
                                             "branches": [b.stream_id for b in branches]})
        for b in branches:
            last = b.last_node()
            if last is not None:
                src.tracer.add_edge(last, node.id, "join")
        if mode == "gather_variable":
            gathered = []
            for b in branches:
                for name, producer in b.variables.items():
                    if name not in src.variables and name not in gathered:
                        gathered.append(name)
            node.attrs["variables"] = gathered
            for name in gathered:
                src._produce(name, node)


# --- entry points ---------------------------------------------------------------------------------
def _program_parts(program):
    func = getattr(program, "func", program)
    bound = dict(getattr(program, "bind_arguments", {}) or {})
    name = getattr(program, "__name__", None) or getattr(func, "__name__", "program")
    return func, bound, name


def program_parameters(func) -> list[inspect.Parameter]:
    """The parameters after the state, without *args / **kwargs."""
    params = list(inspect.signature(func).parameters.values())[1:]
    return [p for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def trace_program(program, kwargs: Optional[dict] = None, backend=None) -> TracedProgram:
    """Trace `program` (a @function or a plain function of (s, ...)): arguments in `kwargs` or bound
    with `f.bind(...)` keep their values; every other parameter becomes a TracedArgument."""
    func, bound, name = _program_parts(program)
    given = {**bound, **(kwargs or {})}
    params = program_parameters(func)
    tracer = _Tracer(name)
    main = _TracingExecutor(tracer, tracer.new_stream())
    call_kwargs, concrete = {}, {}
    for p in params:
        if p.name in given:
            call_kwargs[p.name] = concrete[p.name] = given[p.name]
        else:
            tracer.arguments[p.name] = tracer.add_node("argument", None, name=p.name).id
            call_kwargs[p.name] = TracedArgument(tracer, p.name)
    unknown = set(given) - {p.name for p in params}
    if unknown and not any(p.kind == p.VAR_KEYWORD
                           for p in inspect.signature(func).parameters.values()):
        raise TypeError(f"trace: {name}() has no parameter(s) {', '.join(sorted(unknown))}")
    for k in unknown:
        call_kwargs[k] = concrete[k] = given[k]
    state = TracingState(main)
    try:
        func(state, **call_kwargs)
    except TracingError:
        raise
    except TypeError as e:
        if tracer.first_error is not None:
            raise tracer.first_error from e
        if "Traced" in str(e):  # e.g. "".join([arg]): a str method that needs a real str
            raise TracingError(f"tracing program {name!r}: a placeholder reached Python code that "
                               f"needs a concrete value ({e}). Append arguments and variables as "
                               "expressions (`s += \"...\" + arg`) instead.") from e
        raise
    except Exception as e:
        if tracer.first_error is not None:  # the program caught ours and failed differently
            raise tracer.first_error from e
        raise
    if tracer.first_error is not None:  # the program swallowed a TracingError
        raise tracer.first_error
    return tracer.result([p.name for p in params], concrete)


def extract_prefix_by_tracing(program, backend) -> Optional[str]:
    """The constant text every run of `program` begins with, or None (never raises)."""
    try:
        prefix = trace_program(program, {}, backend).constant_prefix(backend)
    except Exception as e:  # tracing is an optimization: never break run_batch
        logger.debug("no constant prefix for %s: %s", getattr(program, "__name__", program), e)
        return None
    return prefix or None
