"""dobb._base.MatrixOptimizer, the class every optimizer of the package derives from, against
``torch.optim.AdamW`` (torch's own optimizer is the reference; ``"adamw"`` is torch's AdamW itself, so
the parametrized tests run the reference too):

- the AdamW part (``"algorithm": "adamw"`` groups) steps bitwise as ``torch.optim.AdamW``, for every
  matrix class of the registry; it goes through torch's own group checks: a sparse gradient raises
  torch's ``RuntimeError`` before any weight or state changes, complex parameters step as torch's;
- a negative, NaN or many-element tensor ``lr`` is a ``ValueError``, as in ``torch.optim.AdamW``; a
  complex weight in a matrix group is a ``ValueError`` naming it (a matrix update is real);
- param-group validation: unknown arguments and keys, rates, ``tau``, 1-D weights, named in the error;
- ``state_dict`` round trip: a resumed optimizer continues bitwise; the legacy ``momentum_buffer`` key
  loads; a state saved for another layout is refused naming the parameter; parameters without a
  gradient are left alone;
- per-matrix plans are derived state: rebuilt from the loaded groups (a state saved with other
  block options continues as the saved run) and in a copy, and a step rebinds or refills no
  attribute of the optimizer.
"""
from __future__ import annotations

import copy
import inspect

import pytest
import torch
from torch import nn

import dobb
from _baseline_refs import data, mlp
from _baseline_refs import train as train_mlp
from _contract_net import MATRIX_NAMES, Net, backward, build, same, snapshot, train
from dobb.baselines import RMNP, BlockMuon, Dion, Dion2, Muon, PeriodicRowMuon
from dobb.factory import OPTIMIZER_NAMES

# the baselines whose shared behaviour (validation, frozen parameters, legacy keys) is checked here
BASELINES = [Muon, Dion, RMNP, PeriodicRowMuon, BlockMuon, Dion2]


# every matrix class of the registry (each one compared, not only the last)
MATRIX_CLASSES = sorted({e.cls for e in dobb.registry.OPTIMIZERS.values() if e.is_matrix}, key=lambda c: c.__name__)


