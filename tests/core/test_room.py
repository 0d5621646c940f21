"""The bounds of Dobb's room (``dobb.core``): one eager step is read in at most eight library files,
and imports run one way (the room imports the shared modules, none of them imports the room).

The files a step crosses are the files of every Python function the step executes, traced with
``sys.setprofile`` over one refresh ``opt.step()`` (the step that runs every part: agreement,
statistic fold, basis solve, update), for the one-sided step, ``side="both"`` and ``grad_gram``.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from torch import nn

import dobb
from _step_files import library_files

SRC = Path(dobb.__file__).resolve().parent
MAX_FILES = 8  # 7 until issue 53 added the finiteness guard every step runs (_safety.py)
# the files one step reads: the shared step loop, the room's step path (the class, the schedule, the
# statistics, the update), the math and the layouts (issue 42 split core/optimizer.py in three)
STEP_FILES = {"_base.py", "_safety.py", "core/optimizer.py", "core/schedule.py", "core/statistics.py", "core/update.py",
              "functional.py", "layout.py"}


def step_files(**options) -> set[str]:
    """Library files (relative to ``src/dobb``) with a function executed by one refresh step."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 12, bias=False), nn.ReLU(), nn.Linear(12, 4, bias=False))
    opt = dobb.Dobb([model[0].weight, model[2].weight], model, lr=0.01, **options)
    model(torch.randn(5, 8)).square().sum().backward()
    assert opt.is_refresh_step()
    before = [p.detach().clone() for p in model.parameters()]
    seen = library_files(opt.step)
    assert all(not torch.equal(b, p) for b, p in zip(before, model.parameters()))  # the step ran
    return seen


@pytest.mark.parametrize("options", [{}, {"side": "both"}, {"side": "both", "norm": "adam"},
                                     {"source": "grad_gram"}, {"norm": "l2"}],
                         ids=["one-sided", "both", "both-adam", "grad_gram", "l2"])
def test_one_eager_step_crosses_at_most_seven_library_files(options):
    files = step_files(**options)
    assert len(files) <= MAX_FILES, sorted(files)
    assert files == STEP_FILES, sorted(files)


def test_the_tracer_sees_a_file_added_to_the_step(monkeypatch):
    """The bound can fail: a step that calls one more module's function is counted."""
    from dobb import collectives
    from dobb.core import optimizer

    real = optimizer._zero_lr

    def zero_lr(group):
        collectives.current_kind()
        return real(group)

    monkeypatch.setattr(optimizer, "_zero_lr", zero_lr)
    assert "collectives.py" in step_files()


def _imported_modules(path: Path) -> set[str]:
    """Absolute names of the ``dobb`` modules ``path`` imports (at any depth, lazy imports too)."""
    package = ["dobb", *path.parent.relative_to(SRC).parts]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, *(node.module.split(".") if node.module else [])])
            out.add(module)
            out |= {f"{module}.{a.name}" for a in node.names}
    return {m for m in out if m == "dobb" or m.startswith("dobb.")}


def test_imports_run_one_way_into_the_room():
    allowed = {SRC / "__init__.py", SRC / "registry.py"}  # they name the class
    bad = {}
    for path in sorted(SRC.rglob("*.py")):
        if path.is_relative_to(SRC / "core") or path in allowed:
            continue
        into = sorted(m for m in _imported_modules(path) if m == "dobb.core" or m.startswith("dobb.core."))
        if into:
            bad[path.relative_to(SRC).as_posix()] = into
    assert bad == {}


def test_the_import_check_finds_an_import_into_the_room(tmp_path, monkeypatch):
    """The one-way check can fail: relative and absolute imports of the room are resolved."""
    fake = SRC / "baselines" / "muon.py"
    text = "from ..core.optimizer import Dobb\nimport dobb.core.statistics\nfrom .. import layout\n"
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: text)
    assert _imported_modules(fake) >= {"dobb.core.optimizer", "dobb.core.optimizer.Dobb", "dobb.core.statistics",
                                       "dobb.layout"}


def test_every_library_import_of_dobb_names_a_module_that_exists():
    """A module that moved into the room leaves no import of its old name behind (lazy ones too)."""
    import importlib.util

    missing = {}
    for path in sorted(SRC.rglob("*.py")):
        package = ["dobb", *path.parent.relative_to(SRC).parts]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("dobb")):
                base = package[: len(package) - node.level + 1] if node.level else []
                module = ".".join([*base, *(node.module.split(".") if node.module else [])])
                names = [module] if node.module else [f"{module}.{a.name}" for a in node.names]
                for name in names:
                    if importlib.util.find_spec(name) is None and not (not node.module and hasattr(
                            importlib.import_module(module), name.rsplit(".", 1)[1])):
                        missing.setdefault(path.relative_to(SRC).as_posix(), []).append(name)
    assert missing == {}


MAX_LINES = 500


def long_files(root: Path, limit: int = MAX_LINES) -> dict[str, int]:
    """Python files under ``root`` with more than ``limit`` lines."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        n = len(path.read_text().splitlines())
        if n > limit:
            out[path.relative_to(root).as_posix()] = n
    return out


def test_no_library_file_is_over_500_lines():
    """A file a reader must hold in their head stays under 500 lines (issue 42): split it by concern."""
    assert long_files(SRC) == {}


def test_no_bench_file_is_over_500_lines():
    """The same bound for the benchmark package (``src/dobb_bench``), beside the library."""
    bench = SRC.parent / "dobb_bench"
    assert (bench / "cli.py").exists() and long_files(bench) == {}


def test_the_length_check_finds_a_long_file(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "long.py").write_text("x = 1\n" * 501)
    (tmp_path / "short.py").write_text("x = 1\n" * 500)
    assert long_files(tmp_path) == {"pkg/long.py": 501}
