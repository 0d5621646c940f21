"""torch.optim's contract, for every optimizer of ``dobb.build_optimizer``, against
``torch.optim.AdamW``'s behaviour in the same case (``"adamw"`` is torch's AdamW itself, so the
parametrized tests run the reference too):

- ``copy.deepcopy`` and ``pickle`` give a copy that steps exactly as the original would, or (for an
  optimizer that hooks a model) a ``TypeError`` naming ``state_dict()``;
- the AdamW part goes through torch's own group checks: a sparse gradient raises torch's
  ``RuntimeError`` before any weight or state changes, complex parameters step as torch's AdamW;
- a negative, NaN or many-element tensor ``lr`` is a ``ValueError``, as in ``torch.optim.AdamW``;
- a complex weight in a matrix group is a ``ValueError`` naming it (torch's AdamW steps it; a
  matrix update is real and would drop the imaginary part).
"""
from __future__ import annotations

import copy
import math
import pickle

import pytest
import torch
from torch import nn

import dobb
from dobb.factory import OPTIMIZER_NAMES

# the registry grows during development: every name is covered without editing this file
MATRIX_NAMES = [n for n in OPTIMIZER_NAMES if n != "adamw"]
V, D = 24, 12


class Transposed(nn.Module):
    """A layer storing its weight (in, out), as Hugging Face's Conv1D: a transposed=True group."""
    dobb_transposed = True

    def __init__(self, n_in, n_out):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n_in, n_out) / math.sqrt(n_in))

    def forward(self, x):
        return x @ self.weight


class Net(nn.Module):
    """Embedding, two hidden matrices (one stored transposed), a head; optionally a sparse
    embedding gradient, a complex gain in the AdamW part, or a complex hidden matrix."""

    def __init__(self, sparse=False, complex_gain=False, complex_matrix=False):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(V, D, sparse=sparse)
        self.hidden = nn.Linear(D, D, dtype=torch.complex64 if complex_matrix else None)
        self.mid = Transposed(D, D)
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, V)
        self.gain = nn.Parameter(torch.randn(D, dtype=torch.complex64)) if complex_gain else None

    def forward(self, tokens):
        h = self.emb(tokens)
        if self.gain is not None:  # a gradient with a nonzero imaginary part reaches the gain
            z = h * self.gain
            h = h + z.real + z.imag
        h = torch.relu(self.hidden(h))
        h = torch.relu(self.mid(h))
        return self.head(self.norm(h))


def batch(t):
    g = torch.Generator().manual_seed(100 + t)
    return torch.randint(0, V, (4, 6), generator=g), torch.randint(0, V, (4, 6), generator=g)


def backward(model, t):
    x, y = batch(t)
    nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()


def train(model, opt, steps, start=0):
    for t in range(start, start + steps):
        opt.zero_grad()
        backward(model, t)
        opt.step()


def build(name, model, **kw):
    return dobb.build_optimizer(name, model, lr=0.01, weight_decay=0.1, **kw)


def snapshot(model, opt):
    """Every weight and every optimizer state tensor, cloned."""
    weights = [p.detach().clone() for p in model.parameters()]
    state = [v.clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v)
             for st in opt.state_dict()["state"].values() for v in st.values()]
    return weights, state


def same(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def holds_model(opt):
    """Whether the optimizer keeps a model (hooks on its layers: Dobb, Newton-Muon)."""
    return any(isinstance(v, nn.Module) for v in vars(opt).values())


# ----------------------------------------------------------------------------- copies
COPIES = {"deepcopy": copy.deepcopy, "pickle": lambda obj: pickle.loads(pickle.dumps(obj))}


@pytest.mark.parametrize("how", COPIES)
@pytest.mark.parametrize("name", OPTIMIZER_NAMES)
def test_copy_steps_as_the_original_or_refuses_naming_state_dict(name, how):
    """A copy of (model, optimizer) taken mid-training continues exactly as the original (torch's
    AdamW: ``name == "adamw"``); an optimizer holding hooks on a model refuses with a TypeError
    naming ``state_dict()``, and the refusal leaves the original training."""
    model = Net()
    opt = build(name, model)
    train(model, opt, 2)
    if holds_model(opt):
        with pytest.raises(TypeError, match=r"state_dict\(\).*load_state_dict\(\)"):
            COPIES[how]((model, opt))
        with pytest.raises(TypeError, match=r"state_dict\(\)"):
            COPIES[how](opt)
        before = snapshot(model, opt)[0]
        train(model, opt, 1, start=2)
        assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
        return
    model2, opt2 = COPIES[how]((model, opt))
    mine = [p for g in opt2.param_groups for p in g["params"]]
    assert {id(p) for p in mine} == {id(p) for p in model2.parameters()}  # steps the copied model
    train(model, opt, 2, start=2)
    train(model2, opt2, 2, start=2)
    for (n, p), q in zip(model.named_parameters(), model2.parameters()):
        assert torch.equal(p, q), n
    assert same(snapshot(model, opt)[1], snapshot(model2, opt2)[1])
    if name in MATRIX_NAMES:  # error messages still name the copy's parameters
        opt2.zero_grad()
        backward(model2, 9)
        model2.hidden.weight.grad = model2.hidden.weight.grad.to_sparse()
        with pytest.raises(RuntimeError, match=r"hidden\.weight"):
            opt2.step()


@pytest.mark.parametrize("how", COPIES)
def test_copy_of_a_dobb_without_model_steps_as_the_original(how):
    """Dobb with source='grad_gram' holds no model: its copy works, module-level sentinels kept
    (adding a group to the copy resolves its statistic group as the original would)."""
    model = Net()
    opt = dobb.Dobb(dobb.param_groups(model, algorithm="dobb", source="grad_gram"), lr=0.01, weight_decay=0.1,
                    refresh_every=2)
    train(model, opt, 3)
    model2, opt2 = COPIES[how]((model, opt))
    for m, o in ((model, opt), (model2, opt2)):
        torch.manual_seed(1)
        extra = nn.Linear(D, D, bias=False)
        m.extra = extra
        o.add_param_group({"params": [extra.weight], "algorithm": "dobb", "source": "grad_gram"})
        for t in range(3, 6):
            o.zero_grad()
            backward(m, t)
            extra.weight.grad = torch.ones_like(extra.weight) * t
            o.step()
    for (n, p), q in zip(model.named_parameters(), model2.parameters()):
        assert torch.equal(p, q), n


# ----------------------------------------------------------------------------- sparse gradients
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


# ----------------------------------------------------------------------------- complex parameters
@pytest.mark.parametrize("name", MATRIX_NAMES)
def test_complex_parameter_of_the_adamw_part_steps_as_torch_adamw(name):
    model = Net(complex_gain=True)
    opt = build(name, model)
    parts = [g for g in opt.param_groups if g["algorithm"] == "adamw"]
    assert any(p is model.gain for g in parts for p in g["params"])
    clones = [[p.detach().clone().requires_grad_() for p in g["params"]] for g in parts]
    refs = [torch.optim.AdamW(c, lr=g["lr"], betas=g["adamw_betas"], eps=g["adamw_eps"],
                              weight_decay=g["weight_decay"], foreach=True) for g, c in zip(parts, clones)]
    for t in range(3):
        opt.zero_grad()
        backward(model, t)
        for g, c in zip(parts, clones):
            for p, q in zip(g["params"], c):
                q.grad = None if p.grad is None else p.grad.clone()
        opt.step()
        for r in refs:
            r.step()
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


# ----------------------------------------------------------------------------- tensor lr
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
