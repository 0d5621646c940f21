"""The bench's import graph (issue 21 item 5): no circle among ``dobb_bench`` modules, and the
library reached only through its public API.

Imports inside functions count (an import circle that only closes at call time is still a circle
a reader has to untangle), and so do the command modules ``cli`` imports by name
(``_COMMAND_MODULES``). Public API: ``dobb`` and the names in ``dobb.__all__``; a submodule with
no ``_``-prefixed part in its path; from a module, only the names it exports (its ``__all__``
where it has one, else names without a leading ``_``). Both checks are first run on planted
violations, so a checker that sees nothing cannot pass.
"""
from __future__ import annotations

import ast
import importlib
import importlib.util
import re
from pathlib import Path

import dobb_bench

SRC = Path(dobb_bench.__file__).resolve().parent


def _modules(root: Path, package: str) -> dict[str, Path]:
    """Every module under ``root`` by dotted name (a package is its ``__init__``)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join([package, *parts])] = path
    return out


def _imports(name: str, path: Path) -> list[tuple[int, str, list[str]]]:
    """``(line, module, names)`` of every import statement, at any depth; relative ones resolved."""
    is_package = path.name == "__init__.py"
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                base = name.split(".")
                base = base[:len(base) - node.level + (1 if is_package else 0)]
                module = ".".join(base + ([module] if module else []))
            out.append((node.lineno, module, [a.name for a in node.names]))
    return out


def _command_modules(path: Path) -> list[str]:
    """``cli._COMMAND_MODULES``: modules the CLI imports by name (``importlib``), read from the source."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "_COMMAND_MODULES" for t in node.targets):
            return [elt.value for elt in node.value.elts]
    return []


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    """Edges between the package's modules; ``from pkg import mod`` is an edge to ``pkg.mod``, and
    importing ``a.b.c`` runs ``a`` and ``a.b`` too."""
    mods = _modules(root, package)
    graph = {m: set() for m in mods}
    for name, path in mods.items():
        targets = []
        for _, module, names in _imports(name, path):
            targets.append(module)
            targets += [f"{module}.{n}" for n in names if f"{module}.{n}" in mods]
        if name == f"{package}.cli":
            targets += [f"{package}.{m}" for m in _command_modules(path)]
        for target in targets:
            parts = target.split(".")
            for k in range(1, len(parts) + 1):
                prefix = ".".join(parts[:k])
                if prefix in mods and prefix != name and not name.startswith(prefix + "."):
                    graph[name].add(prefix)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (or a self-import)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):  # Tarjan's algorithm (the graph has ~50 nodes: recursion is fine)
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in graph[v]:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _public_module(module: str) -> bool:
    if any(p.startswith("_") for p in module.split(".")):
        return False
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent that is not a package: an attribute, not a module
        return False


def _exported(module: str, name: str) -> bool:
    """Whether ``module`` exports ``name``: a public submodule, or in ``__all__`` (else not ``_``-prefixed)."""
    if _public_module(f"{module}.{name}"):
        return True
    mod = importlib.import_module(module)
    public = getattr(mod, "__all__", None)
    return name in public if public is not None else not name.startswith("_")


def private_uses(path: Path, library: str = "dobb") -> list[str]:
    """Imports of, and attributes read from, ``library``'s modules that are not its public API."""
    bad, bound = [], {}
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] != library:
                    continue
                if not _public_module(a.name):
                    bad.append(f"{path.name}:{node.lineno}: import {a.name}")
                bound[a.asname or library] = a.name if a.asname else library
        elif isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == library:
            if not _public_module(node.module):
                bad.append(f"{path.name}:{node.lineno}: from {node.module} import ...")
                continue
            for a in node.names:
                if not _exported(node.module, a.name):
                    bad.append(f"{path.name}:{node.lineno}: from {node.module} import {a.name}")
                elif _public_module(f"{node.module}.{a.name}"):
                    bound[a.asname or a.name] = f"{node.module}.{a.name}"
    for node in ast.walk(tree):  # dobb.x._y, F._y: attribute chains from a bound library module
        chain = []
        while isinstance(node, ast.Attribute):
            chain.append(node.attr)
            node = node.value
        if not (isinstance(node, ast.Name) and node.id in bound and chain):
            continue
        module = bound[node.id]
        for attr in reversed(chain):
            if not _exported(module, attr):
                bad.append(f"{path.name}: {module}.{attr}")
                break
            if not _public_module(f"{module}.{attr}"):
                break  # an object the module exports: its own attributes are its API
            module = f"{module}.{attr}"
    return sorted(set(bad))


