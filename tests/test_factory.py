"""build_optimizer: names, hyperparameter errors, presets, training, and exact resume for each."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import dobb
from dobb.factory import valid_hparams

NAMES = ["adamw", "muon", "owner-muon", "dion", "rmnp", "pr-muon", "block-muon", "dion2", "normuon", "dion3", "dobb", "dobb-l2", "dobb-g",
         "dobb-g-l2"]


def model_and_data(seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 8))
    g = torch.Generator().manual_seed(1)
    X = torch.randn(128, 16, generator=g)
    Y = torch.sin(X[:, :8] * 2) + 0.1 * torch.randn(128, 8, generator=g)
    return model, X, Y


def loss_of(model, X, Y):
    return ((model(X) - Y) ** 2).mean()


def run(model, opt, X, Y, steps, sched=None):
    for _ in range(steps):
        opt.zero_grad()
        loss_of(model, X, Y).backward()
        opt.step()
        if sched is not None:
            sched.step()


def test_names():
    # the registry may grow; the names the docs and records use stay
    assert set(NAMES) <= set(dobb.OPTIMIZER_NAMES) and dobb.OPTIMIZER_NAMES[0] == "adamw"


def test_unknown_name_lists_valid_names():
    model, _, _ = model_and_data()
    with pytest.raises(ValueError) as err:
        dobb.build_optimizer("adamx", model, lr=0.1, weight_decay=0.0)
    assert "adamx" in str(err.value) and all(n in str(err.value) for n in NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_unknown_hparam_lists_valid_hparams(name):
    model, _, _ = model_and_data()
    with pytest.raises(ValueError) as err:
        dobb.build_optimizer(name, model, lr=0.1, weight_decay=0.0, rank_fractoin=0.5)
    msg = str(err.value)
    assert "rank_fractoin" in msg and all(k in msg for k in valid_hparams(name))


def test_hparams_per_optimizer():
    assert "rank_fraction" in valid_hparams("dion") and "rank_fraction" not in valid_hparams("muon")
    assert {"period", "nesterov"} <= set(valid_hparams("pr-muon"))
    assert {"blocks", "axis"} <= set(valid_hparams("block-muon"))
    assert "fraction" in valid_hparams("dion2")
    assert "betas" in valid_hparams("adamw") and "tau" not in valid_hparams("adamw")
    assert "norm" in valid_hparams("dobb") and "norm" not in valid_hparams("dobb-l2")


def test_preset_argument_is_rejected_with_reason():
    model, _, _ = model_and_data()
    with pytest.raises(ValueError, match=r"'dobb-l2' fixes norm='l2'"):
        dobb.build_optimizer("dobb-l2", model, lr=0.1, weight_decay=0.0, norm="sign")


def test_presets_and_groups():
    model, _, _ = model_and_data()
    for name, cls in [("muon", dobb.Muon), ("dion", dobb.Dion), ("rmnp", dobb.RMNP), ("pr-muon", dobb.PeriodicRowMuon),
                      ("block-muon", dobb.BlockMuon), ("dion2", dobb.Dion2), ("dobb", dobb.Dobb)]:
        opt = dobb.build_optimizer(name, model, lr=0.1, weight_decay=0.01)
        assert type(opt) is cls
        algos = [g["algorithm"] for g in opt.param_groups]
        assert algos == [cls.algorithm, "adamw"]
        matrix, other = opt.param_groups
        assert [p.shape for p in matrix["params"]] == [(32, 16), (32, 32), (8, 32)]
        assert all(p.dim() == 1 for p in other["params"]) and other["adamw_betas"] == (0.9, 0.95)
        if hasattr(opt, "remove_hooks"):
            opt.remove_hooks()
    g = dobb.build_optimizer("dobb-g-l2", model, lr=0.1, weight_decay=0.0).param_groups[0]
    assert (g["side"], g["source"], g["norm"]) == ("output", "output_grad", "l2")
    assert dobb.build_optimizer("dobb-l2", model, lr=0.1, weight_decay=0.0).param_groups[0]["norm"] == "l2"
    opt = dobb.build_optimizer("dion", model, lr=0.1, weight_decay=0.0, rank_fraction=0.5, tau=0.3)
    assert opt.param_groups[0]["rank_fraction"] == 0.5 and opt.param_groups[0]["tau"] == 0.3


def test_adamw_is_torch_adamw():
    model, _, _ = model_and_data()
    opt = dobb.build_optimizer("adamw", model, lr=0.1, weight_decay=0.01)
    assert type(opt) is torch.optim.AdamW and opt.param_groups[0]["betas"] == (0.9, 0.95)
    assert len(opt.param_groups[0]["params"]) == len(list(model.parameters()))
    opt = dobb.build_optimizer("adamw", model, lr=0.1, weight_decay=0.01, betas=(0.8, 0.99))
    assert opt.param_groups[0]["betas"] == (0.8, 0.99)


@pytest.mark.parametrize("name", NAMES)
def test_bad_lr_is_value_error(name):
    model, _, _ = model_and_data()
    with pytest.raises(ValueError, match="(?i)lr|learning rate"):
        dobb.build_optimizer(name, model, lr=-1.0, weight_decay=0.0)


@pytest.mark.parametrize("name", NAMES)
def test_every_optimizer_decreases_the_loss(name):
    model, X, Y = model_and_data()
    lr = 3e-3 if name == "adamw" else 0.02
    opt = dobb.build_optimizer(name, model, lr=lr, weight_decay=0.01)
    start = loss_of(model, X, Y).item()
    run(model, opt, X, Y, 30)
    end = loss_of(model, X, Y).item()
    assert end < 0.8 * start, (start, end)


@pytest.mark.parametrize("name", NAMES)
def test_state_dict_round_trip_resumes_exactly(name, tmp_path):
    hp = {"refresh_every": 2} if name.startswith("dobb") else {"period": 2} if name == "pr-muon" else {}
    if name in ("dion",):
        hp["qr"] = "rcqr"  # the per-step sketch must resume too

    def make(model):
        opt = dobb.build_optimizer(name, model, lr=0.02, weight_decay=0.01, **hp)
        return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)

    ref, X, Y = model_and_data()
    opt, sched = make(ref)
    run(ref, opt, X, Y, 7, sched)

    model, _, _ = model_and_data()
    opt, sched = make(model)
    run(model, opt, X, Y, 4, sched)
    path = tmp_path / "ckpt.pt"
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()}, path)
    if hasattr(opt, "remove_hooks"):
        opt.remove_hooks()

    fresh, _, _ = model_and_data(seed=5)
    ckpt = torch.load(path, weights_only=True)
    fresh.load_state_dict(ckpt["model"])
    opt2, sched2 = make(fresh)
    opt2.load_state_dict(ckpt["opt"])
    sched2.load_state_dict(ckpt["sched"])
    run(fresh, opt2, X, Y, 3, sched2)
    for p, q in zip(ref.parameters(), fresh.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("name", ["muon", "dion", "rmnp", "block-muon", "dion2"])
def test_lr_scheduler_drives_matrix_and_adamw_groups(name):
    model, X, Y = model_and_data()
    opt = dobb.build_optimizer(name, model, lr=0.05, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.0 if step >= 1 else 1.0)
    run(model, opt, X, Y, 1, sched)
    assert all(g["lr"] == 0.0 for g in opt.param_groups)
    snapshot = [p.detach().clone() for p in model.parameters()]
    run(model, opt, X, Y, 2, sched)  # lr = 0: neither the update nor weight decay moves anything
    assert all(torch.equal(p, q) for p, q in zip(snapshot, model.parameters()))


@pytest.mark.parametrize("name", dobb.OPTIMIZER_NAMES)
def test_tensor_lr_from_a_scheduler_matches_float_lr(name):
    """Schedulers may hold lr as a tensor (capturable/compiled setups): every optimizer takes the same
    steps with lr = tensor(x) as with lr = x, through a scheduler that changes it every step."""
    def run(lr):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8), nn.Linear(8, 4)).double()
        opt = dobb.build_optimizer(name, model, lr=lr, weight_decay=0.1)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** s)
        g = torch.Generator().manual_seed(1)
        for _ in range(3):
            model(torch.randn(5, 8, generator=g, dtype=torch.float64)).square().mean().backward()
            opt.step()
            opt.zero_grad()
            sched.step()
        getattr(opt, "remove_hooks", lambda: None)()
        return torch.cat([p.detach().flatten() for p in model.parameters()]), opt.param_groups[0]["lr"]

    (w_float, lr_float), (w_tensor, lr_tensor) = run(0.01), run(torch.tensor(0.01, dtype=torch.float64))
    assert isinstance(lr_tensor, torch.Tensor) and float(lr_tensor) == pytest.approx(lr_float)
    torch.testing.assert_close(w_tensor, w_float, atol=1e-12, rtol=0)


class _Experts(nn.Module):
    """Three experts, each (6, 8), every row through all of them: one undeclared (E, out, in)
    stack ``w``, or three 2-D parameters (the reference)."""

    def __init__(self, stacked):
        super().__init__()
        w = torch.randn(3, 6, 8, generator=torch.Generator().manual_seed(0), dtype=torch.float64) / 8**0.5
        self.w = nn.Parameter(w) if stacked else nn.ParameterList([nn.Parameter(w[e].clone()) for e in range(3)])

    def forward(self, x):
        w = self.w if isinstance(self.w, nn.Parameter) else torch.stack(list(self.w))
        return torch.tanh(torch.einsum("td,eod->teo", x, w)).sum((1, 2))


def test_experts_names_stacks_for_param_groups():
    """``experts=`` reaches ``dobb.param_groups``: the undeclared stack is a Dobb stack (one
    statistic per expert) and trains as three 2-D matrices under Dobb do; a matrix optimizer that
    takes no stacks leaves it to AdamW, as ``param_groups`` does; a wrong name is its ValueError."""
    hp = dict(source="grad_gram", blocks=2, refresh_every=2, stagger=False, basis_dtype=torch.float64,
              stat_dtype=torch.float64)
    model, ref = _Experts(True), _Experts(False)
    opt = dobb.build_optimizer("dobb", model, lr=0.05, weight_decay=0.01, experts=["w"], **hp)
    ref_opt = dobb.Dobb([{"params": list(ref.w)}], model=ref, lr=0.05, weight_decay=0.01, **hp)
    assert [(g["algorithm"], [p.shape for p in g["params"]]) for g in opt.param_groups] == [("dobb", [(3, 6, 8)])]
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randn(32, 8, generator=g, dtype=torch.float64)
        for m, o in ((model, opt), (ref, ref_opt)):
            m(x).square().mean().backward()
            o.step()
            o.zero_grad()
    assert opt.state[model.w]["captures"] == [[2, 2, 2]]
    torch.testing.assert_close(model.w.detach(), torch.stack([w.detach() for w in ref.w]), atol=1e-12, rtol=0)
    muon = dobb.build_optimizer("muon", model, lr=0.05, experts=["w"])
    assert [g["algorithm"] for g in muon.param_groups] == ["adamw"]
    with pytest.raises(ValueError, match="'nope'"):
        dobb.build_optimizer("dobb", model, lr=0.05, experts=["nope"])


def test_decay_names_reach_adamw_by_name_as_torch_groups():
    """build_optimizer("adamw", decay_names=...) steps exactly like torch's AdamW given the two groups by hand."""
    def model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(6, 6), nn.LayerNorm(6), nn.Linear(6, 3))

    a, b = model(), model()
    decay = ["0.weight", "2.weight"]
    opt_a = dobb.build_optimizer("adamw", a, lr=0.05, weight_decay=0.5, decay_names=decay)
    named = dict(b.named_parameters())
    opt_b = torch.optim.AdamW([{"params": [named[n] for n in named if n in decay]},
                               {"params": [named[n] for n in named if n not in decay], "weight_decay": 0.0}],
                              lr=0.05, weight_decay=0.5, betas=(0.9, 0.95), fused=True)  # the default kernel
    x = torch.randn(16, 6, generator=torch.Generator().manual_seed(1))
    for m, o in ((a, opt_a), (b, opt_b)):
        for _ in range(3):
            o.zero_grad()
            m(x).square().mean().backward()
            o.step()
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)


