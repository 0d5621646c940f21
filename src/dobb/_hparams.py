"""The one validation style of every optimizer: a ``ValueError`` naming the parameter and what is valid.

A hyperparameter's *kind* follows its default (``matrix_defaults``, or the builder's): a ``bool``
default takes only ``True``/``False``, an ``int`` default an integer, a ``float`` default a real
number, a tuple of numbers a tuple (or list) of as many numbers. Why here and not in each class:
without it a string where a number belongs reaches a comparison (``"0.9" < 1``) and surfaces as a
``TypeError`` from deep inside one optimizer and a ``ValueError`` from another. The kind check runs
first (``dobb._base.MatrixOptimizer`` for every class, ``dobb.registry.validate`` before anything
is built); the classes then check ranges and choices, also with ``ValueError``s.
"""
from __future__ import annotations

import math
import numbers
from typing import Any

import torch

__all__ = ["COMMON_DEFAULTS", "check_kind", "check_kinds"]

# The keyword arguments every ``MatrixOptimizer`` takes, with defaults that give their kinds.
COMMON_DEFAULTS = {"lr": 0.0, "weight_decay": 0.0, "tau": 0.2, "adamw_betas": (0.9, 0.95), "adamw_eps": 1e-8}


def _is_real(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def check_kind(name: str, value: Any, default: Any) -> None:
    """Raise ``ValueError`` naming ``name`` unless ``value`` has the kind of ``default``.

    Defaults of any other kind (strings, dtypes, ``None``, process groups) are left to the class'
    own check, which knows their valid values.
    """
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be True or False, got {value!r}")
    elif isinstance(default, numbers.Integral):
        if not isinstance(value, numbers.Integral) or isinstance(value, bool):
            raise ValueError(f"{name} must be an integer, got {value!r}")
    elif isinstance(default, numbers.Real):
        # a one-element tensor is a number too (schedulers may hold lr as a tensor)
        ok = _is_real(value) or (isinstance(value, torch.Tensor) and value.numel() == 1
                                 and value.dtype.is_floating_point)
        if not ok:
            raise ValueError(f"{name} must be a real number, got {value!r}")
        if _is_real(value) and math.isnan(value):
            raise ValueError(f"{name} must be a real number, got nan")
    elif isinstance(default, tuple) and default and all(_is_real(d) for d in default):
        if not (isinstance(value, (tuple, list)) and len(value) == len(default) and all(_is_real(v) for v in value)):
            raise ValueError(f"{name} must be {len(default)} real numbers, e.g. {default!r}, got {value!r}")


def check_kinds(values: dict[str, Any], defaults: dict[str, Any]) -> None:
    """``check_kind`` for every key of ``values`` that has a default."""
    for key, value in values.items():
        if key in defaults:
            check_kind(key, value, defaults[key])
