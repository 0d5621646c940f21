"""The tests mirror the library's modules, so a reader finds a module's tests by its name.

The rule, per tier (a package of ``src/dobb``, nested ones included, and its test folder):
``src/dobb/<pkg>/<name>.py`` and ``src/dobb/<pkg>/_<name>.py`` are tested in ``tests/<pkg>/test_<name>.py``
(``src/dobb/baselines/muon_family/muon.py`` -> ``tests/baselines/muon_family/test_muon.py``,
``src/dobb/_base.py`` -> ``tests/test_base.py``). Every package (a folder with ``__init__.py``) is a
tier, so a new room of ``baselines/`` is checked as soon as it exists. Multi-process tests live in
``tests/distributed`` (``test_<name>_sharded.py`` where they test one module) and the bench's in
``tests/bench``; neither is checked here.

Checked both ways: every module has its test file (unless exempted below, with the reason), and
every test file of a tier names a module of it (unless it tests a cross-cutting behaviour, listed
below). Also checked: no two files under ``tests/`` share a name, because pytest's default import
mode imports each test folder's files as top-level modules (two ``test_meter.py`` would not load).
"""
from __future__ import annotations

import warnings
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC, TESTS = ROOT / "src" / "dobb", ROOT / "tests"

# package folder -> test folder: every package of src/dobb, at any depth, mirrored under tests/
TIERS = {SRC: TESTS, **{init.parent: TESTS / init.parent.relative_to(SRC)
                        for init in sorted(SRC.rglob("__init__.py")) if init.parent != SRC}}
# test folders that mirror no package (not checked here): the multi-process tests and the bench's
UNMIRRORED = {TESTS / "distributed", TESTS / "bench"}

# Modules without a test file of their own, and why. Each must exist (a stale entry fails).
EXEMPT_MODULES = {
    # package files: imports, __all__ and docstrings only (baselines/__init__.py's old module paths
    # are checked by tests/baselines/test_rooms.py); the exports are checked by tests/test_registry.py
    # (every registered optimizer exported) and used by every other test
    *(pkg / "__init__.py" for pkg in TIERS),
    # compile=True's kernels: tested by tests/core/test_compiled_kernels.py (test_kernels.py is the
    # bench's kernel counts, and no two test files share a name)
    SRC / "core" / "kernels.py",
}

# Modules whose tests are being written: tolerated while absent; a warning says when an entry can
# go (its test exists, or the module is gone). Empty: every module has its test file.
PENDING_MODULES: set[Path] = set()

# Test files that test a behaviour across modules, not one module, and why.
CROSS_CUTTING_TESTS = {
    TESTS / "test_readme.py",  # the README's commands and code blocks
    TESTS / "test_layout_of_tests.py",  # this file
    TESTS / "test_docs_run.py",  # every python block of the docs runs alone; links; the paper cited
    TESTS / "test_dev_setup.py",  # the repository's dev setup and commit-msg hook, no module
    TESTS / "test_imports_acyclic.py",  # no import cycle among all of the library's modules
    TESTS / "integrations" / "test_capture_api.py",  # opt.capture for custom layers, MoE routing (public API)
    TESTS / "integrations" / "test_compile.py",  # torch.compile of the step, every optimizer
    TESTS / "integrations" / "test_mixed_precision.py",  # autocast / bf16 weights, every optimizer
    TESTS / "integrations" / "test_fsdp_mixed_precision.py",  # FSDP2 MixedPrecisionPolicy
    TESTS / "integrations" / "test_transposed.py",  # Hugging Face Conv1D (in, out) weights, every optimizer
    TESTS / "core" / "test_room.py",  # the room's bounds: files one Dobb step crosses, imports run one way
    TESTS / "core" / "test_capture_every.py",  # capture_every: its rule (schedule), fold (statistics), checks (options)
    TESTS / "baselines" / "test_rooms.py",  # the rooms of baselines/: files a MuonBP or Dion2 step crosses, old paths
    TESTS / "core" / "test_dobb_muon.py",  # norm="muon" and whole_every: options, optimizer, functional, registry
    TESTS / "core" / "test_eigh_every.py",  # eigh_every: options, optimizer and statistics' refresh rule
    TESTS / "core" / "test_compiled_kernels.py",  # compile=True: core.kernels, Newton-Schulz, block-muon's option
}


