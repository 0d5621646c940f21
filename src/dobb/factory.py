"""``build_optimizer(name, model, lr=..., weight_decay=..., **hparams)``: every optimizer by name.

Matrix optimizers get ``dobb.param_groups(model, algorithm=<name>)`` (hidden matrices to the matrix
update, embeddings/head/norms/biases to AdamW with betas ``(0.9, 0.95)``, one optimizer object;
``head_names``, ``is_matrix`` and ``experts``, the full names of 3-D expert stacks, go to
``param_groups``);
``adamw`` is ``torch.optim.AdamW`` itself over every trainable parameter. The Dobb variants are
presets of ``dobb.Dobb``: ``dobb-l2`` = ``norm="l2"``, ``dobb-g`` = ``side="output",
source="output_grad"``, ``dobb-g-l2`` both. Unknown names and hyperparameters are ``ValueError``s
listing what is valid, so a typo in a sweep config fails before any step runs.
"""
from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from .baselines import RMNP, BlockMuon, Dion, Dion2, Dion3, Muon, NorMuon, OwnerMuon, PeriodicRowMuon
from .dobb import Dobb
from .groups import param_groups

_MATRIX = {
    "muon": (Muon, {}),
    "owner-muon": (OwnerMuon, {}),
    "dion": (Dion, {}),
    "rmnp": (RMNP, {}),
    "pr-muon": (PeriodicRowMuon, {}),
    "block-muon": (BlockMuon, {}),
    "dion2": (Dion2, {}),
    "normuon": (NorMuon, {}),
    "dion3": (Dion3, {}),
    "dobb": (Dobb, {}),
    "dobb-l2": (Dobb, {"norm": "l2"}),
    "dobb-g": (Dobb, {"side": "output", "source": "output_grad"}),
    "dobb-g-l2": (Dobb, {"side": "output", "source": "output_grad", "norm": "l2"}),
}
OPTIMIZER_NAMES: tuple[str, ...] = ("adamw", *_MATRIX)

_COMMON = ("tau", "adamw_betas", "adamw_eps")
_GROUPING = ("head_names", "is_matrix", "experts")  # passed to dobb.param_groups
_CTOR_EXTRA = {Dobb: ("check_finite", "stat_group"), OwnerMuon: ("replicated_group",)}
_ADAMW_DEFAULTS = {"betas": (0.9, 0.95)}


def valid_hparams(name: str) -> list[str]:
    """Hyperparameter names ``build_optimizer(name, ...)`` accepts besides ``lr``/``weight_decay``."""
    _check_name(name)
    if name == "adamw":
        sig = inspect.signature(torch.optim.AdamW.__init__)
        return sorted(k for k in sig.parameters if k not in ("self", "params", "lr", "weight_decay"))
    cls, preset = _MATRIX[name]
    keys = set(cls.matrix_defaults) | set(_COMMON) | set(_GROUPING) | set(_CTOR_EXTRA.get(cls, ()))
    return sorted(keys - set(preset))


def build_optimizer(name: str, model: nn.Module, *, lr: float, weight_decay: float = 0.0,
                    **hparams: Any) -> torch.optim.Optimizer:
    """A ready optimizer for ``model``; see ``OPTIMIZER_NAMES`` and ``valid_hparams(name)``."""
    _check_name(name)
    valid = valid_hparams(name)
    unknown = sorted(set(hparams) - set(valid))
    if unknown:
        cls_preset = _MATRIX.get(name, (None, {}))[1]
        fixed = [k for k in unknown if k in cls_preset]
        why = f" ({name!r} fixes {', '.join(f'{k}={cls_preset[k]!r}' for k in fixed)})" if fixed else ""
        raise ValueError(f"{name!r} does not take {unknown}{why}; valid hyperparameters: {valid}")
    if name == "adamw":
        kwargs = {**_ADAMW_DEFAULTS, **hparams}
        return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr,
                                 weight_decay=weight_decay, **kwargs)
    cls, preset = _MATRIX[name]
    grouping = {k: hparams.pop(k) for k in _GROUPING if k in hparams}
    groups = param_groups(model, algorithm=cls.algorithm, **grouping)
    kwargs = {**preset, **hparams}
    if cls is Dobb:
        return Dobb(groups, model=model, lr=lr, weight_decay=weight_decay, **kwargs)
    return cls(groups, lr=lr, weight_decay=weight_decay, **kwargs)


def _check_name(name: str) -> None:
    if name not in OPTIMIZER_NAMES:
        raise ValueError(f"unknown optimizer {name!r}; valid names: {list(OPTIMIZER_NAMES)}")
