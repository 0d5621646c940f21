"""One behaviour for every registry name: a non-finite gradient never reaches the weights
(``nonfinite``: "raise", "skip", "off"), another optimizer's state is refused at load, naming both.

References: a snapshot of every weight and of ``opt.state_dict()`` taken before the step (bitwise),
and an optimizer of the same name that never saw the bad step (bitwise: "skip" must leave nothing
of it behind, Python step counts included, and change nothing when every gradient is finite).
"""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

from _contract_net import MATRIX_NAMES, Net, backward, same
from _hostsync import HostReads

import dobb

warnings.filterwarnings("ignore", message="SAMuon: total_steps")


def build(name, model, **kw):
    return dobb.build_optimizer(name, model, lr=0.01, weight_decay=0.1, **kw)


def everything(model, opt):
    """Every weight and the whole state dict (state and param groups), deep-copied."""
    return [p.detach().clone() for p in model.parameters()], copy.deepcopy(opt.state_dict())


def assert_same(a, b, groups=True):
    wa, sa = a
    wb, sb = b
    assert all(torch.equal(x, y) for x, y in zip(wa, wb)), "a weight changed"
    if groups:
        assert sa["param_groups"] == sb["param_groups"]
    assert sa["state"].keys() == sb["state"].keys()
    for i in sa["state"]:
        assert sa["state"][i].keys() == sb["state"][i].keys(), i
        for k in sa["state"][i]:
            assert same(sa["state"][i][k], sb["state"][i][k]), (i, k)


def poison(model, where, value=float("nan")):
    dict(model.named_parameters())[where].grad.view(-1)[1] = value


@pytest.mark.parametrize("name", MATRIX_NAMES)
def test_nonfinite_gradient_never_reaches_the_weights(name):
    # reference: steps 0, 1, 2 with finite gradients, default options
    ref = Net()
    ref_opt = build(name, ref)
    # raise: steps 0, then a NaN (matrix) and an Inf (AdamW part) step refused, then 1, 2
    model = Net()
    opt = build(name, model)
    # skip: steps 0, a skipped NaN step, 1, 2
    sk = Net()
    sk_opt = build(name, sk, nonfinite="skip")
    for m, o in ((ref, ref_opt), (model, opt), (sk, sk_opt)):
        o.zero_grad()
        backward(m, 0)
        o.step()
    for where, value in (("hidden.weight", float("nan")), ("norm.weight", float("inf"))):
        opt.zero_grad()
        backward(model, 1)
        poison(model, where, value)
        before = everything(model, opt)
        with pytest.raises(ValueError, match=rf"non-finite gradient \(NaN or Inf\) in {where}\b"):
            opt.step()
        assert_same(everything(model, opt), before)
    sk_opt.zero_grad()
    backward(sk, 1)
    poison(sk, "hidden.weight")
    before = everything(sk, sk_opt)
    sk_opt.step()
    assert_same(everything(sk, sk_opt), before)
    for t in (1, 2):
        for m, o in ((ref, ref_opt), (model, opt), (sk, sk_opt)):
            o.zero_grad()
            backward(m, t)
            o.step()
    assert_same(everything(model, opt), everything(ref, ref_opt))
    # finite gradients under "skip": bitwise the default step; the skipped one left nothing behind
    assert_same(everything(sk, sk_opt), everything(ref, ref_opt), groups=False)


@pytest.mark.parametrize("name", ["muon", "normuon", "block-muon"])
def test_nonfinite_off_does_not_check(name):
    model = Net()
    opt = build(name, model, nonfinite="off")
    opt.zero_grad()
    backward(model, 0)
    poison(model, "hidden.weight")
    opt.step()  # no check: the NaN reaches the weights, as before this option existed
    assert not torch.isfinite(model.hidden.weight).all()


def test_nonfinite_is_a_valid_hyperparameter_of_every_name():
    for name in MATRIX_NAMES:
        assert "nonfinite" in dobb.registry.valid_hparams(name)
        dobb.registry.validate(name, {"nonfinite": "skip"})
        with pytest.raises(ValueError, match=r"nonfinite must be one of \('raise', 'skip', 'off'\), got 'ignore'"):
            dobb.registry.validate(name, {"nonfinite": "ignore"})


@pytest.mark.parametrize("name", ["muon", "block-muon", "dobb", "soap"])
def test_skip_reads_no_tensor_on_the_host(name):
    """The skipping step issues no host read; the next step reads the flag of the last one (the one
    read, computed a whole step before), and nothing else."""
    model = Net()
    kw = {"check_finite": False} if name.startswith("dobb") else {}
    opt = build(name, model, nonfinite="skip", **kw)
    adamw_steps = [opt.state[p]["step"] for g in opt.param_groups if g["algorithm"] == "adamw" for p in g["params"]]
    for t in range(3):
        opt.zero_grad()
        backward(model, t)
        if t == 1:
            poison(model, "hidden.weight")
        pending = getattr(opt, "_skipped", None)
        exempt = adamw_steps + ([pending.flag] if pending is not None else [])
        with HostReads(exempt) as spy:
            opt.step()
        assert spy.hits == [], (t, spy.hits)


def test_skip_under_torch_compile():
    """A compiled step ("aot_eager") skips a NaN step and otherwise gives the eager numbers."""
    torch._dynamo.reset()

    def run(compiled):
        model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)).double()
        torch.manual_seed(0)
        for p in model.parameters():
            nn.init.normal_(p, std=0.3)
        opt = dobb.build_optimizer("muon", model, lr=1e-2, weight_decay=0.1, nonfinite="skip")
        step = torch.compile(opt.step, backend="aot_eager") if compiled else opt.step
        g = torch.Generator().manual_seed(1)
        kept = []
        for t in range(4):
            x = torch.randn(32, 8, generator=g, dtype=torch.float64)
            model(x).square().mean().backward()
            if t == 2:
                model[0].weight.grad[0, 0] = float("nan")
                before = [p.detach().clone() for p in model.parameters()]
            step()
            if t == 2:
                kept = [torch.equal(a, p) for a, p in zip(before, model.parameters())]
            opt.zero_grad()
        return [p.detach().clone() for p in model.parameters()], kept

    eager, eager_kept = run(False)
    compiled, compiled_kept = run(True)
    assert all(eager_kept) and all(compiled_kept)
    for a, b in zip(eager, compiled):  # the AdamW part's compiled (capturable) kernel rounds otherwise
        torch.testing.assert_close(b, a, atol=1e-7, rtol=1e-6)