@pytest.mark.parametrize("cls", MATRIX_CLASSES, ids=lambda c: c.__name__)
def test_adamw_groups_match_torch_adamw(cls):
    """The default AdamW part is torch's fused kernel (on this CPU): bitwise ``AdamW(fused=True)``;
    against the unfused loop, to rounding: ``test_adamw_part_defaults_to_the_fused_kernel_...``."""
    ref, ours = mlp(), mlp()
    torch_opt = torch.optim.AdamW(ref.parameters(), lr=0.01, weight_decay=0.05, betas=(0.9, 0.95), fused=True)
    groups = [{"params": list(ours.parameters()), "algorithm": "adamw"}]
    hooked = {"model": ours} if "model" in inspect.signature(cls.__init__).parameters else {}
    train_mlp(ours, cls(groups, lr=0.01, weight_decay=0.05, **hooked), 4)
    train_mlp(ref, torch_opt, 4)
    for p, q in zip(ref.parameters(), ours.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("cls", BASELINES)
def test_validation_names_argument(cls):
    model = mlp()
    groups = lambda: dobb.param_groups(model, algorithm=cls.algorithm)  # noqa: E731
    for kw, arg in [({"lr": -1.0}, "lr"), ({"lr": 0.1, "weight_decay": -0.1}, "weight_decay"),
                    ({"lr": 0.1, "tau": 0.0}, "tau"), ({"lr": 0.1, "momentum": 1.0}, "momentum")]:
        with pytest.raises(ValueError, match=rf"\b{arg}( must|=)"):
            cls(groups(), **kw)
    with pytest.raises(ValueError, match="bogus"):
        cls(groups(), lr=0.1, bogus=1)
    bad = [{"params": [("0.bias", model[0].bias)], "algorithm": cls.algorithm}]
    with pytest.raises(ValueError, match=r"0\.bias is 1-D"):
        cls(bad, lr=0.1)


@pytest.mark.parametrize("cls", BASELINES)
def test_params_without_grad_untouched(cls):
    model = mlp()
    opt = cls(dobb.param_groups(model, algorithm=cls.algorithm), lr=0.1, weight_decay=0.1)
    frozen = model[2].weight
    before = frozen.detach().clone()
    state_before = {k: v.clone() if torch.is_tensor(v) else v for k, v in opt.state[frozen].items()}
    X, Y = data()
    for _ in range(3):
        opt.zero_grad()
        ((model(X) - Y) ** 2).mean().backward()
        frozen.grad = None
        opt.step()
    assert torch.equal(frozen, before)
    for k, v in state_before.items():
        assert torch.equal(opt.state[frozen][k], v) if torch.is_tensor(v) else opt.state[frozen][k] == v


@pytest.mark.parametrize("cls", BASELINES)
def test_one_momentum_key_and_old_checkpoints_load(cls):
    """Every optimizer keeps its momentum under "momentum"; a state dict saved with torch's
    "momentum_buffer" key (earlier Muon-family and RMNP releases) resumes the same run."""
    model = mlp()
    opt = cls(dobb.param_groups(model, algorithm=cls.algorithm), lr=0.01)
    train_mlp(model, opt, 2)
    assert all("momentum" in opt.state[p] and "momentum_buffer" not in opt.state[p] for p in opt.iter_matrix_params())
    sd = copy.deepcopy(opt.state_dict())  # torch's state_dict shares storage with the live state
    old = {**sd, "state": {i: {("momentum_buffer" if k == "momentum" else k): v for k, v in st.items()}
                           for i, st in sd["state"].items()}}
    twin = mlp()
    twin.load_state_dict(model.state_dict())
    fresh = cls(dobb.param_groups(twin, algorithm=cls.algorithm), lr=0.01)
    fresh.load_state_dict(old)
    train_mlp(model, opt, 2)
    train_mlp(twin, fresh, 2)
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", MATRIX_NAMES)
def test_sparse_gradient_in_the_adamw_part_raises_torchs_error_before_any_change(name):
    ref_model = Net(sparse=True)
    ref = torch.optim.AdamW(ref_model.parameters(), lr=0.01)
    backward(ref_model, 0)
    with pytest.raises(RuntimeError) as torch_error:
        ref.step()

    model = Net(sparse=True)
    opt = build(name, model)
    backward(model, 0)
    before = snapshot(model, opt)
    with pytest.raises(RuntimeError) as ours:
        opt.step()
    assert str(ours.value) == str(torch_error.value)
    assert same(before, snapshot(model, opt))


@pytest.mark.parametrize("name", OPTIMIZER_NAMES)
def test_sparse_gradient_of_a_matrix_raises_before_any_change(name):
    model = Net()
    opt = build(name, model)
    backward(model, 0)
    model.hidden.weight.grad = model.hidden.weight.grad.to_sparse()
    before = snapshot(model, opt)
    with pytest.raises(RuntimeError, match="sparse"):  # torch.optim.AdamW: RuntimeError too
        opt.step()
    after = snapshot(model, opt)
    assert same(before[0], after[0])  # no weight changed (torch's AdamW too, in one group)
    if name in MATRIX_NAMES:  # nor any state (torch's AdamW creates some lazily)
        assert same(before[1], after[1])


def _beside_torch_adamw(model, opt, parts, steps: int, *, foreach: bool):
    """Steps ``opt`` ``steps`` times and, beside it, a ``torch.optim.AdamW`` per AdamW part on clones
    of that part's parameters fed the same gradients; returns the clones and the references."""
    clones = [[p.detach().clone().requires_grad_() for p in g["params"]] for g in parts]
    refs = [torch.optim.AdamW(c, lr=g["lr"], betas=g["adamw_betas"], eps=g["adamw_eps"],
                              weight_decay=g["weight_decay"], foreach=foreach) for g, c in zip(parts, clones)]
    for t in range(steps):
        opt.zero_grad()
        backward(model, t)
        for g, c in zip(parts, clones):
            for p, q in zip(g["params"], c):
                q.grad = None if p.grad is None else p.grad.clone()
        opt.step()
        for r in refs:
            r.step()
    return clones, refs


@pytest.mark.parametrize("name", MATRIX_NAMES)
def test_complex_parameter_of_the_adamw_part_steps_as_torch_adamw(name):
    model = Net(complex_gain=True)
    # every name decays: one AdamW group, the complex one's foreach kernel (the reference's)
    opt = build(name, model, decay_names=[n for n, _ in model.named_parameters()])
    parts = [g for g in opt.param_groups if g["algorithm"] == "adamw"]
    assert any(p is model.gain for g in parts for p in g["params"])
    clones, refs = _beside_torch_adamw(model, opt, parts, 3, foreach=True)
    assert model.gain.grad.imag.abs().max() > 0
    for g, c in zip(parts, clones):
        for p, q in zip(g["params"], c):
            assert torch.equal(p.detach(), q.detach()), (p.shape, p.dtype)


@pytest.mark.parametrize("name", MATRIX_NAMES)
def test_complex_matrix_is_a_value_error_naming_it(name):
    model = Net(complex_matrix=True)
    torch.optim.AdamW(model.parameters(), lr=0.01)  # torch's AdamW takes it (as real pairs)
    with pytest.raises(ValueError, match=r"hidden\.weight.*complex"):
        build(name, model)


BAD_LRS = {"negative": torch.tensor(-0.01), "nan": torch.tensor(float("nan")),
           "two-element": torch.tensor([0.01, 0.02])}


@pytest.mark.parametrize("bad", BAD_LRS)
@pytest.mark.parametrize("name", OPTIMIZER_NAMES)
def test_bad_tensor_lr_is_a_value_error_as_in_torch_adamw(name, bad):
    lr = BAD_LRS[bad]
    with pytest.raises(ValueError):
        torch.optim.AdamW(Net().parameters(), lr=lr)
    with pytest.raises(ValueError, match="(?i)lr|learning rate"):
        dobb.build_optimizer(name, Net(), lr=lr, weight_decay=0.1)


@pytest.mark.parametrize("name", MATRIX_NAMES)
def test_bad_tensor_lr_refused_by_add_param_group_and_load_state_dict(name):
    """Stricter than torch's AdamW, which checks only its constructor: a group added, or a state
    loaded, with a negative tensor lr is refused, and a refused load changes nothing."""
    model = Net()
    opt = dobb.build_optimizer(name, model, lr=torch.tensor(0.01), weight_decay=0.1)
    train(model, opt, 1)
    with pytest.raises(ValueError, match="lr"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(3))], "algorithm": "adamw",
                             "lr": torch.tensor(-0.01)})
    saved = opt.state_dict()
    saved["param_groups"][0]["lr"] = torch.tensor(-0.01)
    before = snapshot(model, opt)
    with pytest.raises(ValueError, match="lr of saved param group 0"):
        opt.load_state_dict(saved)
    assert same(before, snapshot(model, opt))
    assert float(opt.param_groups[0]["lr"]) == pytest.approx(0.01)


