"""Hugging Face ``transformers``: Dobb (or any optimizer of this package) inside ``Trainer``.

Two ways, both resumable through the Trainer's own checkpoints (``optimizer.pt`` holds the full
optimizer state: momenta, block statistics and bases, step counters)::

    trainer = DobbTrainer(model=model, args=args, train_dataset=ds,
                          optimizer_name="dobb", optimizer_kwargs={"blocks": 4})

    opt = build_optimizer(model, "dobb", lr=args.learning_rate, weight_decay=args.weight_decay)
    trainer = Trainer(model=model, args=args, train_dataset=ds, optimizers=(opt, None))

``DobbTrainer`` takes ``lr`` and ``weight_decay`` from ``TrainingArguments`` and follows the
Trainer's weight-decay convention for the AdamW part (biases and norm weights get none); the
scheduler is the Trainer's own (``lr_scheduler_type``, warmup), which scales every group's lr.
Dobb reads layer inputs with forward hooks on the model it is given, so build it from the model
the Trainer trains (hooks stay on the inner modules when the Trainer wraps it in DDP).
"""
from __future__ import annotations

import inspect
from collections.abc import Iterable
from typing import Any

from torch import nn
from transformers import Trainer

from ..factory import _MATRIX, OPTIMIZER_NAMES, valid_hparams
from ..factory import build_optimizer as _build_by_name
from ..groups import DEFAULT_HEAD_NAMES
from ..groups import param_groups as _param_groups

__all__ = ["DobbTrainer", "build_optimizer", "param_groups"]


def param_groups(model: nn.Module, algorithm: str = "dobb", *, decay_names: Iterable[str] | None = None,
                 head_names=DEFAULT_HEAD_NAMES, is_matrix=None, **matrix_overrides) -> list[dict[str, Any]]:
    """``dobb.param_groups`` with the AdamW part split by weight decay.

    ``decay_names``: names of the non-matrix parameters that get weight decay (the Trainer's
    ``get_decay_parameter_names``); the others get ``weight_decay=0``. ``None``: all of them decay
    (``dobb.param_groups``' rule). Matrices always decay, as in the paper's protocol. GPT-2's
    ``Conv1D`` weights are matrices (a ``transposed=True`` group).
    """
    groups = []
    for g in _param_groups(model, algorithm, head_names=head_names, is_matrix=is_matrix, **matrix_overrides):
        if g["algorithm"] != "adamw" or decay_names is None:
            groups.append(g)
            continue
        decay = set(decay_names)
        for params, extra in (([np for np in g["params"] if np[0] in decay], {}),
                              ([np for np in g["params"] if np[0] not in decay], {"weight_decay": 0.0})):
            if params:
                groups.append({**g, "params": params, **extra})
    return groups


def build_optimizer(model: nn.Module, name: str = "dobb", *, lr: float, weight_decay: float = 0.0,
                    decay_names: Iterable[str] | None = None, **hparams: Any):
    """An optimizer of this package for ``model`` (see ``dobb.OPTIMIZER_NAMES``), HF-style decay.

    Same names and hyperparameters as ``dobb.build_optimizer``; ``decay_names`` as in
    ``param_groups``. ``"adamw"`` is ``torch.optim.AdamW`` over every parameter.
    """
    if name not in OPTIMIZER_NAMES:
        raise ValueError(f"unknown optimizer {name!r}; valid names: {list(OPTIMIZER_NAMES)}")
    if name == "adamw":
        return _build_by_name(name, model, lr=lr, weight_decay=weight_decay, **hparams)
    valid = valid_hparams(name)
    unknown = sorted(set(hparams) - set(valid))
    if unknown:
        raise ValueError(f"{name!r} does not take {unknown}; valid hyperparameters: {valid}")
    cls, preset = _MATRIX[name]
    grouping = {k: hparams.pop(k) for k in ("head_names", "is_matrix") if k in hparams}
    groups = param_groups(model, cls.algorithm, decay_names=decay_names, **grouping)
    kwargs = {**preset, **hparams}
    if "model" in inspect.signature(cls.__init__).parameters:
        kwargs["model"] = model
    return cls(groups, lr=lr, weight_decay=weight_decay, **kwargs)


class DobbTrainer(Trainer):
    """``transformers.Trainer`` whose optimizer is one of this package's (Dobb by default).

    Args (besides the Trainer's own):
        optimizer_name: a name from ``dobb.OPTIMIZER_NAMES``.
        optimizer_kwargs: hyperparameters for it (``blocks``, ``refresh_every``, ``tau``, ...);
            ``lr`` and ``weight_decay`` come from ``TrainingArguments``.
    """

    def __init__(self, *args, optimizer_name: str = "dobb", optimizer_kwargs: dict[str, Any] | None = None,
                 **kwargs):
        if optimizer_name not in OPTIMIZER_NAMES:
            raise ValueError(f"unknown optimizer {optimizer_name!r}; valid names: {list(OPTIMIZER_NAMES)}")
        self.dobb_optimizer_name = optimizer_name
        self.dobb_optimizer_kwargs = dict(optimizer_kwargs or {})
        for key in ("lr", "weight_decay"):
            if key in self.dobb_optimizer_kwargs:
                raise ValueError(f"optimizer_kwargs must not set {key!r}: DobbTrainer takes it from TrainingArguments")
        super().__init__(*args, **kwargs)

    def create_optimizer(self, model=None):
        if self.optimizer is None:
            opt_model = self.model if model is None else model
            decay = None if self.dobb_optimizer_name == "adamw" else set(self.get_decay_parameter_names(opt_model))
            extra = {} if decay is None else {"decay_names": decay}
            self.optimizer = build_optimizer(opt_model, self.dobb_optimizer_name, lr=self.args.learning_rate,
                                             weight_decay=self.args.weight_decay, **extra,
                                             **self.dobb_optimizer_kwargs)
        return self.optimizer
