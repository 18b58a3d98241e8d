"""The frontend package's structure: no import cycle among radixlm.lang's modules (imports inside
functions count too), and no module over 400 lines."""

from __future__ import annotations

import ast
import pathlib

import radixlm.lang

LANG = pathlib.Path(radixlm.lang.__file__).parent
PREFIX = "radixlm.lang"


def module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(LANG.parent.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def lang_modules() -> dict[str, pathlib.Path]:
    return {module_name(p): p for p in LANG.rglob("*.py")}


def imports_of(path: pathlib.Path, known: set[str]) -> set[str]:
    """The radixlm.lang modules `path` imports anywhere in its body."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from radixlm.lang import ir` imports the module radixlm.lang.ir
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            if name.startswith(PREFIX) and name in known:
                out.add(name)
    return out


def find_cycle(graph: dict[str, set[str]]):
    """A list of modules forming a cycle, or None."""
    state: dict[str, int] = {}  # 1: on the DFS stack, 2: done
    stack: list[str] = []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                return stack[stack.index(n):] + [n]
            if n not in state:
                found = visit(n)
                if found:
                    return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return None


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_no_import_cycle_in_lang():
    mods = lang_modules()
    known = set(mods)
    graph = {}
    for name, path in mods.items():
        deps = imports_of(path, known) - {name}
        # importing a package's submodule runs the package's __init__ (empty here), not a cycle
        graph[name] = {d for d in deps if not name.startswith(d + ".")}
    assert "radixlm.lang.api" in graph and graph["radixlm.lang.api"]
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_lang_files_are_at_most_400_lines():
    long = {str(p.relative_to(LANG)): n for p in LANG.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 400}
    assert not long, f"split these along their seams: {long}"
