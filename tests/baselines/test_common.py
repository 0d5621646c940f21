"""dobb.baselines._common: the update protocol ``apply_protocol`` (written in ``_common``, named
here for the baselines) against the formula written out in float64, the DTensor forwarders on plain tensors, and the step's rules shared by all baselines (their
hyperparameters refused with a ValueError naming them, by the one set of rules of ``dobb._hparams``;
no host synchronisation inside ``step()``)."""
from __future__ import annotations

import pytest
import torch

import dobb
from _baseline_refs import data, mlp
from dobb.baselines import RMNP, BlockMuon, Dion, Dion2, Muon, PeriodicRowMuon
from dobb.baselines import _common as C

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
    # nonfinite="off": the finiteness check reads its flags on the host once a step by design ("raise"
    # before the step, "skip" the previous step's flag: tests/test_safety.py); the update reads nothing
    opt = cls([{"params": mats, "algorithm": cls.algorithm}], lr=0.1, nonfinite="off")
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


# ----------------------------------------------------------------------------- apply_protocol
def test_apply_protocol_is_the_formula_with_one_decay_per_parameter():
    """``W <- (1 - lr wd) W`` once per parameter, then ``T <- T - lr s O`` per target; targets may be
    views of the parameters (Block Muon's blocks), each with its own ``s``."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(4, 6, generator=g, dtype=torch.float64)
    v = torch.randn(3, 3, generator=g, dtype=torch.float64)
    o_left, o_right, o_v = (torch.randn(4, 3, generator=g, dtype=torch.float64),
                            torch.randn(4, 3, generator=g, dtype=torch.float64),
                            torch.randn(3, 3, generator=g, dtype=torch.float64))
    lr, wd, s_block, s_v = 0.1, 0.2, 0.7, 1.3
    expect_w = (1 - lr * wd) * w
    expect_w[:, :3] -= lr * s_block * o_left
    expect_w[:, 3:] -= lr * s_block * o_right
    expect_v = (1 - lr * wd) * v - lr * s_v * o_v
    W, V = w.clone(), v.clone()
    C.apply_protocol([W, V], [W[:, :3], W[:, 3:], V], [o_left, o_right, o_v], [s_block, s_block, s_v], lr, wd)
    assert torch.allclose(W, expect_w, rtol=0, atol=1e-15) and torch.allclose(V, expect_v, rtol=0, atol=1e-15)


def test_apply_protocol_tensor_lr_and_dtypes():
    """A tensor lr (a scheduler's) gives the float lr's numbers; a bf16 direction is cast to the
    fp32 target exactly (every bf16 is an fp32); no weight decay leaves W unscaled."""
    w = torch.linspace(-1, 1, 12).reshape(3, 4)
    o = torch.linspace(2, -2, 12, dtype=torch.bfloat16).reshape(3, 4)
    a, b = w.clone(), w.clone()
    C.apply_protocol([a], [a], [o], [0.5], 0.1, 0.0)
    C.apply_protocol([b], [b], [o], [0.5], torch.tensor(0.1), 0.0)
    expect = w.double() - 0.1 * 0.5 * o.double()
    assert torch.allclose(a.double(), expect, rtol=0, atol=1e-6) and torch.allclose(b, a, rtol=0, atol=1e-7)
    C.apply_protocol([], [], [], [], 0.1, 0.1)  # nothing to do is not an error


def test_upcast():
    assert C.upcast(torch.zeros(2, dtype=torch.bfloat16)).dtype == torch.float32
    assert C.upcast(torch.zeros(2, dtype=torch.float16)).dtype == torch.float32
    x64 = torch.zeros(2, dtype=torch.float64)
    assert C.upcast(x64) is x64


def test_dtensor_forwarders_pass_plain_tensors_through():
    t, full = torch.arange(6.0).reshape(2, 3), torch.ones(2, 3)
    assert C.gather_full(t, t) is t and C.local_slice(full, t) is full and C.rows_are_local(t)
    rows = C.row_wise(lambda x: x / x.norm(dim=1, keepdim=True), t, t)
    assert torch.allclose(rows, t / t.norm(dim=1, keepdim=True))