# ----------------------------------------------------------------------------- param-group validation
@pytest.mark.parametrize("group,message", [
    ({"algorithm": "dion"}, "algorithm must be 'adamw' or 'muon', got 'dion'"),
    ({"adamw_betas": (0.9, 1.0)}, "adamw_betas must be two numbers in [0, 1), got (0.9, 1.0)"),
    ({"adamw_eps": 0.0}, "adamw_eps must be a finite number > 0, got 0.0"),
    ({"tau": 0.0}, "tau must be a finite number > 0, got 0.0"),
    ({"transposed": 1}, "transposed must be True or False, got 1"),
    ({"weight_decay": float("inf")}, "weight_decay must be a finite number >= 0, got inf"),
])
def test_bad_group_value_is_a_value_error_naming_the_key(group, message):
    """The whole message is compared: it is what a user reads (the key, the valid values, the value)."""
    w = nn.Parameter(torch.zeros(6, 8))
    with pytest.raises(ValueError) as err:
        Muon([{"params": [w], **group}], lr=0.1)
    assert str(err.value) == message


def test_unknown_group_key_lists_the_valid_ones():
    w = nn.Parameter(torch.zeros(6, 8))
    with pytest.raises(ValueError) as err:
        Muon([{"params": [w], "bogus": 1}], lr=0.1)
    msg = str(err.value)
    assert msg.startswith("param group has unknown key(s) ['bogus']; valid: ")
    assert all(repr(k) in msg for k in ("lr", "weight_decay", "tau", "ns_steps", "algorithm"))


