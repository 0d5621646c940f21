"""Every optimizer of this package, declared once: ``dobb.build_optimizer``, the integrations and the bench read this.

It holds what the library needs: the name, the class, the label (in ``dobb.resume``'s messages),
the preset and the builder defaults. To add an optimizer: write its class (a
``dobb._base.MatrixOptimizer`` subclass with ``algorithm`` and ``Options``, its typed options: see
``dobb._hparams``) and export it from ``dobb/__init__.py``; add one ``Entry(name, Class, label)``
line to ``_ENTRIES`` below (``preset``: fixed kwargs of a variant); ``tests/test_registry.py`` then
builds, validates and steps it. The bench's fields of each name (its cost formulas, its blocked
axis) are in its own table, outside this package (docs/CONTRIBUTING.md, "Adding an optimizer").

An entry's accepted hyperparameters, with their defaults, are read from its class' ``Options``
(the shared ones, ``tau``, ``adamw_betas``, ``adamw_eps``, ``fused``, ``foreach``, ``nonfinite``, among them) and
its other constructor keywords, plus the grouping ones passed to ``dobb.param_groups``
(``head_names``, ``is_matrix``, ``experts``, ``decay_names``), less the ``preset`` (fixed by the
variant: ``dobb-l2`` is ``Dobb`` with ``norm="l2"``, and asking it for another ``norm`` is an
error). Validation (``validate``) is one style for all, raised before anything is built: unknown
names and hyperparameters, values of the wrong kind, out of range or refused together are
``ValueError``s naming the parameter and what is valid, by the same ``Options.check`` the class
runs on its groups.
"""
from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch

from . import _safety
from ._hparams import check_kind
from .baselines import (RMNP, SOAP, BlockMuon, Dash, Dion, Dion2, Dion3, Muon, MuonBP, NewtonMuon, NorMuon, OwnerMuon,
                        PeriodicRowMuon, SAMuon, Shampoo, SOAPMuon, SPlus)
from .core.optimizer import Dobb

__all__ = ["Entry", "OPTIMIZERS", "OPTIMIZER_NAMES", "GROUPING_KEYS", "get", "valid_hparams",
           "hparam_defaults", "validate"]

# Passed to ``dobb.param_groups`` (which parameters are matrices, stacks, decayed), not to the class.
GROUPING_KEYS = ("head_names", "is_matrix", "experts", "decay_names")
# Constructor arguments that are not hyperparameters of a group (the builder supplies them).
_NOT_HPARAMS = ("self", "params", "model", "lr", "weight_decay", "param_names")


@dataclass(frozen=True)
class Entry:
    """One optimizer as ``build_optimizer(name, ...)`` builds it.

    ``label``: its display name (``"Dobb-G"``). ``preset``: constructor kwargs the name fixes (a
    variant of a class). ``defaults``: builder defaults the user may override (AdamW's betas).
    """
    name: str
    cls: type
    label: str
    preset: Mapping[str, Any] = field(default_factory=dict)
    defaults: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self):  # read-only, so no caller can change a preset for everyone
        object.__setattr__(self, "preset", MappingProxyType(dict(self.preset)))
        object.__setattr__(self, "defaults", MappingProxyType(dict(self.defaults)))

    @property
    def is_matrix(self) -> bool:
        """Whether the class is one of this package's matrix optimizers (else: ``torch.optim.AdamW``)."""
        return self.cls is not torch.optim.AdamW

    @property
    def refreshes(self) -> bool:
        """Whether the optimizer keeps a basis refreshed every ``refresh_every`` steps from captured
        statistics (Dobb and its presets; the timing bench gives them ``--blocks``/``--refresh-every``)."""
        return issubclass(self.cls, Dobb)

    def hparam_defaults(self) -> dict[str, Any]:
        """Every accepted hyperparameter with its default (``None``: no default of a checkable kind)."""
        if not self.is_matrix:
            sig = inspect.signature(torch.optim.AdamW.__init__)
            out = {k: p.default for k, p in sig.parameters.items() if k not in _NOT_HPARAMS}
            out["decay_names"] = None  # Hugging Face's decay rule (the others without weight decay)
        else:
            out = self.cls.Options.hparam_defaults()
            out.update(_ctor_keywords(self.cls))
            out.update(dict.fromkeys(GROUPING_KEYS))
        out.update(self.defaults)
        for key in self.preset:
            out.pop(key, None)
        return out


def _ctor_keywords(cls: type) -> dict[str, Any]:
    """Named keyword arguments of ``cls.__init__`` (and its bases) that are not hyperparameters of a group."""
    out = {}
    for klass in reversed(cls.__mro__):
        init = klass.__dict__.get("__init__")
        if init is None or klass is object or not issubclass(klass, torch.optim.Optimizer) \
                or klass is torch.optim.Optimizer:
            continue
        for k, p in inspect.signature(init).parameters.items():
            if k not in _NOT_HPARAMS and p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD):
                out[k] = None if p.default is inspect.Parameter.empty else p.default
    return out


