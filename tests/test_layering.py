"""The rooms' order (issue 53): each top-level package imports only the rooms below it, and no two modules import
each other at module level, directly or around a circle. Read from the source with ``ast``; nothing is imported."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# lowest first: the CPU runtime, preprocessing, the embedding cache, the encoder, the language engine, what
# makes models (checkpoint makers, the demo model's training), the API
ROOMS = ["runtime", "preprocess", "cache", "encoder", "lm_engine", "tools", "api"]


def _modules() -> dict[str, Path]:
    out = {}
    for room in ROOMS:
        for path in (ROOT / room).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(path: Path, top_level_only: bool, modules: dict[str, Path]) -> list[str]:
    """The project modules ``path`` imports: ``from a.b import c`` imports the module a.b.c where there is one (a
    package's submodule is run without the package's own imports waiting on it), else a.b."""
    tree = ast.parse(path.read_text(), str(path))
    nodes = tree.body if top_level_only else ast.walk(tree)
    names = []
    for node in nodes:
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            subs = [f"{node.module}.{a.name}" for a in node.names]
            names += [s for s in subs if s in modules] or [node.module]
    return [n for n in names if n.split(".")[0] in ROOMS]


def test_no_room_imports_a_room_above_it():
    modules = _modules()
    upward = [
        f"{module} imports {name}"
        for module, path in modules.items()
        for name in _imports(path, False, modules)
        if ROOMS.index(name.split(".")[0]) > ROOMS.index(module.split(".")[0])
    ]
    assert upward == []


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circles_at_module_level():
    modules = _modules()
    graph = {
        module: {name for name in _imports(path, True, modules) if name in modules and name != module}
        for module, path in modules.items()
    }
    assert _cycles(graph) == []


def test_the_circle_finder_finds_a_circle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
