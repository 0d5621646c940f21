"""Dobb's apply: ``W <- (1 - lr wd) W - lr * s * O`` for every matrix of a param group, with the
direction ``O`` from ``functional.add_directions_`` (one-sided) or ``_two_sided.two_sided_update_``
(``side="both"``). This module decides which kernel runs where and batches equal blocks; the
optimizer (``dobb.Dobb._matrix_step``) hands it plain local tensors.

Every matrix is a stack (a 2-D parameter a stack of one, see ``layout``): its blocks join the
batch of their shape whatever the stack size.
"""
from __future__ import annotations

import math
from collections import defaultdict
from typing import Any, NamedTuple

import torch
from torch import Tensor

from . import functional as F
from ._two_sided import BlockBasis, two_sided_update_
from .collectives import all_reduce_sum_
from .layout import MatrixLayout

__all__ = ["FUSE_MIN_BLOCK_WORK", "OneSided", "TwoSided", "decay_in_update", "apply_directions", "apply_two_sided"]

# torch runs baddbmm_ into a strided weight view as one addmm_ per block: a win (one pass over
# W, no update temporary) for large blocks, launch-bound for small ones (docs/timing.md)
FUSE_MIN_BLOCK_WORK = 1 << 18


class OneSided(NamedTuple):
    """One matrix (stack) of a one-sided group, local tensors: its ``layout``, ``basis`` (row-stacked
    blocks), update ``u`` and weight ``w``; ``decay`` is the weight decay folded into its
    reconstruction (``decay_in_update``), or None when ``w`` is already decayed."""

    layout: MatrixLayout
    basis: Tensor
    u: Tensor
    w: Tensor
    decay: float | None = None


class TwoSided(NamedTuple):
    """One matrix (stack) of a ``side="both"`` group: its ``plan`` (``_schedule.Plan``: both sides'
    layouts and state keys), its optimizer ``state`` (bases, ``second_moment``, ``step``) and the
    local update ``u``, gradient ``g`` and weight ``w``."""

    plan: Any
    state: dict
    u: Tensor
    g: Tensor
    w: Tensor


def decay_in_update(w: Tensor, layout: MatrixLayout, *, lr, basis_dtype: torch.dtype, product_dtype) -> bool:
    """Whether the weight decay of ``w`` (local, one-sided) is the ``beta`` of its reconstruction
    ``baddbmm`` (one pass over ``W`` instead of a multiply pass and a strided add pass): on CPU, for
    a stack of one whose products run in the weight's dtype and whose smallest block is large enough."""
    if layout.stack_local != 1:
        return False  # decayed by one foreach pass: the fused baddbmm writes one matrix's strided view
    rows = w.shape[-1 - layout.blocked_axis]  # the axis that is not blocked
    return (w.device.type == "cpu" and not isinstance(lr, torch.Tensor)
            and w.dtype == F.matmul_dtype(basis_dtype, w.device, product_dtype)
            and min((rows * s * s for s in layout.local_sizes if s > 0), default=0) >= FUSE_MIN_BLOCK_WORK)


def _oriented(t: Tensor, layout: MatrixLayout) -> Tensor:
    """A stack ``(E, m, n)`` with the blocked axis last."""
    return t if layout.blocked_axis == 1 else t.transpose(1, 2)


def apply_directions(mats: list[OneSided], *, norm: str, lr, tau: float, product_dtype) -> None:
    """``W -= lr * s * O`` with ``O`` from batched project -> normalize -> reconstruct, for every
    matrix of ``mats``.

    All equal-shape blocks of the group go through one ``add_directions_`` call on accelerators
    (stacked to save kernel launches); on CPU, where a strided block view feeds ``bmm`` at no cost
    while stacking matrices costs a transposing copy, one call per matrix. The constant
    ``-lr * s`` (and sign's ``1/sqrt(rows)``) is the kernel's ``factor``, so no update-sized
    temporary is written besides the coefficients.
    """
    batches: dict[tuple, list] = defaultdict(list)
    for layout, basis, ut, pt, beta in mats:
        factor = -lr * F.update_scale(*layout.shape, tau) / (math.sqrt(layout.rows) if norm == "sign" else 1.0)
        dtype = F.matmul_dtype(basis.dtype, basis.device, product_dtype)
        u3, w3, b3 = _oriented(layout.stacked(ut), layout), _oriented(layout.stacked(pt), layout), layout.stacked(basis)
        # l2 with sharded rows: one batch per matrix, so every rank of the l2 group issues the same
        # norm reductions in the same order (local row counts may differ across ranks)
        l2_key = (id(layout.l2_group), id(pt) if layout.l2_group is not None else None) if norm == "l2" else None
        for run in F.block_runs(layout.local_sizes):
            cols = slice(run.start, run.stop)
            key = (u3.shape[1], run.size, dtype, layout.rows, l2_key)
            batches[key].append((F.Blocks(w=w3[:, :, cols], u=u3[:, :, cols], q=F.stack_block_view(b3, run),
                                          factor=factor, beta=beta), layout.l2_group))
    for (_, _, dtype, _, _), items in batches.items():
        l2_group = items[0][1]
        col_sq_sum = (lambda sq: all_reduce_sum_(sq, l2_group)) if l2_group is not None else None
        if items[0][0].w.device.type == "cpu":
            for it, _ in items:
                F.add_directions_([it], norm=norm, dtype=dtype, col_sq_sum=col_sq_sum)
        else:
            F.add_directions_([it for it, _ in items], norm=norm, dtype=dtype, col_sq_sum=col_sq_sum)


def apply_two_sided(mats: list[TwoSided], *, norm: str, lr, tau: float, basis_dtype: torch.dtype, product_dtype,
                    momentum: float, beta2: float, eps: float) -> None:
    """``side="both"``: ``W += factor * Q_rows D Q_cols^T`` (``_two_sided.two_sided_update_``) for
    every matrix of every stack of ``mats`` (an expert stack: each expert with its own bases and
    ``second_moment``)."""
    for plan, state, ut, gt, pt in mats:
        lin = plan.layout
        dtype = F.matmul_dtype(basis_dtype, pt.device, product_dtype)
        sides = sorted(plan.sides, key=lambda side: side.layout.blocked_axis)  # (rows side, cols side)
        bases = [side.layout.stacked(state[side.basis]) for side in sides]
        # sign's 1/sqrt(m) with m = the global output axis (lin.rows), as one-sided Dobb
        factor = -lr * F.update_scale(*lin.shape, tau) / math.sqrt(lin.rows)
        v = lin.stacked(state["second_moment"]) if norm == "adam" else None
        w, u, g = lin.stacked(pt), lin.stacked(ut), lin.stacked(gt)
        for e in range(w.shape[0]):
            two_sided_update_(w=w[e], u=u[e], g=g[e], rows=BlockBasis(bases[0][e], sides[0].layout.local_sizes),
                              cols=BlockBasis(bases[1][e], sides[1].layout.local_sizes), factor=factor, dtype=dtype,
                              norm=norm, v=None if v is None else v[e], step=state["step"] + 1, momentum=momentum,
                              beta2=beta2, eps=eps)