_SIDE_OUT = {"side": "output", "source": "output_grad"}
_ENTRIES = (
    Entry("adamw", torch.optim.AdamW, "AdamW", defaults={"betas": (0.9, 0.95)}),
    Entry("muon", Muon, "Muon"),
    Entry("owner-muon", OwnerMuon, "Owner-compute Muon"),
    Entry("dion", Dion, "Dion"),
    Entry("rmnp", RMNP, "RMNP"),
    Entry("pr-muon", PeriodicRowMuon, "PR-Muon"),
    Entry("block-muon", BlockMuon, "Block Muon"),
    Entry("dion2", Dion2, "Dion2"),
    # block steps on each shard, owner-computed whole matrices every period-th step
    Entry("muonbp", MuonBP, "MuonBP"),
    Entry("normuon", NorMuon, "NorMuon"),
    Entry("dion3", Dion3, "Dion3"),
    # CMuon: Muon with Q/K/V of every fused (3n x n) weight as three matrices (other sizes: muon's split_sizes)
    Entry("cmuon", Muon, "CMuon", preset={"split_sizes": "qkv"}),
    # Spectral-Aware Muon; lite = one top pair by warm-started power iteration
    Entry("samuon", SAMuon, "SAMuon"),
    Entry("samuon-lite", SAMuon, "SAMuon-lite", preset={"top_k": 1, "topk_method": "power"}),
    Entry("dobb", Dobb, "Dobb"),
    Entry("dobb-l2", Dobb, "Dobb-l2", preset={"norm": "l2"}),
    Entry("dobb-g", Dobb, "Dobb-G", preset=_SIDE_OUT),
    Entry("dobb-g-l2", Dobb, "Dobb-G-l2", preset={**_SIDE_OUT, "norm": "l2"}),
    # Dobb-preconditioned Muon: Adam in the input-side bases, then NS5 of each of out_blocks row blocks;
    # Nesterov momentum by default, as the library's Muon (dobb.Dobb itself keeps plain momentum)
    Entry("dobb-muon", Dobb, "Dobb-Muon", preset={"norm": "muon"}, defaults={"nesterov": True}),
    # block Shampoo as DASH does it (tiles within shards: no cross-shard exchange); Shampoo = one tile per matrix
    Entry("dash", Dash, "DASH"),
    Entry("shampoo", Shampoo, "Shampoo"),
    # SOAP: Adam in Shampoo's eigenbases; Newton-Muon: Muon on G Sigma^-1
    Entry("soap", SOAP, "SOAP"),
    # SOAP-Muon (modded-nanogpt track-3 record): SOAP-preconditioned Nesterov momentum, then NS5
    Entry("soap-muon", SOAPMuon, "SOAP-Muon"),
    Entry("newton-muon", NewtonMuon, "Newton-Muon"),
    # SPlus: sign of the momentum in the eigenbases of G G^T and G^T G
    Entry("splus", SPlus, "SPlus"),
)



def _index(entries: tuple[Entry, ...]) -> Mapping[str, Entry]:
    """``{name: entry}``; a name or label declared twice is an error (two engineers adding the same
    optimizer, or a copy-paste, would otherwise silently keep the last one)."""
    out: dict[str, Entry] = {}
    for e in entries:
        clash = next((o for o in out.values() if o.label == e.label), None)
        if e.name in out or clash is not None:
            raise ValueError(f"optimizer {e.name!r} (label {e.label!r}) is declared twice in dobb.registry")
        out[e.name] = e
    return MappingProxyType(out)


OPTIMIZERS: Mapping[str, Entry] = _index(_ENTRIES)
_safety.use_registry(OPTIMIZERS)  # the labels of saved states (``_safety`` cannot import this module)
OPTIMIZER_NAMES: tuple[str, ...] = tuple(OPTIMIZERS)


def get(name: str) -> Entry:
    """The entry of ``name``; ``ValueError`` listing the valid names otherwise."""
    entry = OPTIMIZERS.get(name) if isinstance(name, str) else None
    if entry is None:
        raise ValueError(f"unknown optimizer {name!r}; valid names: {list(OPTIMIZER_NAMES)}")
    return entry


def hparam_defaults(name: str) -> dict[str, Any]:
    return get(name).hparam_defaults()


def valid_hparams(name: str) -> list[str]:
    """Hyperparameter names ``build_optimizer(name, ...)`` accepts besides ``lr``/``weight_decay``."""
    return sorted(hparam_defaults(name))


def validate(name: str, hparams: Mapping[str, Any], *, lr=None, weight_decay=None) -> Entry:
    """Check ``name`` and ``hparams`` before anything is built; returns the entry.

    Unknown keys (a preset's fixed key among them), values of the wrong kind and, for the matrix
    optimizers, values their ``Options`` refuse raise a ``ValueError`` naming the parameter and
    what is valid.
    """
    entry = get(name)
    accepted = entry.hparam_defaults()
    unknown = sorted(set(hparams) - set(accepted))
    if unknown:
        fixed = [k for k in unknown if k in entry.preset]
        why = f" ({name!r} fixes {', '.join(f'{k}={entry.preset[k]!r}' for k in fixed)})" if fixed else ""
        raise ValueError(f"{name!r} does not take {unknown}{why}; valid hyperparameters: {sorted(accepted)}")
    for key, value in (("lr", lr), ("weight_decay", weight_decay)):
        if value is not None:
            check_kind(key, value, 0.0)
    follows = entry.cls.Options.layout_names() if entry.is_matrix else ()
    for key, value in hparams.items():
        if accepted[key] is not None and not (value is None and key in follows):  # None: follow the layout
            check_kind(key, value, accepted[key])
    if entry.is_matrix:  # ranges, choices and combinations: the class' own rules, on its options
        options = entry.cls.Options
        given = {**entry.defaults, **hparams, **entry.preset}
        values = {k: v for k, v in given.items() if k in options.names()}
        values.update((k, v) for k, v in (("lr", lr), ("weight_decay", weight_decay)) if v is not None)
        options.check(values)
    return entry
