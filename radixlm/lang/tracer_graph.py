"""A traced program's dataflow graph.

The graph (`TracedProgram`):
- nodes: `Node(id, kind, stream, name, text, attrs, expr)`. Kinds: `argument` (an input, no stream),
  `text`, `arg` (an argument appended), `gen`, `select`, `role_begin`, `role_end`,
  `var_scope_begin`, `var_scope_end`, `var` (a variable of the same state appended),
  `get_fork_var` (a variable of another state appended, e.g. `s += f["judgment"]`), `set_var`,
  `fork` (commit the shared prefix, then k branch streams), `join`, `commit`, `image`,
  `video`, `separate_reasoning` (re-produces its variable and `{name}_reasoning_content`).
- streams: stream 0 is the program's state; each fork branch is a stream whose text starts as a
  copy of its parent's at the fork node.
- edges: `Edge(src, dst, kind)`, dataflow: `seq` (a stream's text so far flows into its next node),
  `arg` (argument -> its use), `var` (producer of a variable -> its reader), `param` (an argument
  or variable used as a gen/select parameter), `fork` (fork node -> each branch's first node),
  `join` (each branch's last node -> the join). Every edge goes from a lower id to a higher one, so
  id order is a topological order.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Optional

from radixlm.lang import ir
from radixlm.lang.backend.base import BaseBackend
from radixlm.lang.interpreter import StreamExecutor
from radixlm.lang.tracer_placeholders import TracingError


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
        if k in ("image", "video"):
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
