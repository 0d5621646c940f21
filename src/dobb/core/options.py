"""Dobb's param-group options: one typed, validated declaration (``DobbOptions``), and the
combinations that make sense.

``DobbOptions`` is ``Dobb.Options``: its fields are Dobb's hyperparameters with their defaults and
value rules (``dobb._hparams``), read by the class (group defaults and checks), the registry and
the factory. Its ``_check_together`` refuses combinations of options that cannot work; ``check_group``
adds what needs the parameters and the model (expert stacks, hooks). Every failure is a
``ValueError`` that names the option and what is valid. Apart from the class so that the rules are
read in one place.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from .. import functional as F
from .._hparams import (Rule, ScaledOptions, boolean, floating_dtype, integer, layout_option, one_of, option,
                       optional, positive, unit_interval)

__all__ = ["HOOK_SOURCES", "CHOICES", "DobbOptions", "check_group", "check_params"]

# sources whose statistic is captured by hooks on the model (grad_gram needs none)
HOOK_SOURCES = ("activation", "output_grad")

CHOICES = {
    "basis": ("orthogonal_iteration", "eigh"),
    "qr": ("householder", "cholesky"),
    "norm": ("sign", "l2", "adam", "muon"),
    "side": ("input", "output", "both"),
    "source": ("activation", "output_grad", "grad_gram"),
    "capture": ("first", "all"),
    "init_basis": ("eigh", "identity"),
}


def _ns_dtype_ok(dt) -> bool:
    names = ("bfloat16", "float16", "float32", "float64")
    return (isinstance(dt, str) and (dt == "auto" or dt in names)) or dt in tuple(getattr(torch, n) for n in names)


def _choice(key: str, default: Any) -> Any:
    return option(default, one_of(*CHOICES[key]))


@dataclass(frozen=True, kw_only=True)
class DobbOptions(ScaledOptions):
    """Dobb's options (see ``dobb.Dobb`` for what each does)."""
    blocks: int = layout_option(1, integer(1))
    refresh_every: int = option(9, integer(1))
    capture_every: int | None = option(None, optional(integer(1)).hint("steps per capture; None: refresh steps only"))
    basis: str = _choice("basis", "orthogonal_iteration")
    ortho_steps: int = option(1, integer(1))
    qr: str = _choice("qr", "householder")
    norm: str = _choice("norm", "sign")
    side: str = _choice("side", "input")
    source: str = _choice("source", "activation")
    capture: str = _choice("capture", "first")
    stat_decay: float = option(0.9, unit_interval)
    momentum: float = option(0.95, unit_interval)
    nesterov: bool = option(False, boolean)
    basis_dtype: torch.dtype = option(torch.bfloat16, floating_dtype)
    stat_dtype: torch.dtype = option(torch.float32, floating_dtype)
    init_basis: str = _choice("init_basis", "eigh")
    stagger: bool = option(True, boolean)
    product_dtype: str | torch.dtype = option("auto", one_of(*F.PRODUCT_DTYPES))
    out_blocks: int = layout_option(1, integer(1))
    beta2: float = option(0.95, unit_interval)
    eps: float = option(1e-8, positive)
    refresh_width: int | None = option(None, optional(integer(1)).hint("block width per period step"))
    whole_every: int = option(0, integer(0))
    eigh_every: int = option(0, integer(0))
    heads: int | None = option(None, optional(integer(1)).hint("attention heads: per-head blocks"))
    ns_dtype: str | torch.dtype = option("auto", Rule(
        _ns_dtype_ok, "be 'auto' or one of ('bfloat16', 'float16', 'float32', 'float64') (or the torch dtype)"))
    compile: bool = option(False, boolean)  # the update's kernels compiled by Inductor (core.kernels)

    @classmethod
    def _check_together(cls, group):
        super()._check_together(group)
        if group["capture_every"] is not None and group["source"] not in HOOK_SOURCES:
            raise ValueError(f"capture_every={group['capture_every']} captures hook statistics between refreshes; "
                             f"source={group['source']!r} has no hooks (its statistic is the refresh step's gradient)")
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
        if group["norm"] == "muon" and group["side"] != "input":
            raise ValueError(f"norm='muon' (Dobb-preconditioned Muon) rotates into the input-side bases and "
                             f"orthogonalises out_blocks row blocks: it needs side='input', got side={group['side']!r}")
        if group["whole_every"] and not (group["norm"] == "muon" or (group["side"] == "both" and group["norm"] == "sign")):
            raise ValueError(f"whole_every={group['whole_every']} (a whole-matrix Newton-Schulz step every P-th step) "
                             f"takes norm='muon', or side='both' with norm='sign'; got side={group['side']!r}, "
                             f"norm={group['norm']!r}")
        if group["source"] == "output_grad" and group["side"] != "output":
            raise ValueError("source='output_grad' gives an m x m statistic: it needs side='output' (Dobb-G)")


def check_group(group: dict[str, Any], name_of: Callable[[torch.Tensor, int], str], has_model: bool) -> None:
    """Raise ``ValueError`` for an invalid option or combination of ``group`` (a Dobb param group
    with its defaults filled in): ``DobbOptions.check`` and ``check_params``."""
    DobbOptions.check(group)
    check_params(group, name_of, has_model)


def check_params(group: dict[str, Any], name_of: Callable[[torch.Tensor, int], str], has_model: bool) -> None:
    """What the options of ``group`` (already checked) require of its parameters and the model.
    ``name_of(p, i)`` names parameter ``i`` in messages; ``has_model``: whether the optimizer was
    given the model its hooks need."""
    for i, p in enumerate(group["params"]):
        if group["norm"] == "muon" and p.dim() == 3:
            raise ValueError(f"{name_of(p, i)} is an expert stack (E, out, in): norm='muon' (Dobb-preconditioned "
                             f"Muon) takes 2-D matrices only")
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