# ----------------------------------------------------------------------------- state_dict round trip
@pytest.mark.parametrize("name", MATRIX_NAMES)
def test_state_dict_round_trip_resumes_bitwise(name):
    """Saved through torch.save / torch.load(weights_only=True) mid-training and loaded into a new
    optimizer on a copy of the model, the run continues bitwise as the original, weights and every
    state tensor (the reference is the uninterrupted run). Net has a ``transposed=True`` weight:
    its state rests under the weight, not under the transposed view the step uses, so it must map
    by parameter. (tests/test_factory.py resumes each optimizer with a scheduler on a plain MLP.)"""
    import io

    model = Net()
    opt = build(name, model)
    train(model, opt, 2)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    twin = Net()
    twin.load_state_dict(saved["model"])
    fresh = build(name, twin)
    fresh.load_state_dict(saved["opt"])
    train(model, opt, 2, start=2)
    train(twin, fresh, 2, start=2)
    for (n, p), q in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(p, q), n
    assert same(snapshot(model, opt)[1], snapshot(twin, fresh)[1])


def test_state_of_another_layout_is_refused_naming_the_parameter_and_changes_nothing():
    """A state saved with another rank (Dion's ``Q``) would load and fail, or misbehave, later."""
    w = nn.Parameter(torch.randn(12, 8, generator=torch.Generator().manual_seed(0)))
    saved = Dion([("w", w)], lr=0.1, rank_fraction=0.5).state_dict()
    mine = Dion([("w", w)], lr=0.1, rank_fraction=1.0)
    q = mine.state[w]["Q"].clone()
    with pytest.raises(ValueError) as err:
        mine.load_state_dict(saved)
    assert str(err.value) == ("w: saved state 'Q' has shape (12, 4), but this optimizer's layout needs (12, 8) "
                              "(saved with other blocks, side, rank or weight shape?)")
    assert torch.equal(mine.state[w]["Q"], q) and mine.param_groups[0]["rank_fraction"] == 1.0


def test_integer_state_saved_as_tensors_loads_as_ints():
    """torch.distributed.checkpoint hands Python ints back as tensors; the counters (``step``,
    ``captures``) are ints again after the load, and the run continues as the uninterrupted one."""
    model = Net()
    opt = build("dobb", model, refresh_every=2)
    train(model, opt, 3)
    sd = copy.deepcopy(opt.state_dict())
    # the matrices' counters (the AdamW part keeps torch's tensor step): the step and a 2-D matrix's
    # capture count are saved as ints (the state's [[c]]: one side, one matrix)
    matrices = [i for i, st in sd["state"].items() if "captures" in st]
    assert len(matrices) == len(list(opt.iter_matrix_params()))
    for i in matrices:
        st = sd["state"][i]
        assert type(st["step"]) is int and type(st["captures"]) is int
        st["step"], st["captures"] = torch.tensor(st["step"]), torch.tensor(st["captures"])
    twin = Net()
    twin.load_state_dict(model.state_dict())
    fresh = build("dobb", twin, refresh_every=2)
    fresh.load_state_dict(sd)
    for p, q in zip(opt.iter_matrix_params(), fresh.iter_matrix_params()):
        assert type(fresh.state[q]["step"]) is int and fresh.state[q]["step"] == opt.state[p]["step"]
        caps = fresh.state[q]["captures"]
        assert [[type(c) for c in side] for side in caps] == [[int]] and caps == opt.state[p]["captures"]
    train(model, opt, 3, start=3)
    train(twin, fresh, 3, start=3)
    for (n, p), q in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(p, q), n


