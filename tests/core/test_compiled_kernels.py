"""``compile=True``: the library's own kernels compiled by Inductor (``dobb._compiled``, ``core.kernels``)
give the eager numbers, in float64 (so that no coefficient's sign flips on rounding), over steps that
refresh; the option is a checked group option saved like any other; the user's own
``torch.compile(opt.step)`` still traces the plain functions (``test_compile.py`` keeps the rest of
that path). Inductor generates and compiles C++: small models, few steps; ``DOBB_TEST_INDUCTOR=0``
opts out, as in ``test_compile.py``."""
import os
import shutil

import pytest
import torch
from torch import nn

import dobb

pytestmark = pytest.mark.skipif(os.environ.get("DOBB_TEST_INDUCTOR") == "0" or shutil.which("g++") is None,
                                reason="Inductor's C++ compiler is not available (or DOBB_TEST_INDUCTOR=0)")

F64 = dict(basis_dtype=torch.float64, stat_dtype=torch.float64, refresh_every=2)
CASES = {
    "dobb-b1": ("dobb", dict(F64, blocks=1)),
    "dobb-b4": ("dobb", dict(F64, blocks=4)),
    "dobb-both": ("dobb", dict(F64, blocks=2, side="both", out_blocks=2)),
    "dobb-muon": ("dobb-muon", dict(F64, blocks=2, out_blocks=2, ns_dtype="float64")),
    # two equal matrices: one stacked group in the compiled kernel, as in eager
    "dobb-muon-equal": ("dobb-muon", dict(F64, blocks=2, out_blocks=2, ns_dtype="float64"), True),
    "block-muon": ("block-muon", dict(ns_dtype="float64")),
}


def _model(equal: bool = False) -> nn.Module:
    torch.manual_seed(0)
    mid = [nn.Linear(32, 32, bias=False), nn.Tanh(), nn.Linear(32, 32, bias=False), nn.Tanh()] if equal else []
    return nn.Sequential(nn.Linear(16, 32, bias=False), nn.Tanh(), *mid, nn.Linear(32, 16, bias=False)).double()


def _run(name, kw, steps=4, compiled=False, lr=1e-2, equal=False):
    model = _model(equal)
    opt = dobb.build_optimizer(name, model, lr=lr, weight_decay=0.1, compile=compiled, **kw)
    g = torch.Generator().manual_seed(1)
    for i in range(steps):
        for group in opt.param_groups:  # a scheduled lr: a compiled kernel must not bake it in
            group["lr"] = lr * (1 - 0.1 * i)
        model(torch.randn(64, 16, generator=g, dtype=torch.float64)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


@pytest.mark.parametrize("case", sorted(CASES))
def test_compiled_kernels_give_the_eager_numbers(case):
    from torch._dynamo.utils import counters

    name, kw, *equal = CASES[case]
    eager, _ = _run(name, kw, equal=bool(equal))
    counters.clear()
    compiled, opt = _run(name, kw, compiled=True, equal=bool(equal))
    assert counters["stats"]["unique_graphs"] > 0  # the kernels did compile
    if name == "dobb-muon":  # one kernel for every matrix of the step, compiled once (lr and step are tensors)
        assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    for a, b in zip(eager.parameters(), compiled.parameters()):
        torch.testing.assert_close(b, a, atol=1e-12, rtol=1e-10)
    # the option is a group option like any other, and the checkpoint's structure does not depend on it
    sd_on, sd_off = opt.state_dict(), _run(name, kw, steps=1, equal=bool(equal))[1].state_dict()
    assert all(g["compile"] is True for g in sd_on["param_groups"] if g["algorithm"] != "adamw")
    assert [sorted(s) for s in sd_on["state"].values()] == [sorted(s) for s in sd_off["state"].values()]


def test_compile_is_a_checked_option():
    model = nn.Sequential(nn.Linear(4, 4, bias=False))
    with pytest.raises(ValueError, match="compile must be True or False"):
        dobb.build_optimizer("dobb", model, lr=1e-2, compile="yes")
    with pytest.raises(ValueError, match="does not take"):
        dobb.build_optimizer("soap", model, lr=1e-2, compile=True)


def test_compile_true_under_a_compiled_step_traces_the_plain_kernels():
    """``torch.compile(opt.step)`` over ``compile=True``: the kernels are traced into the user's graph
    (``dobb._compiled.compiled`` returns the plain function while Dynamo compiles)."""
    torch._dynamo.reset()
    eager, _ = _run("block-muon", CASES["block-muon"][1], steps=2)
    model = _model()
    opt = dobb.build_optimizer("block-muon", model, lr=1e-2, weight_decay=0.1, compile=True, ns_dtype="float64")
    step = torch.compile(opt.step, backend="aot_eager")
    g = torch.Generator().manual_seed(1)
    for i in range(2):
        for group in opt.param_groups:
            group["lr"] = 1e-2 * (1 - 0.1 * i)
        model(torch.randn(64, 16, generator=g, dtype=torch.float64)).square().mean().backward()
        step()
        opt.zero_grad()
    for a, b in zip(eager.parameters(), model.parameters()):
        torch.testing.assert_close(b, a, atol=1e-12, rtol=1e-10)
