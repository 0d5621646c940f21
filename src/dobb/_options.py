"""Dobb's param-group options: what each may be, and which combinations make sense.

Checked once per group at construction and on ``add_param_group`` (``Dobb._check_matrix_group``),
after ``dobb._hparams`` has checked each value's kind; every failure is a ``ValueError`` that names
the option and what is valid. Apart from the class so that the rules are read in one place.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from . import functional as F
from ._schedule import check_refresh_width

__all__ = ["HOOK_SOURCES", "CHOICES", "check_group"]

# sources whose statistic is captured by hooks on the model (grad_gram needs none)
HOOK_SOURCES = ("activation", "output_grad")

CHOICES = {
    "basis": ("orthogonal_iteration", "eigh"),
    "qr": ("householder", "cholesky"),
    "norm": ("sign", "l2", "adam"),
    "side": ("input", "output", "both"),
    "source": ("activation", "output_grad", "grad_gram"),
    "capture": ("first", "all"),
    "init_basis": ("eigh", "identity"),
}


def check_group(group: dict[str, Any], name_of: Callable[[torch.Tensor, int], str], has_model: bool) -> None:
    """Raise ``ValueError`` for an invalid option or combination of ``group`` (a Dobb param group
    with its defaults filled in). ``name_of(p, i)`` names parameter ``i`` in messages; ``has_model``:
    whether the optimizer was given the model its hooks need."""
    for key, options in CHOICES.items():
        if group[key] not in options:
            raise ValueError(f"{key} must be one of {options}, got {group[key]!r}")
    for key in ("blocks", "refresh_every", "ortho_steps", "out_blocks"):
        value = group[key]
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{key} must be an integer >= 1, got {value!r}")
    for key in ("stat_decay", "momentum", "beta2"):
        if not 0.0 <= group[key] < 1.0:
            raise ValueError(f"{key} must lie in [0, 1), got {group[key]}")
    if not group["eps"] > 0:
        raise ValueError(f"eps must be > 0, got {group['eps']}")
    check_refresh_width(group["refresh_width"])
    if group["source"] == "activation" and group["side"] == "output":
        raise ValueError("source='activation' gives an n x n statistic: it needs side='input' (or 'both')")
    if group["side"] == "both":
        if group["norm"] == "l2":
            raise ValueError("norm='l2' normalizes one side's coefficient columns; side='both' takes norm='sign' or 'adam'")
        if group["source"] == "output_grad":
            raise ValueError("side='both' takes source='activation' (activations for the input side, output "
                             "gradients for the output side) or source='grad_gram' (G^T G and G G^T blocks)")
    elif group["norm"] == "adam":
        raise ValueError("norm='adam' is the second moment of the two-sided coefficients: it needs side='both'")
    if group["source"] == "output_grad" and group["side"] != "output":
        raise ValueError("source='output_grad' gives an m x m statistic: it needs side='output' (Dobb-G)")
    for key in ("basis_dtype", "stat_dtype"):
        if not (isinstance(group[key], torch.dtype) and group[key].is_floating_point):
            raise ValueError(f"{key} must be a floating torch.dtype, got {group[key]!r}")
    if group["product_dtype"] not in F.PRODUCT_DTYPES:
        raise ValueError(f"product_dtype must be one of {F.PRODUCT_DTYPES}, got {group['product_dtype']!r}")
    for i, p in enumerate(group["params"]):
        output_side = group["source"] == "output_grad" or (group["side"] == "both" and group["source"] == "activation")
        if p.dim() == 3 and output_side:
            raise ValueError(
                f"{name_of(p, i)} is an expert stack (E, out, in): its output gradients are "
                f"routed, which hooks cannot see; use source='grad_gram' for side={group['side']!r}"
            )
    if group["source"] in HOOK_SOURCES and not has_model:
        raise ValueError(
            f"source={group['source']!r} captures statistics with hooks: pass model=<the nn.Module> "
            f"to Dobb(...), or use source='grad_gram'"
        )
