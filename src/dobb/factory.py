"""``build_optimizer(name, model, lr=..., weight_decay=..., **hparams)``: every optimizer by name.

The names, classes, presets and accepted hyperparameters are ``dobb.registry``'s (one entry per
optimizer; this module only builds). Matrix optimizers get ``dobb.param_groups(model,
algorithm=<the class' algorithm>)`` (hidden matrices to the matrix update, embeddings/head/norms/
biases to AdamW with betas ``(0.9, 0.95)``, one optimizer object; ``head_names``, ``is_matrix``,
``experts`` (full names of 3-D expert stacks) and ``decay_names`` (Hugging Face's weight-decay
convention for the AdamW part) go to ``param_groups``); ``adamw`` is ``torch.optim.AdamW`` itself
over every trainable parameter, built with ``fused=True`` where torch has the fused kernel for
every parameter's device and dtype and ``foreach=True`` otherwise (an explicit ``fused`` or
``foreach`` is passed as given); the AdamW part of every matrix optimizer makes the same choice
per step (``dobb._base.adamw_kernel_flags``). The Dobb variants are presets of ``dobb.Dobb``: ``dobb-l2`` =
``norm="l2"``, ``dobb-g`` = ``side="output", source="output_grad"``, ``dobb-g-l2`` both. Unknown
names and hyperparameters, and values of the wrong kind, are ``ValueError``s naming what is valid
(``dobb.registry.validate``), so a typo in a sweep config fails before any step runs.
"""
from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from . import registry
from ._base import _fusable
from .groups import param_groups
from .registry import OPTIMIZER_NAMES, valid_hparams

__all__ = ["build_optimizer", "OPTIMIZER_NAMES", "valid_hparams"]


def build_optimizer(name: str, model: nn.Module, *, lr: float, weight_decay: float = 0.0,
                    **hparams: Any) -> torch.optim.Optimizer:
    """A ready optimizer for ``model``; see ``OPTIMIZER_NAMES`` and ``valid_hparams(name)``."""
    entry = registry.validate(name, hparams, lr=lr, weight_decay=weight_decay)
    grouping = {k: hparams.pop(k) for k in registry.GROUPING_KEYS if k in hparams}
    kwargs = {**entry.defaults, **hparams, **entry.preset}
    if not entry.is_matrix:
        # AdamW over every trainable parameter; with decay_names, the others without weight decay
        params: Any = [p for p in model.parameters() if p.requires_grad]
        if grouping.get("decay_names") is not None:
            decay = set(grouping["decay_names"])
            named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
            params = [{"params": [p for n, p in named if n in decay]},
                      {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0}]
            params = [g for g in params if g["params"]]
        if "fused" not in kwargs and "foreach" not in kwargs:  # torch's fastest kernel for these params
            flat = [p for g in params for p in g["params"]] if params and isinstance(params[0], dict) else params
            kwargs["fused" if flat and all(_fusable(p) for p in flat) else "foreach"] = True
        return entry.cls(params, lr=lr, weight_decay=weight_decay, **kwargs)
    groups = param_groups(model, algorithm=entry.cls.algorithm, **grouping)
    if "model" in inspect.signature(entry.cls.__init__).parameters:
        kwargs["model"] = model  # the classes that capture statistics with hooks on the model's layers
    return entry.cls(groups, lr=lr, weight_decay=weight_decay, **kwargs)
