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

import torch

from . import functional as F
from ._two_sided import two_sided_update_
from .collectives import all_reduce_sum_
from .layout import MatrixLayout

__all__ = ["FUSE_MIN_BLOCK_WORK", "decay_in_update", "apply_directions", "apply_two_sided"]

# torch runs baddbmm_ into a strided weight view as one addmm_ per block: a win (one pass over
# W, no update temporary) for large blocks, launch-bound for small ones (docs/timing.md)
FUSE_MIN_BLOCK_WORK = 1 << 18


def decay_in_update(pt: torch.Tensor, layout: MatrixLayout, group: dict) -> bool:
    """Whether the weight decay of ``pt`` (local) is the ``beta`` of its reconstruction ``baddbmm``
    (one pass over ``W`` instead of a multiply pass and a strided add pass): on CPU, for a stack of
    one whose products run in the weight's dtype and whose smallest block is large enough."""
    if layout.stack_local != 1 or group["side"] == "both":
        return False  # decayed by one foreach pass: the fused baddbmm writes one matrix's strided view
    rows = pt.shape[-1 - layout.blocked_axis]  # the axis that is not blocked
    return (pt.device.type == "cpu" and not isinstance(group["lr"], torch.Tensor)
            and pt.dtype == F.matmul_dtype(group["basis_dtype"], pt.device, group["product_dtype"])
            and min((rows * s * s for s in layout.local_sizes if s > 0), default=0) >= FUSE_MIN_BLOCK_WORK)


def _oriented(t: torch.Tensor, layout: MatrixLayout) -> torch.Tensor:
    """A stack ``(E, m, n)`` with the blocked axis last."""
    return t if layout.blocked_axis == 1 else t.transpose(1, 2)


def apply_directions(group: dict, mats: list[tuple]) -> None:
    """``W -= lr * s * O`` with ``O`` from batched project -> normalize -> reconstruct.

    ``mats``: ``(layout, basis, u, w, beta)`` per matrix (local tensors; ``beta`` the decay folded into
    its reconstruction, or None: already decayed). All equal-shape blocks of the group go through
    one ``add_directions_`` call on accelerators (stacked to save kernel launches); on CPU, where a
    strided block view feeds ``bmm`` at no cost while stacking matrices costs a transposing copy,
    one call per matrix. The constant ``-lr * s`` (and sign's ``1/sqrt(rows)``) is the kernel's
    ``factor``, so no update-sized temporary is written besides the coefficients.
    """
    norm, lr, tau, product = group["norm"], group["lr"], group["tau"], group["product_dtype"]
    batches: dict[tuple, list] = defaultdict(list)
    for layout, basis, ut, pt, beta in mats:
        factor = -lr * F.update_scale(*layout.shape, tau) / (math.sqrt(layout.rows) if norm == "sign" else 1.0)
        dtype = F.matmul_dtype(basis.dtype, basis.device, product)
        u3, w3, b3 = _oriented(layout.stacked(ut), layout), _oriented(layout.stacked(pt), layout), layout.stacked(basis)
        # l2 with sharded rows: one batch per matrix, so every rank of the l2 group issues the same
        # norm reductions in the same order (local row counts may differ across ranks)
        l2_key = (id(layout.l2_group), id(pt) if layout.l2_group is not None else None) if norm == "l2" else None
        for run in F.block_runs(layout.local_sizes):
            cols = slice(run.start, run.stop)
            key = (u3.shape[1], run.size, dtype, layout.rows, l2_key)
            batches[key].append(((w3[:, :, cols], u3[:, :, cols], F.stack_block_view(b3, run), factor, beta),
                                 layout.l2_group))
    for (_, _, dtype, _, _), items in batches.items():
        l2_group = items[0][1]
        col_sq_sum = (lambda sq: all_reduce_sum_(sq, l2_group)) if l2_group is not None else None
        if items[0][0][0].device.type == "cpu":
            for it, _ in items:
                F.add_directions_([it], norm, dtype, col_sq_sum)
        else:
            F.add_directions_([it for it, _ in items], norm, dtype, col_sq_sum)


def apply_two_sided(group: dict, mats: list[tuple]) -> None:
    """``side="both"``: ``mats`` are ``(input layout, output layout, state, u, g, w)`` per matrix (local
    tensors; ``state`` the matrix's optimizer state, read for its bases and ``second_moment``)."""
    norm, lr, tau = group["norm"], group["lr"], group["tau"]
    for lin, lout, state, ut, gt, pt in mats:
        dtype = F.matmul_dtype(group["basis_dtype"], pt.device, group["product_dtype"])
        sides = sorted(((lin, "basis"), (lout, "out_basis")), key=lambda s: s[0].blocked_axis)
        rows, cols = ((lay.local(state[key]), lay.local_sizes) for lay, key in sides)
        # sign's 1/sqrt(m) with m = the global output axis (lin.rows), as one-sided Dobb
        factor = -lr * F.update_scale(*lin.shape, tau) / math.sqrt(lin.rows)
        v = lin.local(state["second_moment"]) if norm == "adam" else None
        two_sided_update_(pt, ut, gt, rows, cols, factor, dtype, norm, v, state["step"] + 1, group["momentum"],
                          group["beta2"], group["eps"])