# ----------------------------------------------------------------------------- the AdamW part, tensor lr
def test_tensor_lr_adamw_part_equals_torch_adamw_with_the_same_tensor_lr():
    """A scheduler holding the lr in a tensor: the AdamW part takes torch's single-tensor path, as
    ``torch.optim.AdamW(foreach=False)`` does with that tensor, and the two agree bitwise, also after
    the tensor is changed in place between steps."""
    ref, ours = mlp(), mlp()
    lr_ref, lr_ours = torch.tensor(0.01), torch.tensor(0.01)
    torch_opt = torch.optim.AdamW(ref.parameters(), lr=lr_ref, weight_decay=0.05, betas=(0.9, 0.95), foreach=False)
    opt = Muon([{"params": list(ours.parameters()), "algorithm": "adamw"}], lr=lr_ours, weight_decay=0.05)
    for lr in (0.01, 0.003):
        lr_ref.fill_(lr)
        lr_ours.fill_(lr)
        train_mlp(ref, torch_opt, 2)
        train_mlp(ours, opt, 2)
    for p, q in zip(ref.parameters(), ours.parameters()):
        assert torch.equal(p, q)


# ----------------------------------------------------------------------------- fused / foreach
@pytest.mark.parametrize("fused,foreach", [(True, None), (None, False), (None, True), (False, None)])
def test_fused_and_foreach_of_the_adamw_part_are_torch_adamws(fused, foreach, monkeypatch):
    """An ``"adamw"`` group's ``fused``/``foreach`` reach torch's AdamW kernel (spied on) and give
    ``torch.optim.AdamW`` with the same flags bitwise, steps on the CPU included."""
    import dobb._base as base

    seen = []
    kernel = base._torch_adamw
    monkeypatch.setattr(base, "_torch_adamw", lambda *a, **k: (seen.append((k["fused"], k["foreach"])), kernel(*a, **k)))
    ref, ours = mlp(), mlp()
    torch_opt = torch.optim.AdamW(ref.parameters(), lr=0.01, weight_decay=0.05, betas=(0.9, 0.95),
                                  fused=fused, foreach=foreach)
    flags = {k: v for k, v in (("fused", fused), ("foreach", foreach)) if v is not None}
    opt = Muon([{"params": list(ours.parameters()), "algorithm": "adamw", **flags}], lr=0.01, weight_decay=0.05)
    train_mlp(ref, torch_opt, 4)
    train_mlp(ours, opt, 4)
    for p, q in zip(ref.parameters(), ours.parameters()):
        assert torch.equal(p, q)
    assert seen and all(s == (bool(fused), foreach if foreach is not None else not fused) for s in seen), seen
    if fused:  # torch keeps a fused step's counter on the parameter's device
        assert all(opt.state[p]["step"].device == p.device for p in ours.parameters())


@pytest.mark.parametrize("flags,message", [
    ({"fused": True}, "fused=True: the matrix step has no fused kernel"),
    ({"foreach": False}, "foreach=False: the matrix step has only its foreach implementation"),
    ({"fused": True, "algorithm": "adamw", "params": [nn.Parameter(torch.zeros(3, dtype=torch.int32),
                                                                    requires_grad=False)]},
     "fused=True: parameter #0 (shape (3,)) (torch.int32 on cpu) has no fused AdamW kernel"),
])
def test_fused_or_foreach_a_kernel_cannot_honour_is_refused(flags, message):
    w = nn.Parameter(torch.zeros(6, 8))
    with pytest.raises(ValueError) as err:
        Muon([{"params": [w], **flags}], lr=0.1)
    assert str(err.value).startswith(message)
    Muon([{"params": [w], "fused": False, "foreach": True}], lr=0.1)  # what the matrix step does: accepted


