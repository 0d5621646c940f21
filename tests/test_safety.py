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


# ----------------------------------------------------------------------------- foreign state
def _stepped(name):
    model = Net()
    opt = build(name, model) if name != "adamw" else torch.optim.AdamW(model.parameters(), lr=0.01)
    opt.zero_grad()
    backward(model, 0)
    opt.step()
    return model, opt


def test_state_of_another_optimizer_is_refused_at_load_naming_both():
    """Every ordered pair of registry names (and torch's AdamW and SGD as the saver): the same name
    round-trips exactly; another name is a ValueError at load_state_dict naming both labels, with
    nothing loaded (the loader's weights and state dict bitwise as before)."""
    labels = {n: dobb.registry.get(n).label for n in MATRIX_NAMES}
    built = {n: _stepped(n) for n in MATRIX_NAMES}
    saved = {n: copy.deepcopy(opt.state_dict()) for n, (_, opt) in built.items()}
    _, adamw = _stepped("adamw")
    sgd_model = Net()
    sgd = torch.optim.SGD(sgd_model.parameters(), lr=0.1, momentum=0.9)
    backward(sgd_model, 0)
    sgd.step()
    foreign = {"torch.optim.Adam/AdamW": adamw.state_dict(), "torch.optim.SGD": sgd.state_dict()}
    for b in MATRIX_NAMES:
        model, opt = built[b]
        before = everything(model, opt)
        for a in MATRIX_NAMES:
            if a == b:
                continue
            with pytest.raises(ValueError) as err:
                opt.load_state_dict(copy.deepcopy(saved[a]))
            msg = str(err.value)
            assert f"saved by {labels[a]} " in msg and msg.startswith(f"{labels[b]} cannot load"), (a, b, msg)
            assert_same(everything(model, opt), before)
        for who, sd in foreign.items():
            with pytest.raises(ValueError, match=rf"^{labels[b]} cannot load this state dict: saved param group 0 "
                                                 rf"has no 'algorithm', so it was saved by {who}"):
                opt.load_state_dict(copy.deepcopy(sd))
            assert_same(everything(model, opt), before)
        # the same name round-trips exactly, and the next step is the uninterrupted one's
        fresh_model = Net()
        fresh = build(b, fresh_model)
        with torch.no_grad():
            for p, q in zip(fresh_model.parameters(), model.parameters()):
                p.copy_(q)
        fresh.load_state_dict(copy.deepcopy(saved[b]))
        assert_same(everything(fresh_model, fresh), before)
        for m, o in ((model, opt), (fresh_model, fresh)):
            o.zero_grad()
            backward(m, 1)
            o.step()
        assert_same(everything(fresh_model, fresh), everything(model, opt))


def test_older_checkpoint_without_the_record():
    """A state dict of this package saved before the record existed (no optimizer/optimizer_class in its
    groups) still loads into the same optimizer; into another preset of the class it is refused."""
    model, opt = _stepped("dobb")
    sd = copy.deepcopy(opt.state_dict())
    for g in sd["param_groups"]:
        del g["optimizer"], g["optimizer_class"]
    fresh_model = Net()
    fresh = build("dobb", fresh_model)
    fresh.load_state_dict(copy.deepcopy(sd))
    assert fresh.state_dict()["param_groups"] == opt.state_dict()["param_groups"]
    other = build("dobb-muon", Net())
    with pytest.raises(ValueError, match=r"^Dobb-Muon cannot load this state dict: it was saved by Dobb \(Dobb with "
                                         r".*norm='sign'"):
        other.load_state_dict(copy.deepcopy(sd))
    assert other.param_groups[0]["norm"] == "muon"


def test_newton_muon_names_a_sparse_gradient():
    """A sparse embedding in Newton-Muon's matrix group: the step refuses its sparse gradient naming the
    parameter, with Muon's message, before any weight changes (the capture hook used to fail first in
    the forward pass on the token ids' width, blaming the hook)."""
    from dobb.baselines import Muon, NewtonMuon

    messages = []
    for cls in (Muon, NewtonMuon):
        model = Net(sparse=True)
        named = [("emb.weight", model.emb.weight), ("hidden.weight", model.hidden.weight)]
        opt = cls([{"params": named}], lr=0.01, **({"model": model} if cls is NewtonMuon else {}))
        backward(model, 0)
        before = [p.detach().clone() for p in model.parameters()]
        with pytest.raises(RuntimeError, match=r"does not support sparse gradients") as err:
            opt.step()
        messages.append(str(err.value).replace(cls.__name__, "<cls>"))
        assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert messages[0] == messages[1]
    assert "(emb.weight has a torch.sparse_coo gradient)" in messages[1]


@pytest.mark.parametrize("name", ["dobb", "dobb-g", "dobb-muon", "newton-muon", "soap"])
def test_skip_on_a_refresh_step_keeps_the_schedule(name):
    """A skipped refresh step: its counts come back when its flag is read (the next step), after the
    forward pass in between, so Dobb's capture hooks were armed for both outcomes; the run then equals
    the one that never saw the bad step (refresh every 2 steps; the bad step is a refresh step)."""
    kw = {"precondition_frequency": 2} if name == "soap" else {"refresh_every": 2}
    ref, ref_opt = Net(), None
    ref_opt = build(name, ref, **kw)
    sk = Net()
    sk_opt = build(name, sk, nonfinite="skip", **kw)
    for t in range(2):
        for m, o in ((ref, ref_opt), (sk, sk_opt)):
            o.zero_grad()
            backward(m, t)
            o.step()
    sk_opt.zero_grad()
    backward(sk, 2)
    poison(sk, "hidden.weight")
    before = everything(sk, sk_opt)
    sk_opt.step()
    assert_same(everything(sk, sk_opt), before)
    for t in (2, 3, 4):
        for m, o in ((ref, ref_opt), (sk, sk_opt)):
            o.zero_grad()
            backward(m, t)
            o.step()
    assert_same(everything(sk, sk_opt), everything(ref, ref_opt), groups=False)
