"""The rooms of ``dobb.baselines`` (issue 42): a MuonBP or a Dion2 step is read in at most seven
library files, and every module that moved into a room still answers to its old path.

The files a step crosses are counted as ``tests/core/test_room.py`` counts Dobb's: the files of every
Python function the step executes, traced with ``sys.setprofile`` over ``opt.step()`` on a small
model of matrices. The steps traced cover every kind: MuonBP's full step (owner compute, its first)
and block step (its second), Dion2's global and per-shard row selection. The CPU's bf16 probe
(``functional.cpu_native``, cached for the process) is cleared first, so each count is what a fresh
process reads: Dion2's first step runs the probe, MuonBP's constructor already has.

The AdamW part of a model with vectors (biases, norms) adds ``_torch_private.py`` (torch's own
``AdamW._init_group``), to these steps as to Dobb's.
"""
from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import dobb
import dobb.baselines
from dobb import functional as F
from _step_files import library_files

SRC = Path(dobb.__file__).resolve().parent
MAX_FILES = 9  # 7 until issue 53: the finiteness guard (_safety.py) and the protocol moved out of _base.py
# the loop and the protocol, the layouts' DTensor unwrap, the protocol's scale, and the room's files
MUONBP_FILES = {"_base.py", "_safety.py", "baselines/_common.py", "layout.py", "functional.py", "baselines/muon_family/muonbp.py",
                "baselines/muon_family/owner_muon.py", "baselines/muon_family/muon.py",
                "baselines/muon_family/newton_schulz.py"}
DION2_FILES = {"_base.py", "_safety.py", "layout.py", "functional.py", "_torch_private.py", "baselines/_common.py",
               "baselines/dion_family/dion2.py", "baselines/muon_family/newton_schulz.py"}


def step_files(name: str, steps: int = 2, **options) -> set[str]:
    """Library files (relative to ``src/dobb``) with a function executed by the first ``steps`` steps."""
    F.cpu_native.cache_clear()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 12, bias=False), nn.ReLU(), nn.Linear(12, 4, bias=False))
    opt = getattr(dobb, name)([model[0].weight, model[2].weight], lr=0.01, **options)
    seen: set[str] = set()
    for _ in range(steps):
        model(torch.randn(5, 8)).square().sum().backward()
        before = [p.detach().clone() for p in model.parameters()]
        seen |= library_files(opt.step)
        assert all(not torch.equal(b, p) for b, p in zip(before, model.parameters()))  # the step ran
        opt.zero_grad()
    return seen


@pytest.mark.parametrize("options", [{}, {"blocks": 2, "axis": 1}], ids=["rows", "columns"])
def test_a_muonbp_step_crosses_at_most_seven_library_files(options):
    files = step_files("MuonBP", **options)  # its step 0 is a full step, its step 1 a block step
    assert len(files) <= MAX_FILES, sorted(files)
    assert files == MUONBP_FILES, sorted(files)


@pytest.mark.parametrize("options,expected", [({}, DION2_FILES),
                                              # whole rows here: no gather (_common: the protocol)
                                              ({"select": "shard", "blocks": 2}, DION2_FILES)],
                         ids=["global", "shard"])
def test_a_dion2_step_crosses_at_most_seven_library_files(options, expected):
    files = step_files("Dion2", **options)
    assert len(files) <= MAX_FILES, sorted(files)
    assert files == expected, sorted(files)


def test_both_kinds_of_muonbp_step_are_traced():
    """The bound covers MuonBP's two steps: the full one (owner compute) and the block one (tiles)."""
    assert "baselines/muon_family/owner_muon.py" in step_files("MuonBP", steps=1)
    assert "baselines/muon_family/owner_muon.py" not in step_files("MuonBP", steps=2, period=0)


def test_the_tracer_sees_a_file_added_to_the_step(monkeypatch):
    """The bound can fail: a step that calls one more module's function is counted."""
    from dobb import collectives
    from dobb.baselines.muon_family.muonbp import MuonBP

    real = MuonBP.is_full_step

    def is_full_step(self, group, p):
        collectives.current_kind()
        return real(self, group, p)

    monkeypatch.setattr(MuonBP, "is_full_step", is_full_step)
    assert "collectives.py" in step_files("MuonBP")


# ----------------------------------------------------------------------------- the old module paths
MOVED = dobb.baselines._MOVED


def test_every_moved_module_answers_to_its_old_path_as_the_same_module():
    baselines = SRC / "baselines"
    assert len(MOVED) == 19 and set(MOVED.values()) == {"muon_family", "dion_family", "shampoo_family"}
    for name, room in MOVED.items():
        assert (baselines / room / f"{name}.py").is_file() and not (baselines / f"{name}.py").exists(), name
        assert importlib.import_module(f"dobb.baselines.{name}") is importlib.import_module(
            f"dobb.baselines.{room}.{name}"), name
    # names users imported from the old modules
    from dobb.baselines.dion import dion_rank  # noqa: F401
    from dobb.baselines.muon import NSOptions, _MuonFamily, resolve_ns_dtype  # noqa: F401
    from dobb.baselines.muonbp import MuonBP

    assert MuonBP is dobb.MuonBP and NSOptions is dobb.baselines.muon_family.newton_schulz.NSOptions
    assert dobb.baselines.newton_schulz is dobb.baselines.muon_family.newton_schulz.newton_schulz  # the function


def test_an_old_path_imports_in_a_fresh_process():
    """``import dobb.baselines.muonbp`` as the first import (the package's aliases are made on import)."""
    code = ("import dobb.baselines.muonbp as m, dobb.baselines.soap as s, sys\n"
            "print(m.__name__, s.__name__, sys.modules['dobb.baselines.dion2'].__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONPATH": str(SRC.parent), "PATH": "", "OMP_NUM_THREADS": "1"})
    assert out.stdout.split() == ["dobb.baselines.muon_family.muonbp", "dobb.baselines.shampoo_family.soap",
                                  "dobb.baselines.dion_family.dion2"]
