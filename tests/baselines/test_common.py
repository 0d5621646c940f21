"""dobb.baselines._common: the validation helpers every baseline checks its hyperparameters with (a
ValueError naming the argument), and the step's rules shared by all of them (no host synchronisation
inside ``step()``)."""
from __future__ import annotations

import pytest
import torch

import dobb
from _baseline_refs import data, mlp
from dobb.baselines import RMNP, BlockMuon, Dion, Dion2, Muon, PeriodicRowMuon


CLASSES = [Muon, Dion, RMNP, PeriodicRowMuon, BlockMuon, Dion2]


@pytest.mark.parametrize("cls,kw,arg", [
    (Muon, {"ns_steps": 0}, "ns_steps"), (Muon, {"nesterov": 1}, "nesterov"),
    (Muon, {"ns_coefficients": (1.0, 2.0)}, "ns_coefficients"), (Muon, {"eps": 0.0}, "eps"),
    (Dion, {"rank_fraction": 0.0}, "rank_fraction"), (Dion, {"rank_fraction": 1.5}, "rank_fraction"),
    (Dion, {"qr": "svd"}, "qr"), (Dion, {"seed": -1}, "seed"), (PeriodicRowMuon, {"period": 0}, "period"),
    (BlockMuon, {"blocks": 0}, "blocks"), (BlockMuon, {"axis": 2}, "axis"),
    (Dion2, {"fraction": 0.0}, "fraction"), (RMNP, {"nesterov": "yes"}, "nesterov"),
])
def test_hyperparameter_validation(cls, kw, arg):
    with pytest.raises(ValueError, match=rf"\b{arg}( must|=)"):
        cls(dobb.param_groups(mlp(), algorithm=cls.algorithm), lr=0.1, **kw)


@pytest.mark.parametrize("cls", CLASSES)
def test_no_host_sync_in_matrix_step(cls, monkeypatch):
    model = mlp()
    mats = [(f"{i}.weight", model[i].weight) for i in (0, 2, 4)]
    opt = cls([{"params": mats, "algorithm": cls.algorithm}], lr=0.1)
    X, Y = data()

    def boom(*a, **k):
        raise AssertionError("host synchronisation inside step()")

    for _ in range(2):
        opt.zero_grad()
        ((model(X) - Y) ** 2).mean().backward()
        with monkeypatch.context() as mp:
            for name in ("item", "__bool__", "tolist"):
                mp.setattr(torch.Tensor, name, boom)
            opt.step()
