"""No import circle among the modules of radixlm/ and of benchmarks/.

Every import counts, lazy ones inside functions too (a lazy import hides a circle from Python but
not from the reader: the two modules still depend on each other), except under
`if TYPE_CHECKING:`. `from pkg import name` is an edge to the submodule `pkg.name` when there is
one, else to `pkg`. A package's own `__init__` running before its submodules is not counted as an
edge (Python does that for every submodule, circle or not).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("radixlm", "benchmarks")


def module_files() -> dict[str, Path]:
    out = {}
    for path in sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if any(part.startswith(".") for part in parts):  # no module: a venv (peers/.venv-vllm)
            continue
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(body: list[ast.stmt]):
    """Every import statement in `body`, at any depth (functions and methods too: a lazy import
    still ties the two modules together), except under `if TYPE_CHECKING:`."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            yield from _imports(node.orelse)
        else:
            for field in ("body", "orelse", "finalbody", "handlers", "cases"):
                for child in getattr(node, field, None) or []:
                    if isinstance(child, (ast.ExceptHandler, ast.match_case)):
                        yield from _imports(child.body)
                    elif isinstance(child, ast.stmt):
                        yield from _imports([child])


def import_graph() -> dict[str, set[str]]:
    files = module_files()
    graph: dict[str, set[str]] = {name: set() for name in files}
    for name, path in files.items():
        is_pkg = path.name == "__init__.py"
        for node in _imports(ast.parse(path.read_text(), str(path)).body):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                if node.level:  # relative: from the package holding this module
                    base = name.split(".")
                    base = base[:len(base) - node.level + (1 if is_pkg else 0)]
                    mod = ".".join(base + ([node.module] if node.module else []))
                else:
                    mod = node.module or ""
                targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in files else mod
                           for a in node.names]
            for target in targets:
                while target and target not in files:  # `import a.b.attr` style: the module part
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_graph_sees_the_package():
    graph = import_graph()
    assert "radixlm.lang" in graph and "radixlm.server" in graph
    assert "benchmarks.gpu_suite" in graph
    assert any(graph.values()), "no import edge found: the parser is broken"


def test_no_import_cycles():
    graph = import_graph()
    found = cycles(graph)
    detail = ["  " + " <-> ".join(c) + "\n    " + "\n    ".join(
        f"{a} imports {', '.join(sorted(graph[a] & set(c)))}" for a in c) for c in found]
    assert not found, "import circles (move the shared piece down or invert the dependency):\n" + "\n".join(detail)
