"""dobb.registry: every entry builds by name exactly what its class builds by hand, labels are unique,
every class is exported, and a value of the wrong kind is a ValueError naming the parameter (for
every optimizer alike, by name and by class)."""
from __future__ import annotations

import copy
import inspect

import pytest
import torch
from torch import nn

import dobb
from dobb import registry

NAMES = list(registry.OPTIMIZER_NAMES)


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))


def _train(model, opt, steps=3):
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(32, 12, generator=g)
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()


def _by_hand(entry, model, lr, wd):
    """The optimizer as a user writes it from the class (no registry): the reference."""
    if not entry.is_matrix:
        # the registry builds torch's fused kernel where it runs (this CPU: tests/test_factory.py)
        return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=wd, betas=(0.9, 0.95), fused=True)
    groups = dobb.param_groups(model, algorithm=entry.cls.algorithm)
    extra = {"model": model} if "model" in inspect.signature(entry.cls.__init__).parameters else {}
    if entry.name == "dobb-muon":  # the library Muon's Nesterov momentum, Dobb-Muon's builder default
        extra["nesterov"] = True
    return entry.cls(groups, lr=lr, weight_decay=wd, **dict(entry.preset), **extra)


@pytest.mark.parametrize("name", NAMES)
def test_entry_builds_what_its_class_builds(name):
    entry = registry.get(name)
    a, b = _model(), _model()
    by_name = dobb.build_optimizer(name, a, lr=3e-2, weight_decay=0.1)
    by_hand = _by_hand(entry, b, 3e-2, 0.1)
    assert type(by_name) is entry.cls
    for key, value in entry.preset.items():  # the variant's fixed kwargs reach every matrix group
        assert all(g[key] == value for g in by_name.param_groups if g.get("algorithm", "adamw") != "adamw")
    start = copy.deepcopy(a.state_dict())
    _train(a, by_name)
    _train(b, by_hand)
    for (k, p), q in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(p, q), (name, k)
    assert any(not torch.equal(p, start[k]) for k, p in a.state_dict().items())  # it trained


def test_names_and_labels_are_unique_and_every_class_is_exported():
    assert len(set(NAMES)) == len(NAMES) == len(registry.OPTIMIZERS)
    labels = [e.label for e in registry.OPTIMIZERS.values()]
    assert len(set(labels)) == len(labels) and all(labels)
    for entry in registry.OPTIMIZERS.values():
        if entry.is_matrix:
            assert getattr(dobb, entry.cls.__name__) is entry.cls and entry.cls.__name__ in dobb.__all__
    assert dobb.OPTIMIZER_NAMES == registry.OPTIMIZER_NAMES


def test_a_name_or_label_declared_twice_is_refused():
    muon = registry.get("muon")
    with pytest.raises(ValueError, match="'muon'.*declared twice"):
        registry._index((muon, muon))
    with pytest.raises(ValueError, match="label 'Muon'.*declared twice"):
        registry._index((muon, registry.Entry("muon2", muon.cls, "Muon")))


def test_presets_are_read_only():
    with pytest.raises(TypeError):
        registry.get("dobb-l2").preset["norm"] = "sign"


def test_unknown_name_lists_the_valid_names():
    with pytest.raises(ValueError) as err:
        registry.get("adamx")
    assert "adamx" in str(err.value) and all(n in str(err.value) for n in NAMES)


def _wrong(default):
    """A value of another kind than ``default`` (None: no checkable kind)."""
    if isinstance(default, bool):
        return 1  # an int is not a bool
    if isinstance(default, int):
        return 2.0  # a float is not an integer
    if isinstance(default, float):
        return str(default)  # a number in a string: TypeError before the one validation style
    if isinstance(default, tuple) and default and all(isinstance(d, (int, float)) for d in default):
        return default[:-1]
    return None


KINDED = [(n, k, _wrong(v)) for n in NAMES for k, v in registry.hparam_defaults(n).items()
          if _wrong(v) is not None]


@pytest.mark.parametrize("name,key,value", KINDED)
def test_wrong_kind_is_a_value_error_naming_the_parameter(name, key, value):
    with pytest.raises(ValueError, match=rf"^{key} must be"):
        dobb.build_optimizer(name, _model(), lr=1e-2, **{key: value})


@pytest.mark.parametrize("name", [n for n in NAMES if registry.get(n).is_matrix])
def test_the_classes_validate_alike(name):
    """Constructed by hand (no registry): the same ValueError, e.g. Dobb(momentum="0.9")."""
    entry = registry.get(name)
    model = _model()
    extra = {"model": model} if "model" in inspect.signature(entry.cls.__init__).parameters else {}
    for key, default in entry.cls.matrix_defaults.items():
        value = _wrong(default)
        if value is None:
            continue
        groups = dobb.param_groups(model, algorithm=entry.cls.algorithm)
        with pytest.raises(ValueError, match=rf"^{key} must be"):
            entry.cls(groups, lr=1e-2, **extra, **{key: value})
    with pytest.raises(ValueError, match="^lr must be"):
        entry.cls(dobb.param_groups(model, algorithm=entry.cls.algorithm), lr="1e-2", **extra)


def test_no_optimizer_class_is_built_on_another():
    """Issue 54: a registered class derives from at most one family base (``_MuonFamily``,
    ``_SOAPFamily``, ``_DashFamily``) besides ``MatrixOptimizer``, and from no other registered class;
    what two optimizers share is in that base or held by composition (``dobb.distribution``)."""
    from dobb._base import MatrixOptimizer
    from dobb.registry import OPTIMIZERS

    classes = {e.cls for e in OPTIMIZERS.values() if e.is_matrix}
    for cls in classes:
        assert [k.__name__ for k in cls.__mro__[1:] if k in classes] == [], cls.__name__
        bases = [k.__name__ for k in cls.__mro__[1:] if issubclass(k, MatrixOptimizer) and k is not MatrixOptimizer]
        assert len(bases) <= 1 and all(b.startswith("_") for b in bases), (cls.__name__, bases)
