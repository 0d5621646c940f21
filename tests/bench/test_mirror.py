"""tests/bench mirrors src/dobb_bench (issue 21 item 6): ``tests/bench/<room>/test_<module>.py`` for
``dobb_bench/<room>/<module>.py`` (``test_<module>_<aspect>.py`` where one module has two files,
e.g. ``training/test_train_dist.py``), top-level tests for top-level modules. A test file whose
module was renamed or moved fails here instead of silently testing under a stale name.

Tier-wide checks at the top that test no single module: ``test_imports.py`` (the import graph),
``test_mirror.py`` (this file) and ``test_docs_tables.py`` (every docs table equals its
regeneration; it tests ``studies/docs_tables.py`` and keeps its path because the project's
procedures name it).
"""
from __future__ import annotations

from pathlib import Path

import dobb_bench

SRC = Path(dobb_bench.__file__).resolve().parent
TESTS = Path(__file__).resolve().parent
TIER_CHECKS = {"test_imports.py", "test_mirror.py", "test_docs_tables.py"}


def stale_test_files(src: Path, tests: Path) -> list[str]:
    """Test files that name no module of their room, and test rooms with no package."""
    rooms = {p.parent.name for p in src.glob("*/__init__.py")}
    bad = []
    for path in sorted(tests.rglob("test_*.py")):
        rel = path.relative_to(tests)
        if len(rel.parts) == 1 and rel.name in TIER_CHECKS:
            continue
        room = src.joinpath(*rel.parts[:-1])
        if len(rel.parts) > 2 or (len(rel.parts) == 2 and rel.parts[0] not in rooms):
            bad.append(f"{rel}: no package dobb_bench/{'/'.join(rel.parts[:-1])}")
            continue
        stem = path.stem.removeprefix("test_")
        modules = {p.stem for p in room.glob("*.py") if p.stem != "__init__"}
        if not any(stem == m or stem.startswith(m + "_") for m in modules):
            bad.append(f"{rel}: no module {stem!r} in dobb_bench/{'/'.join(rel.parts[:-1]) or '.'}")
    return bad


def test_checker_flags_a_stale_name_and_a_missing_room(tmp_path):
    src, tests = tmp_path / "src", tmp_path / "tests"
    for rel in ("__init__.py", "cli.py", "room/__init__.py", "room/train.py"):
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_text("")
    for rel in ("test_cli.py", "room/test_train.py", "room/test_train_dist.py", "room/test_model.py",
                "other/test_x.py", "test_imports.py"):
        (tests / rel).parent.mkdir(parents=True, exist_ok=True)
        (tests / rel).write_text("")
    assert stale_test_files(src, tests) == ["other/test_x.py: no package dobb_bench/other",
                                            "room/test_model.py: no module 'model' in dobb_bench/room"]


def test_bench_tests_mirror_the_modules():
    assert stale_test_files(SRC, TESTS) == []
    rooms = sorted(p.parent.name for p in SRC.glob("*/__init__.py"))
    assert rooms == ["cost", "reports", "spectral", "studies", "training"]
    assert all((TESTS / room / "__init__.py").exists() for room in rooms)  # room test folders are packages:
    # test files in two rooms may share a name (pytest's default import mode needs the package)
