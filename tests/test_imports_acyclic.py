"""No import cycle among the library's modules, counting every import: module level, inside functions
and under ``TYPE_CHECKING``.

A function-level import hides a cycle from Python (the import runs after both modules have loaded)
but not from a reader: two modules that import each other are one unit split over two files, and
the next module-level import between them fails at import time. The graph is built from the source
with ``ast``, so it sees imports that a run would not reach.

Edges, precisely: ``from .pkg import x`` goes to the submodule ``pkg.x`` when one exists, else to
``pkg`` itself (its ``__init__``, where the name ``x`` is defined); ``import a.b`` and
``from a.b import name`` go to ``a.b``. A package's ``__init__`` running before its submodule is
Python's loading order, not an import the code wrote, so it is no edge.
"""
from __future__ import annotations

import ast
from pathlib import Path

import dobb

SRC = Path(dobb.__file__).resolve().parent


def module_files(root: Path = SRC) -> dict[str, Path]:
    """Dotted name -> file of every module under ``root`` (a package by its ``__init__.py``)."""
    out = {}
    for f in sorted(root.rglob("*.py")):
        parts = list(f.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = f
    return out


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The library modules ``name`` imports anywhere in its file."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in modules)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                if node.level - 1 > len(parts) - 1:
                    raise AssertionError(f"{path}: relative import beyond the top package")
                base = ".".join(parts[:len(parts) - (node.level - 1)] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            for alias in node.names:
                if f"{base}.{alias.name}" in modules:
                    found.add(f"{base}.{alias.name}")
                elif base in modules:
                    found.add(base)
    found.discard(name)
    return found


def import_graph(root: Path = SRC) -> dict[str, set[str]]:
    modules = module_files(root)
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as ``[a, b, ..., a]``, or None (iterative depth-first search)."""
    state: dict[str, int] = {}  # 1 on the current path, 2 done
    for start in sorted(graph):
        if state.get(start):
            continue
        path, stack = [start], [iter(sorted(graph[start]))]
        state[start] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif not state.get(nxt):
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph[nxt])))
    return None


def test_the_library_has_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_graph_sees_function_level_and_relative_imports(tmp_path):
    """The check can fail: a cycle closed by an import inside a function, through ``from . import``."""
    pkg = tmp_path / "lib"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from .b import B\n")
    (pkg / "a.py").write_text("from .sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from .. import a\nB = 1\n")
    (pkg / "c.py").write_text("from .sub import B\n")  # a name of sub's __init__: an edge to lib.sub
    graph = import_graph(pkg)
    assert graph["lib.a"] == {"lib.sub.b"} and graph["lib.c"] == {"lib.sub"} and graph["lib.sub.b"] == {"lib.a"}
    assert find_cycle(graph) in (["lib.a", "lib.sub.b", "lib.a"], ["lib.sub.b", "lib.a", "lib.sub.b"])
    (pkg / "sub" / "b.py").write_text("B = 1\n")
    assert find_cycle(import_graph(pkg)) is None


def test_core_and_baselines_do_not_import_each_other():
    """Dobb's room and the baselines share kernels through modules outside both (``newton_schulz``,
    ``distribution``), so neither is built on the other's internals."""
    graph = import_graph()
    crossing = sorted((a, b) for a, targets in graph.items() for b in targets
                      for x, y in (("dobb.core", "dobb.baselines"), ("dobb.baselines", "dobb.core"))
                      if (a == x or a.startswith(x + ".")) and (b == y or b.startswith(y + ".")))
    assert crossing == []