def test_adamw_entry_is_torch_fused_adamw_by_default_and_equals_the_unfused_kernel():
    """``build_optimizer("adamw")`` builds torch's fused AdamW where torch has it (this CPU), honours
    an explicit flag, and its numbers after 6 steps equal ``torch.optim.AdamW(foreach=False)`` on a
    copy of the model (the single-tensor loop) to float32 rounding."""
    model, X, Y = model_and_data()
    ref = copy.deepcopy(model)
    opt = dobb.build_optimizer("adamw", model, lr=0.01, weight_decay=0.1)
    assert opt.defaults["fused"] is True and not opt.defaults["foreach"]
    plain = torch.optim.AdamW(ref.parameters(), lr=0.01, weight_decay=0.1, betas=(0.9, 0.95), foreach=False)
    run(model, opt, X, Y, 6)
    run(ref, plain, X, Y, 6)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    for flags in ({"fused": False}, {"foreach": True}, {"foreach": False}):
        o = dobb.build_optimizer("adamw", model, lr=0.01, **flags)
        assert not o.defaults["fused"] and o.defaults["foreach"] == flags.get("foreach")
    complex_model = nn.Linear(4, 4).to(torch.complex64)
    o = dobb.build_optimizer("adamw", complex_model, lr=0.01)  # no fused kernel for complex: foreach
    assert not o.defaults["fused"] and o.defaults["foreach"] is True