# ----------------------------------------------------------------------------- the default AdamW kernel
def _spied_flags(monkeypatch):
    import dobb._base as base

    seen = []
    kernel = base._torch_adamw
    monkeypatch.setattr(base, "_torch_adamw", lambda *a, **k: (seen.append((k["fused"], k["foreach"])), kernel(*a, **k)))
    return seen


@pytest.mark.parametrize("name", MATRIX_NAMES)
def test_adamw_part_defaults_to_the_fused_kernel_and_equals_unfused_torch_adamw(name, monkeypatch):
    """With neither ``fused`` nor ``foreach`` set, every matrix optimizer's AdamW part runs torch's
    fused kernel (on this CPU), and its weights and moments after 5 steps equal those of an
    independent ``torch.optim.AdamW(foreach=False)`` (the single-tensor for-loop) fed the same
    gradients, to float32 rounding."""
    seen = _spied_flags(monkeypatch)
    model = Net()
    opt = build(name, model)
    parts = [g for g in opt.param_groups if g["algorithm"] == "adamw"]
    clones, refs = _beside_torch_adamw(model, opt, parts, 5, foreach=False)
    assert seen and all(s == (True, False) for s in seen), seen
    moved = 0
    for g, c, r in zip(parts, clones, refs):
        for p, q in zip(g["params"], c):
            if q.grad is None:
                continue
            moved += 1
            torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-6, atol=1e-7)
            for key in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(opt.state[p][key], r.state[q][key], rtol=1e-6, atol=1e-9)
            assert float(opt.state[p]["step"]) == float(r.state[q]["step"]) == 5.0
    assert moved


@pytest.mark.parametrize("flags,expected", [({"fused": False}, (False, True)), ({"foreach": True}, (False, True)),
                                            ({"foreach": False}, (False, False)), ({"fused": True}, (True, False))])
def test_an_explicit_kernel_flag_of_the_adamw_part_is_honoured(flags, expected, monkeypatch):
    seen = _spied_flags(monkeypatch)
    model = mlp()
    opt = Muon([{"params": list(model.parameters()), "algorithm": "adamw", **flags}], lr=0.01)
    train_mlp(model, opt, 2)
    assert seen == [expected, expected]


def test_adamw_part_without_a_fused_kernel_falls_back_to_foreach(monkeypatch):
    """A complex parameter has no fused kernel: the group runs torch's foreach kernel (as before);
    an int parameter without a gradient does not stop the others from fusing."""
    from dobb._base import adamw_kernel_flags

    seen = _spied_flags(monkeypatch)
    model = Net(complex_gain=True)
    opt = build("muon", model, decay_names=[n for n, _ in model.named_parameters()])  # one AdamW group
    opt.zero_grad()
    backward(model, 0)
    opt.step()
    (flags,) = [s for s in seen]
    assert flags == (False, True)
    group = {"lr": 0.1, "fused": None, "foreach": None}
    assert adamw_kernel_flags(group, [torch.zeros(3)]) == (True, False)
    assert adamw_kernel_flags(group, [torch.zeros(3, dtype=torch.complex64)]) == (False, True)
    assert adamw_kernel_flags(dict(group, lr=torch.tensor(0.1)), [torch.zeros(3)]) == (False, False)


# ----------------------------------------------------------------------------- per-matrix plans (derived state)
# Options that shape a plan and no state tensor: a state saved under one loads under the other.
PLAN_OPTIONS = {"block-muon": ({"blocks": 2}, {"blocks": 3}),
                "muonbp": ({"blocks": 2, "period": 2}, {"blocks": 3, "period": 2}),
                "dion2": ({"select": "shard", "blocks": 2}, {"select": "shard", "blocks": 3})}


