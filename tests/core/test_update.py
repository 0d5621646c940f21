"""``dobb.core.update``: the update's kernel choice, read on its own.

The update's numbers (one-sided, two-sided, ``norm="muon"``, whole-matrix steps) are checked against
the float64 reference through the class in ``tests/core/test_optimizer.py`` and
``tests/core/test_dobb_muon.py``; here: the optimizer re-exports these names, and the fused-decay
rule reads this module's threshold.
"""
from __future__ import annotations

import torch

from dobb.core import optimizer, update
from dobb.placement import layout_for


def test_the_optimizer_re_exports_the_update():
    for name in ("FUSE_MIN_BLOCK_WORK", "OneSided", "TwoSided", "decay_in_update", "apply_directions",
                 "apply_two_sided", "apply_preconditioned_muon", "precondition"):
        assert getattr(optimizer, name) is getattr(update, name), name


def test_decay_in_update_reads_the_threshold_of_this_module(monkeypatch):
    w = torch.zeros(64, 64)
    lay = layout_for(w, "input", 2, None)
    kw = dict(lr=0.1, basis_dtype=torch.float32, product_dtype="auto")
    work = 64 * 32 * 32  # rows * smallest block ** 2
    monkeypatch.setattr(update, "FUSE_MIN_BLOCK_WORK", work)
    assert update.decay_in_update(w, lay, **kw)
    monkeypatch.setattr(update, "FUSE_MIN_BLOCK_WORK", work + 1)
    assert not update.decay_in_update(w, lay, **kw)
    assert not update.decay_in_update(w, lay, **dict(kw, lr=torch.tensor(0.1)))  # a tensor lr: never fused


def test_whole_step_owner_has_no_state():
    owner = update.whole_step_owner()
    assert owner.owners == {} and owner.gathered == {} and owner._replicated_group == "default"
