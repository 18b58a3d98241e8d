"""The server package's structure: no import cycle among radixlm.server's modules (imports inside
functions count too, so launch.py's lazy imports of the child processes are checked), and no
module over 400 lines."""

from __future__ import annotations

import ast
import pathlib

import radixlm.server

SERVER = pathlib.Path(radixlm.server.__file__).parent
ROOT = SERVER.parent.parent


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: pathlib.Path, known: set[str]) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        out.update(n for n in names if n in known)
    return out


def cycle_in(graph: dict[str, set[str]]):
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                return stack[stack.index(n):] + [n]
            if n not in state and (found := visit(n)):
                return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_cycle_finder():
    assert cycle_in({"a": {"b"}, "b": {"a"}}) == ["a", "b", "a"]
    assert cycle_in({"a": {"b"}, "b": set()}) is None


def test_no_import_cycle_in_server():
    mods = {module_name(p): p for p in SERVER.rglob("*.py")}
    graph = {m: imports_of(p, set(mods)) - {m} for m, p in mods.items()}
    assert cycle_in(graph) is None, " -> ".join(cycle_in(graph))
    # the child processes never import the launcher
    for child in ("radixlm.server.scheduler_process", "radixlm.server.detokenizer_process"):
        assert "radixlm.server.launch" not in graph[child]


def test_no_server_module_over_400_lines():
    long = {module_name(p): n for p in SERVER.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 400}
    assert not long, long
