"""The rooms of ``dobb.baselines`` (issue 42): a MuonBP or a Dion2 step is read in at most nine
library files, and a module answers only to its room's path (the aliases of the paths before the
rooms went with issue 54).

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
# (the full step's owner compute is the distribution layer's, the NS5 kernels the library's own module)
MUONBP_FILES = {"_base.py", "_safety.py", "baselines/_common.py", "layout.py", "functional.py", "baselines/muon_family/muonbp.py",
                "distribution.py", "baselines/muon_family/muon.py", "newton_schulz.py"}
DION2_FILES = {"_base.py", "_safety.py", "layout.py", "functional.py", "_torch_private.py", "baselines/_common.py",
               "baselines/dion_family/dion2.py", "newton_schulz.py"}


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
    assert "distribution.py" in step_files("MuonBP", steps=1)
    assert "distribution.py" not in step_files("MuonBP", steps=2, period=0)


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
OLD_PATHS = {**dict.fromkeys(("muon", "owner_muon", "block_muon", "muonbp", "normuon", "pr_muon", "samuon", "newton_muon",
                              "rmnp", "_split"), "muon_family"),
             **dict.fromkeys(("dion", "dion2", "dion3"), "dion_family"),
             **dict.fromkeys(("dash", "soap", "splus", "_matrix_roots"), "shampoo_family")}


def test_a_module_answers_only_to_its_rooms_path():
    """The 19 aliases of the paths before the rooms are gone (issue 54): ``dobb.baselines.muonbp``
    does not import, ``dobb.baselines.muon_family.muonbp`` does; the Newton-Schulz kernels left the
    package for ``dobb.newton_schulz`` (their names are still exported by ``dobb.baselines``)."""
    assert not hasattr(dobb.baselines, "_MOVED")
    for name, room in OLD_PATHS.items():
        assert importlib.import_module(f"dobb.baselines.{room}.{name}").__name__ == f"dobb.baselines.{room}.{name}"
    # in a fresh process, where no earlier import could have left an alias in sys.modules
    code = ("import importlib, sys\n"
            f"for old in {[*OLD_PATHS, 'newton_schulz', 'gram_ns']!r}:\n"
            "    try:\n        importlib.import_module('dobb.baselines.' + old)\n"
            "    except ModuleNotFoundError:\n        continue\n"
            "    print(old)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONPATH": str(SRC.parent), "PATH": "", "OMP_NUM_THREADS": "1"})
    assert out.stdout.split() == []
    from dobb.newton_schulz import newton_schulz

    assert dobb.baselines.newton_schulz is newton_schulz  # the function, exported as before