@pytest.mark.parametrize("name", sorted(PLAN_OPTIONS))
def test_plans_follow_the_loaded_groups(name):
    """A state saved with ``saved`` options and loaded into an optimizer built with ``other`` ones
    (torch's load takes the saved group values) continues bitwise as the uninterrupted ``saved`` run:
    the plans are rebuilt from the loaded groups, not kept from construction. The two options
    give different numbers (checked), so a stale plan fails the comparison."""
    saved_kw, other_kw = PLAN_OPTIONS[name]
    model = Net()
    opt = build(name, model, **saved_kw)
    train(model, opt, 2)
    saved_model, saved_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    train(model, opt, 3, start=2)

    twin = Net()
    twin.load_state_dict(saved_model)
    resumed = build(name, twin, **other_kw)
    resumed.load_state_dict(saved_opt)
    assert all(g[k] == v for g in resumed.param_groups if g["algorithm"] != "adamw" for k, v in saved_kw.items())
    train(twin, resumed, 3, start=2)
    for (n, p), q in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(p, q), n

    other = Net()
    other.load_state_dict(saved_model)
    stale = build(name, other, **other_kw)
    train(other, stale, 3, start=2)
    assert not torch.equal(other.hidden.weight, model.hidden.weight)  # the options do change the numbers


def _matrices_as_stepped(opt):
    """The matrices of the optimizer as its update sees them (a transposed group's views)."""
    return [opt._views.get(p, p) for g in opt.param_groups if g["algorithm"] != "adamw" for p in g["params"]]


@pytest.mark.parametrize("how", ["load", "deepcopy"])
@pytest.mark.parametrize("name", MATRIX_NAMES)
def test_plans_are_rebuilt_after_a_load_and_in_a_copy(name, how):
    """Every matrix has a plan keyed by the matrix the update steps (in a copy: the copy's), rebuilt
    (a new object) after ``load_state_dict`` and in a copy, never carried by the copy; the rebuilt
    optimizer continues bitwise as the uninterrupted run (the reference)."""
    model = Net()
    opt = build(name, model)
    train(model, opt, 2)
    if how == "deepcopy" and any(isinstance(v, nn.Module) for v in vars(opt).values()):
        pytest.skip("an optimizer hooking a model refuses copies (tests/test_copies.py)")
    before = dict(opt._plans)
    if how == "load":  # into itself: the groups are replaced, the plans rebuilt
        twin, again = model, opt
        snap = snapshot(model, opt)
        opt.load_state_dict(copy.deepcopy(opt.state_dict()))
        assert same(snapshot(model, opt), snap)
    else:
        assert "_plans" not in opt.__getstate__()["_matrix_optimizer_attributes"]
        twin, again = copy.deepcopy((model, opt))
    mats = _matrices_as_stepped(again)
    has_plans = type(again)._group_plans is not dobb._base.MatrixOptimizer._group_plans
    assert [id(p) for p in again._plans] == ([id(p) for p in mats] if has_plans else [])
    fresh = [v for v in again._plans.values() if v is not None and not isinstance(v, int)]
    assert all(all(v is not old for old in before.values()) for v in fresh)
    ref_model = Net()  # the uninterrupted run
    ref_opt = build(name, ref_model)
    train(ref_model, ref_opt, 4)
    train(twin, again, 2, start=2)
    for (n, p), q in zip(ref_model.named_parameters(), twin.parameters()):
        assert torch.equal(p, q), n
    assert same(snapshot(ref_model, ref_opt)[1], snapshot(twin, again)[1])


@pytest.mark.parametrize("name", MATRIX_NAMES)
def test_a_step_rebinds_and_fills_no_attribute_of_the_optimizer(name):
    """What a step writes is the state: no attribute of the optimizer is rebound, added or (for a
    dict: its plans, views, names) refilled by a step after the first."""
    def attributes(o):
        return {k: (id(v), [(id(a), id(b)) for a, b in v.items()] if isinstance(v, dict) else None)
                for k, v in vars(o).items()
                if k not in ("state", "param_groups", "defaults") and not k.startswith("_optimizer_")}

    model = Net()
    opt = build(name, model)
    train(model, opt, 1)
    first = attributes(opt)
    train(model, opt, 2, start=1)
    assert attributes(opt) == first


