"""Tracing: run a program's body once on placeholders and record its dataflow graph.

`trace_program` calls the @function body with a *tracing* state. Every argument the caller did not
give a value for becomes a `TracedArgument` placeholder; `s += ...` records nodes instead of
executing them; `s["x"]` returns a `TracedVariable` placeholder for the value the node that produces
`x` will have at run time. Placeholders can be appended (`s += q`, `s += "Q: " + q`), indexed
(`item["question"]`), and passed as gen/select parameters; anything that needs their concrete value
(str(), f-strings, len(), iteration, truth tests, comparisons, ...) raises `TracingError`, because
the program's text or control flow would then depend on a value tracing does not have.

The graph (`TracedProgram`):
- nodes: `Node(id, kind, stream, name, text, attrs, expr)`. Kinds: `argument` (an input, no stream),
  `text`, `arg` (an argument appended), `gen`, `select`, `role_begin`, `role_end`,
  `var_scope_begin`, `var_scope_end`, `var` (a variable of the same state appended),
  `get_fork_var` (a variable of another state appended, e.g. `s += f["judgment"]`), `set_var`,
  `fork` (commit the shared prefix, then k branch streams), `join`, `commit`, `image`.
- streams: stream 0 is the program's state; each fork branch is a stream whose text starts as a
  copy of its parent's at the fork node.
- edges: `Edge(src, dst, kind)`, dataflow: `seq` (a stream's text so far flows into its next node),
  `arg` (argument -> its use), `var` (producer of a variable -> its reader), `param` (an argument
  or variable used as a gen/select parameter), `fork` (fork node -> each branch's first node),
  `join` (each branch's last node -> the join). Every edge goes from a lower id to a higher one, so
  id order is a topological order.

`extract_prefix_by_tracing` gives the constant text every run begins with (run_batch caches it
once).
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Optional

from radixlm.lang import ir
from radixlm.lang.state import ProgramState, ProgramStateGroup

logger = logging.getLogger(__name__)


class TracingError(RuntimeError):
    """The program does something tracing cannot follow (see the message for what and why)."""

    def __init__(self, message: str, placeholder: Optional["_Placeholder"] = None,
                 operation: Optional[str] = None):
        super().__init__(message)
        self.placeholder = placeholder
        self.operation = operation


# --- placeholders ---------------------------------------------------------------------------------
def _consume(op: str):
    def method(self, *args, **kwargs):
        raise self._error(op)
    method.__name__ = f"_consume_{op}"
    return method


class _Placeholder(ir.Expr):
    """A value tracing does not have. Appending it is fine; converting it to a concrete value is
    not.

    `path` records item/attribute access and calls made on it (`item["q"]`, `q.strip()`), replayed
    on the real value at run time.
    """

    def __init__(self, tracer: "_Tracer", name: str, path: tuple = ()):
        object.__setattr__(self, "_tracer", tracer)
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "path", path)

    # derived placeholders
    def _derive(self, step) -> "_Placeholder":
        raise NotImplementedError

    def __getitem__(self, key):
        if isinstance(key, _Placeholder):
            raise key._error("use as an index")
        return self._derive(("item", key))

    def __getattr__(self, attr):
        if attr.startswith("_"):
            raise AttributeError(attr)
        return self._derive(("attr", attr))

    def __call__(self, *args, **kwargs):
        return self._derive(("call", args, kwargs))

    def __setattr__(self, key, value):
        raise self._error("attribute assignment")

    @property
    def display(self) -> str:
        out = self.name
        for step in self.path:
            if step[0] == "item":
                out += f"[{step[1]!r}]"
            elif step[0] == "attr":
                out += f".{step[1]}"
            else:
                out += "(...)"
        return out

    def _error(self, op: str) -> TracingError:
        raise NotImplementedError

    # concrete conversions: each is a point where the program's text or control flow would depend
    # on the value
    __str__ = _consume("str() or %-formatting")
    __format__ = _consume("an f-string or str.format()")
    __bytes__ = _consume("bytes()")
    __len__ = _consume("len()")
    __iter__ = _consume("iteration (a for loop, list(), unpacking or str.join())")
    __reversed__ = _consume("reversed()")
    __contains__ = _consume("an `in` test")
    __bool__ = _consume("a truth test (if / while / and / or / not)")
    __eq__ = _consume("a comparison (==)")
    __ne__ = _consume("a comparison (!=)")
    __lt__ = _consume("a comparison (<)")
    __le__ = _consume("a comparison (<=)")
    __gt__ = _consume("a comparison (>)")
    __ge__ = _consume("a comparison (>=)")
    __int__ = _consume("int()")
    __float__ = _consume("float()")
    __complex__ = _consume("complex()")
    __index__ = _consume("use as an integer index")
    __round__ = _consume("round()")
    __mul__ = __rmul__ = _consume("multiplication")
    __mod__ = __rmod__ = _consume("%-formatting")
    __sub__ = __rsub__ = _consume("subtraction")
    __truediv__ = __rtruediv__ = _consume("division")
    __floordiv__ = __rfloordiv__ = _consume("division")
    __pow__ = __rpow__ = _consume("exponentiation")
    __neg__ = __pos__ = __abs__ = _consume("arithmetic")
    __hash__ = object.__hash__


class TracedArgument(_Placeholder):
    """The placeholder for a program argument (named after the parameter)."""

    def _derive(self, step):
        return TracedArgument(self._tracer, self.name, self.path + (step,))

    def _error(self, op: str) -> TracingError:
        t = self._tracer
        err = TracingError(
            f"tracing program {t.program_name!r}: argument {self.display!r} is converted to a "
            f"concrete value by {op}, so the program's text depends on it in a way tracing cannot "
            "follow (tracing runs the body with placeholders, not real values). Append the "
            f"argument as an expression instead: `s += \"...\" + {self.name}` or a separate "
            f"`s += {self.name}`; or give it a fixed value (f.trace({self.name}=...) or "
            f"f.bind({self.name}=...)).", self, op)
        t.note_error(err)
        return err

    def __repr__(self):
        return f"TracedArgument({self.display})"


class TracedVariable(_Placeholder):
    """What `s["x"]` returns while tracing: the value node `producer` gives x at run time."""

    def __init__(self, tracer, name, producer: int, reader_stream: int, path: tuple = ()):
        super().__init__(tracer, name, path)
        object.__setattr__(self, "producer", producer)
        object.__setattr__(self, "reader_stream", reader_stream)

    def _derive(self, step):
        return TracedVariable(self._tracer, self.name, self.producer, self.reader_stream,
                              self.path + (step,))

    def _error(self, op: str) -> TracingError:
        t = self._tracer
        err = TracingError(
            f"tracing program {t.program_name!r}: the generated variable {self.display!r} (node "
            f"n{self.producer}) is used as a concrete Python value by {op}, e.g. control flow on "
            "the model's output or formatting it into a string. Its value exists only at run "
            "time, so the program's text and control flow cannot be traced. Append it as an "
            f"expression instead (`s += s[{self.name!r}]`), or run the program with the "
            "interpreter (f.run / f.run_batch) instead.", self, op)
        t.note_error(err)
        return err

    def __repr__(self):
        return f"TracedVariable({self.display} <- n{self.producer})"


def placeholders_in(x) -> list[_Placeholder]:
    """Every placeholder inside x (lists, tuples, dicts, SamplingParams, call arguments)."""
    out: list[_Placeholder] = []

    def walk(v):
        if isinstance(v, _Placeholder):
            out.append(v)
            for step in v.path:
                if step[0] == "call":
                    walk(step[1])
                    walk(step[2])
        elif isinstance(v, (list, tuple)):
            for item in v:
                walk(item)
        elif isinstance(v, dict):
            for item in v.values():
                walk(item)
        elif isinstance(v, ir.SamplingParams):
            for f in dataclasses.fields(v):
                walk(getattr(v, f.name))

    walk(x)
    return out


# --- the graph ------------------------------------------------------------------------------------
@dataclass(eq=False)
class Node:
    id: int
    kind: str
    stream: Optional[int]  # None for argument nodes
    name: Optional[str] = None  # variable, argument or role name
    text: Optional[str] = None  # constant text of a `text` node
    attrs: dict = field(default_factory=dict)
    expr: Any = None  # the ir expression (with placeholders) the compiler executes

    def label(self) -> str:
        k = self.kind
        if k == "text":
            t = self.text if len(self.text) <= 60 else self.text[:57] + "..."
            return repr(t)
        if k in ("arg", "var", "get_fork_var"):
            return self.attrs["placeholder"].display
        if k == "gen":
            p = self.attrs["params"]
            shown = {f.name: getattr(p, f.name) for f in dataclasses.fields(p)
                     if getattr(p, f.name) is not None}
            return " ".join([self.name or "(unnamed)"] + [f"{a}={v!r}" for a, v in shown.items()])
        if k == "select":
            return f"{self.name or '(unnamed)'} choices={self.attrs['choices']!r}"
        if k == "fork":
            return f"x{self.attrs['size']} -> streams {', '.join(map(str, self.attrs['branches']))}"
        if k == "join":
            extra = f" vars={self.attrs['variables']}" if self.attrs.get("variables") else ""
            branches = ", ".join(map(str, self.attrs["branches"]))
            return f"{self.attrs['mode']} streams {branches}{extra}"
        if k == "set_var":
            return f"{self.name} = {self.attrs['value']!r}"
        if k == "image":
            return repr(self.attrs["path"])
        return self.name or ""


class Edge(NamedTuple):
    src: int
    dst: int
    kind: str  # seq | arg | var | param | fork | join


@dataclass
class Stream:
    id: int
    parent: Optional[int] = None  # the stream it forked from
    fork_node: Optional[int] = None
    branch: Optional[int] = None  # index among the fork's branches
    nodes: list = field(default_factory=list)  # node ids in execution order


class TracedProgram:
    """A program's dataflow graph. `nodes[i].id == i`; see the module docstring for the format."""

    def __init__(self, name: str, parameters: list[str], arguments: dict, concrete: dict,
                 nodes: list, edges: list, streams: list, variables: dict):
        self.name = name
        self.parameters = parameters  # the program's parameters (after the state)
        self.arguments = arguments  # placeholder argument name -> its `argument` node id
        self.concrete = concrete  # arguments traced with a concrete value
        self.nodes: list[Node] = nodes
        self.edges: list[Edge] = edges
        self.streams: list[Stream] = streams
        self.variables: dict[str, list[int]] = variables  # name -> producing node ids

    def node(self, i: int) -> Node:
        return self.nodes[i]

    def stream_nodes(self, stream: int = 0) -> list[Node]:
        return [self.nodes[i] for i in self.streams[stream].nodes]

    def nodes_of(self, kind: str) -> list[Node]:
        return [n for n in self.nodes if n.kind == kind]

    def edges_into(self, i: int, kind: Optional[str] = None) -> list[Edge]:
        return [e for e in self.edges if e.dst == i and (kind is None or e.kind == kind)]

    def edges_from(self, i: int, kind: Optional[str] = None) -> list[Edge]:
        return [e for e in self.edges if e.src == i and (kind is None or e.kind == kind)]

    def topological_order(self) -> list[int]:
        """Node ids, every node after all its inputs (Kahn's algorithm, lowest id first)."""
        import heapq
        indeg = [0] * len(self.nodes)
        out: dict[int, list[int]] = {}
        for e in self.edges:
            indeg[e.dst] += 1
            out.setdefault(e.src, []).append(e.dst)
        ready = [i for i, d in enumerate(indeg) if d == 0]
        heapq.heapify(ready)
        order = []
        while ready:
            i = heapq.heappop(ready)
            order.append(i)
            for j in out.get(i, ()):
                indeg[j] -= 1
                if indeg[j] == 0:
                    heapq.heappush(ready, j)
        if len(order) != len(self.nodes):
            raise TracingError(f"the graph of {self.name!r} has a cycle")
        return order

    def constant_prefix(self, backend=None) -> str:
        """The text every run of the program begins with: stream 0's leading constant nodes,
        executed by the interpreter's own code (so role markup matches a real run exactly)."""
        from radixlm.lang.backend.base import BaseBackend
        from radixlm.lang.interpreter import StreamExecutor

        ex = StreamExecutor(backend if backend is not None else BaseBackend(), {},
                            ir.SamplingParams(), None, use_thread=False)
        for n in self.stream_nodes(0):
            if n.kind in ("text", "role_begin", "role_end", "var_scope_begin", "var_scope_end"):
                ex.submit(n.expr)
            elif n.kind in ("fork", "commit", "set_var") or (
                    n.kind == "join" and n.attrs["mode"] == "gather_variable"):
                continue  # no text of stream 0 changes
            else:
                break
        return ex.text_

    def pretty(self) -> str:
        params = ", ".join(self.parameters)
        lines = [f"TracedProgram {self.name}({params}): {len(self.nodes)} nodes, "
                 f"{len(self.streams)} stream(s)"]
        if self.concrete:
            lines.append("concrete arguments: " + ", ".join(
                f"{k}={v!r}" for k, v in self.concrete.items()))
        if self.arguments:
            lines.append("arguments:")
            for name, i in self.arguments.items():
                lines.append(f"  n{i:<3} argument      {name}")
        for st in self.streams:
            head = "main" if st.parent is None else (
                f"branch {st.branch} of fork n{st.fork_node} in stream {st.parent}")
            lines.append(f"stream {st.id} ({head}):")
            for n in self.stream_nodes(st.id):
                ins = [f"n{e.src} {e.kind}" for e in self.edges_into(n.id)
                       if e.kind not in ("seq", "fork")]
                tail = f"  <- {', '.join(ins)}" if ins else ""
                lines.append(f"  n{n.id:<3} {n.kind:<13} {n.label()}{tail}")
        if self.variables:
            lines.append("variables: " + ", ".join(
                f"{k} <- {', '.join(f'n{i}' for i in v)}" for k, v in self.variables.items()))
        return "\n".join(lines)

    __str__ = pretty

    def __repr__(self):
        return (f"<TracedProgram {self.name}: {len(self.nodes)} nodes, {len(self.edges)} edges, "
                f"{len(self.streams)} streams>")


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