def _plant(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "planted"
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def test_checker_finds_a_circle_closed_inside_a_function(tmp_path):
    root = _plant(tmp_path, {"__init__.py": "", "room/__init__.py": "",
                             "room/a.py": "from planted.room import b\n",
                             "room/b.py": "def f():\n    from . import c\n",
                             "room/c.py": "def g():\n    from planted.room.a import x\n",
                             "cli.py": '_COMMAND_MODULES = ["room.d"]\n', "room/d.py": "from ..cli import main\n",
                             "ok.py": "import planted.room.a\n"})
    graph = import_graph(root, "planted")
    assert circles(graph) == [["planted.cli", "planted.room.d"], ["planted.room.a", "planted.room.b", "planted.room.c"]]
    assert "planted.room" in graph["planted.ok"] and "planted.room.a" in graph["planted.ok"]


def test_no_import_circle_among_bench_modules():
    graph = import_graph(SRC, "dobb_bench")
    assert len(graph) > 30 and graph["dobb_bench.cli"]  # the walk saw the bench and the CLI's commands
    assert circles(graph) == []


def test_checker_finds_private_library_uses(tmp_path):
    root = _plant(tmp_path, {"m.py": "import dobb\nimport dobb._copies\nfrom dobb import _hparams, Dobb, functional as F\n"
                                     "from dobb.registry import get, _index\nfrom dobb.baselines.dion_family import dion\n"
                                     "x = dobb.functional.block_sizes, dobb._base, F._private_name, dion.dion_rank\n"
                                     "y = dobb.registry.OPTIMIZERS.items()\n"})
    assert private_uses(root / "m.py") == ["m.py: dobb._base", "m.py: dobb.functional._private_name",
                                          "m.py:2: import dobb._copies", "m.py:3: from dobb import _hparams",
                                          "m.py:4: from dobb.registry import _index"]


def test_bench_uses_the_library_only_through_its_public_api():
    bad = [use for path in sorted(SRC.rglob("*.py")) for use in private_uses(path)]
    assert bad == []


def underscore_uses(path: Path, package: str = "dobb_bench") -> list[str]:
    """Another ``package`` module's ``_``-prefixed names that ``path`` imports or reads (issue 42:
    a name used across modules is public): ``private_uses`` on ``package``, less the public names a
    module leaves out of its ``__all__``."""
    return [u for u in private_uses(path, package) if re.search(r"(?:import |\.)_[A-Za-z]\w*$", u)]


def test_checker_finds_underscore_names_across_bench_modules(tmp_path):
    root = _plant(tmp_path, {"m.py": "from dobb_bench.reports.tables import _nothing, final_loss\n"
                                     "from dobb_bench.training import commands_train as T\n"
                                     "x = T._hidden, T.run_slug\n"})
    assert underscore_uses(root / "m.py") == ["m.py: dobb_bench.training.commands_train._hidden",
                                              "m.py:1: from dobb_bench.reports.tables import _nothing"]


def test_no_bench_module_or_script_reaches_for_another_modules_private_names():
    paths = sorted(SRC.rglob("*.py")) + sorted((SRC.parents[1] / "scripts").glob("*.py"))
    assert len(paths) > 60 and [use for path in paths for use in underscore_uses(path)] == []


# the bench's rooms, lowest first: a room may import its own modules and those of rooms below it
ROOMS_ABOVE_REPORTS = ("dobb_bench.cost", "dobb_bench.studies", "dobb_bench.training", "dobb_bench.spectral",
                       "dobb_bench.cli")


def upward_imports(graph: dict[str, set[str]], room: str, above: tuple[str, ...]) -> dict[str, list[str]]:
    """Imports (lazy ones too) from the modules of ``room`` into the rooms ``above`` it."""
    return {m: sorted(t for t in targets if t.startswith(above)) for m, targets in graph.items()
            if (m == room or m.startswith(room + ".")) and any(t.startswith(above) for t in targets)}


def test_reports_import_no_room_above_them():
    """The reports present what the rooms above compute (payload ratios, re-evaluation records) and
    import none of them: a caller passes the payload function, the records are read by ``records``."""
    assert upward_imports(import_graph(SRC, "dobb_bench"), "dobb_bench.reports", ROOMS_ABOVE_REPORTS) == {}


def test_checker_finds_an_upward_import(tmp_path):
    root = _plant(tmp_path, {"__init__.py": "", "reports/__init__.py": "", "cost/__init__.py": "",
                             "reports/r.py": "def f():\n    from planted.cost.payload import x\n",
                             "cost/payload.py": "from planted.reports import r\n"})
    graph = import_graph(root, "planted")
    assert upward_imports(graph, "planted.reports", ("planted.cost",)) == {"planted.reports.r": ["planted.cost",
                                                                                            "planted.cost.payload"]}