def mirror_of(module: Path) -> Path:
    """The test file named for ``module``."""
    return TIERS[module.parent] / f"test_{module.stem.lstrip('_')}.py"


def modules():
    return sorted(p for pkg in TIERS for p in pkg.glob("*.py"))


def test_every_module_has_a_test_file_named_for_it():
    missing = []
    for module in modules():
        if module in EXEMPT_MODULES:
            continue
        wanted = mirror_of(module)
        if module in PENDING_MODULES:
            if wanted.exists():
                warnings.warn(f"{module.relative_to(ROOT)} has {wanted.relative_to(ROOT)}: take it out of PENDING_MODULES")
            continue
        if not wanted.exists():
            missing.append(f"{module.relative_to(ROOT)} -> {wanted.relative_to(ROOT)}")
    assert not missing, "modules without a test file named for them (add it, or exempt the module here with " \
                        "the reason):\n" + "\n".join(missing)
    for gone in sorted(p for p in PENDING_MODULES if not p.exists()):
        warnings.warn(f"{gone.relative_to(ROOT)} no longer exists: take it out of PENDING_MODULES")


def test_exemptions_are_not_stale():
    stale = [p.relative_to(ROOT) for p in sorted(EXEMPT_MODULES | CROSS_CUTTING_TESTS) if not p.exists()]
    assert not stale, f"exempted files that no longer exist: {stale}"


@pytest.mark.parametrize("folder", sorted(set(TIERS.values())), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_test_file_names_a_module(folder):
    package = next(pkg for pkg, tests in TIERS.items() if tests == folder)
    names = {m.stem.lstrip("_") for m in package.glob("*.py")} - {"init__"}
    strays = [t.relative_to(ROOT) for t in sorted(folder.glob("test_*.py"))
              if t not in CROSS_CUTTING_TESTS and t.stem[len("test_"):] not in names]
    assert not strays, (f"test files in {folder.relative_to(ROOT)} named for no module of "
                        f"{package.relative_to(ROOT)}: {strays} (rename to test_<module>.py, or list a "
                        f"cross-cutting test here with the reason)")


def test_every_test_folder_mirrors_a_package():
    """A test folder named for no package (a room renamed or removed, its tests left behind) fails."""
    folders = {t.parent for t in TESTS.rglob("test_*.py")
               if not any(t.is_relative_to(u) for u in UNMIRRORED)}
    strays = sorted(f.relative_to(ROOT) for f in folders - set(TIERS.values()))
    assert not strays, f"test folders that mirror no package of src/dobb: {strays}"


def test_no_two_files_under_tests_share_a_name():
    names = Counter(p.name for p in TESTS.rglob("*.py") if p.name not in ("conftest.py", "__init__.py"))
    assert not [n for n, k in names.items() if k > 1], sorted(n for n, k in names.items() if k > 1)


def test_the_rule_on_known_cases():
    """The mapping itself, on cases whose answer is known (a wrong rule would pass the checks above
    only if every file were misnamed the same way)."""
    assert mirror_of(SRC / "_base.py") == TESTS / "test_base.py"
    assert mirror_of(SRC / "meter.py") == TESTS / "test_meter.py"
    assert mirror_of(SRC / "baselines" / "_common.py") == TESTS / "baselines" / "test_common.py"
    room, tests = SRC / "baselines" / "muon_family", TESTS / "baselines" / "muon_family"
    assert mirror_of(room / "_split.py") == tests / "test_split.py"
    assert mirror_of(room / "muonbp.py") == tests / "test_muonbp.py"
    assert {SRC / "baselines" / room for room in ("muon_family", "dion_family", "shampoo_family")} <= set(TIERS)
    assert mirror_of(SRC / "integrations" / "hf.py") == TESTS / "integrations" / "test_hf.py"