# ----------------------------------------------------------------------------- the AdamW part (issue 53, item 8)
def _adamw_part_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(32, 16), nn.Linear(16, 24), nn.LayerNorm(24), nn.Linear(24, 32))


@pytest.mark.parametrize("name", ["muon", "dobb", "soap"])
def test_adamw_part_has_its_own_lr_and_no_decay_on_1d_params_bitwise_as_torch_adamw(name):
    """``adamw_lr`` is the AdamW groups' ``lr``; by default the 1-D parameters (biases, norm weights)
    get no weight decay and the 2-D ones (embedding, head) the group's: bitwise what
    torch.optim.AdamW does with those two param groups, under a LambdaLR that scales every group."""
    model = _adamw_part_model()
    ref_model = _adamw_part_model()
    opt = dobb.build_optimizer(name, model, lr=0.05, weight_decay=0.1, adamw_lr=3e-3)
    by_name = dict(ref_model.named_parameters())
    two_d, one_d = ["0.weight", "3.weight"], ["1.bias", "2.weight", "2.bias", "3.bias"]
    ref = torch.optim.AdamW([{"params": [by_name[n] for n in two_d]},
                             {"params": [by_name[n] for n in one_d], "weight_decay": 0.0}],
                            lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=True)
    assert [g["lr"] for g in opt.param_groups if g["algorithm"] != "adamw"] == [0.05]
    assert [(g["lr"], g["weight_decay"]) for g in opt.param_groups if g["algorithm"] == "adamw"] == [
        (3e-3, 0.1), (3e-3, 0.0)]
    factor = lambda s: 0.5 ** s  # noqa: E731
    sched, ref_sched = torch.optim.lr_scheduler.LambdaLR(opt, factor), torch.optim.lr_scheduler.LambdaLR(ref, factor)
    gen = torch.Generator().manual_seed(1)
    for _ in range(4):
        for (n, p), (_, q) in zip(model.named_parameters(), ref_model.named_parameters()):
            p.grad = torch.randn(p.shape, generator=gen)
            q.grad = p.grad.clone()
        opt.step()
        ref.step()
        sched.step()
        ref_sched.step()
    for n in two_d + one_d:
        assert torch.equal(dict(model.named_parameters())[n], by_name[n]), n
    # the scheduler scaled the AdamW part from adamw_lr, the matrices from lr: their ratio is kept
    lrs = sorted(float(g["lr"]) for g in opt.param_groups)
    assert lrs == sorted([0.05 * 0.5**4] + [3e-3 * 0.5**4] * 2)
    getattr(opt, "remove_hooks", lambda: None)()


def test_adamw_lr_none_is_the_matrix_lr_and_a_group_lr_wins():
    model = _adamw_part_model()
    opt = dobb.build_optimizer("muon", model, lr=0.05)
    assert {g["lr"] for g in opt.param_groups} == {0.05}
    groups = dobb.param_groups(model, "muon")
    groups[1]["lr"] = 1e-4  # an explicit lr of an AdamW group is kept
    opt = dobb.Muon(groups, lr=0.05, adamw_lr=2e-3)
    assert [g["lr"] for g in opt.param_groups] == [0.05, 1e-4, 2e-3]


@pytest.mark.parametrize("value", [-1.0, float("inf"), "3e-3", True])
def test_bad_adamw_lr_is_a_value_error_naming_it(value):
    model = _adamw_part_model()
    with pytest.raises(ValueError, match="adamw_lr"):
        dobb.build_optimizer("muon", model, lr=0.05, adamw_lr=value)
    with pytest.raises(ValueError, match="adamw_lr"):
        dobb.Muon(dobb.param_groups(model, "muon"), lr=0.05, adamw_lr=value)


def test_every_matrix_name_takes_adamw_lr():
    for name, entry in dobb.registry.OPTIMIZERS.items():
        assert ("adamw_lr" in dobb.valid_hparams(name)) == entry.is_matrix, name
