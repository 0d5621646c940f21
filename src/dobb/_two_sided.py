"""Two-sided Dobb (``side="both"``): block eigenbases on the input *and* the output side.

Per matrix ``W`` (``m x n``, stored ``(out, in)``) with input-side bases ``Q_in_c`` (``blocks``
column blocks, from the activation statistic or ``G^T G``) and output-side bases ``Q_out_b``
(``out_blocks`` row blocks, from the output-gradient statistic or ``G G^T``), the coefficients of
block pair ``(b, c)`` are ``C_bc = Q_out_b^T U_bc Q_in_c``. With ``Q_in``/``Q_out`` the
block-diagonal matrices of the bases that is ``C = Q_out^T U Q_in``: two one-sided projections, each
batched over the runs of equal blocks of its axis (``bmm``), never a dense ``m x m`` or ``n x n``.
The direction is ``O = Q_out D Q_in^T / sqrt(m)`` with

- ``norm="sign"``: ``D = sign(C)``. The ``1/sqrt(m)`` is one-sided Dobb's, so ``||O||_F^2 = n``
  (no zero coefficient) as for Dobb [T9], and the shared protocol's ``tau * sqrt(max(m, n))``
  applies unchanged;
- ``norm="adam"`` (SOAP's rule in Dobb's bases): ``V <- beta2 V + (1 - beta2) (Q_out^T G Q_in)^2``
  (the rotated *gradient*), ``R = C_hat / (sqrt(V_hat) + eps)`` with both bias corrections
  (``C_hat = C / (1 - mu^t)``: the momentum is kept in EMA form; ``V_hat = V / (1 - beta2^t)``),
  and ``D_bc = R_bc / rms(R_bc)`` per block pair: every block pair gets sign's RMS of 1, so
  ``||O||_F^2 = n`` as for sign and the shared protocol's scale means the same step size. Why:
  ``R`` alone has ``|R_ij| <= 1`` (Cauchy-Schwarz on the two EMAs when ``beta2 = momentum``) and an
  RMS far below 1 on noisy gradients, so an unscaled ``R`` took steps several times smaller than
  sign's and ended level with AdamW (docs/results.md, "Two-sided Dobb"). The rescale is per block
  pair, which is always whole on one rank, so it stays shard-local with no collective (a
  whole-matrix norm would need one under sharding). Over a basis refresh ``V`` is carried
  unchanged, as SOAP does: the warm-started orthogonal iteration keeps column ``j`` near the
  previous ``j``-th eigenvector (descending order), so ``V_ij`` keeps describing the same coefficient.

Shard-local by construction: each side's blocks come from ``placement.layout_for`` on its own
axis, which cuts the axis at its shard boundaries (FSDP2 ``Shard(0)`` rows, tensor parallel
``Shard(0)``/``Shard(1)``), so every block pair is either wholly on a rank or wholly absent, and
the step issues no collective. A placement that would split a block (a strided shard, one axis
over two mesh dims, a block count that does not divide the non-empty shards) is the
``ValueError`` of that layout, prefixed here with the way out.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from . import functional as F

__all__ = ["BlockBasis", "blockwise", "rotate", "unrotate", "adam_direction", "block_pair_rms_",
           "two_sided_layouts", "two_sided_update_"]


# ----------------------------------------------------------------------------- pure math
class BlockBasis(NamedTuple):
    """The block-diagonal basis of one axis: row-stacked blocks ``(k, s_max)`` (``functional``) and their sizes."""

    basis: Tensor
    sizes: Sequence[int]


def blockwise(x: Tensor, basis: Tensor, sizes: Sequence[int], transpose: bool = False) -> Tensor:
    """``x @ blockdiag(Q_c)`` (or ``Q_c^T``) over the last axis of ``x`` (``(..., r, k)``), one
    batched product per run of equal blocks. ``basis`` is row-stacked ``(k, s_max)`` (``functional``)."""
    out = torch.empty_like(x)
    for run in F.block_runs(sizes):
        q = F.block_view(basis, run).to(x.dtype)
        if transpose:
            q = q.transpose(-1, -2)
        xs = x[..., run.start : run.stop].unflatten(-1, (run.count, run.size)).transpose(-3, -2)
        out[..., run.start : run.stop].unflatten(-1, (run.count, run.size)).transpose(-3, -2).copy_(torch.matmul(xs, q))
    return out


def rotate(u: Tensor, rows: BlockBasis, cols: BlockBasis) -> Tensor:
    """``C = Q_rows^T U Q_cols`` for block-diagonal bases;
    ``u`` may carry leading batch dims (``(..., r, k)``)."""
    y = blockwise(u, *cols)
    return blockwise(y.transpose(-1, -2), *rows).transpose(-1, -2)


def unrotate(d: Tensor, rows: BlockBasis, cols: BlockBasis) -> Tensor:
    """``O = Q_rows D Q_cols^T`` (the inverse of ``rotate``)."""
    z = blockwise(d, *cols, transpose=True)
    return blockwise(z.transpose(-1, -2), *rows, transpose=True).transpose(-1, -2)


def adam_direction(c: Tensor, v: Tensor, *, step: int, momentum: float, beta2: float, eps: float) -> Tensor:
    """SOAP's element-wise rule on rotated coefficients: ``(c / (1 - mu^t)) / (sqrt(v / (1 - b2^t)) + eps)``
    (``c``: the rotated EMA momentum, ``v``: the EMA of the squared rotated gradient, ``t = step``)."""
    denom = (v / (1.0 - beta2**step)).sqrt_().add_(eps)
    return c.div(1.0 - momentum**step).div_(denom)


def block_pair_rms_(d: Tensor, row_sizes: Sequence[int], col_sizes: Sequence[int], tiny: float = 1e-30) -> Tensor:
    """Scale every block pair ``d[b, c]`` of ``d`` (``(r, k)``) to an RMS of 1, in place (an all-zero
    block stays zero); one reduction per pair of runs of equal blocks."""
    for rr in F.block_runs(row_sizes):
        for cr in F.block_runs(col_sizes):
            v = d[rr.start : rr.stop, cr.start : cr.stop].unflatten(0, (rr.count, rr.size)).unflatten(2, (cr.count, cr.size))
            ms = v.square().mean(dim=(1, 3), keepdim=True)
            v.mul_(ms.clamp_min_(tiny).rsqrt_())
    return d


# ----------------------------------------------------------------------------- layouts
_WAY_OUT = ("side='both' blocks both axes, so each must be cut at its own shard boundaries: shard each axis "
            "with a plain Shard over at most one mesh dim and give each side a block count that divides its "
            "non-empty shards (or use side='input' / side='output')")


def two_sided_layouts(p: Tensor, group: dict, stat_group, transposed: bool, layout_for):
    """``(input-side layout, output-side layout)`` of a matrix or expert stack; a ``ValueError`` with
    the way out when either axis cannot be blocked locally. ``layout_for(p, side, blocks,
    stat_group)`` makes one side's layout (``placement.layout_for``, ``experts.expert_layout``)."""
    in_side, out_side = ("output", "input") if transposed else ("input", "output")
    try:
        lin = layout_for(p, in_side, group["blocks"], stat_group)
    except ValueError as exc:
        raise ValueError(f"input side: {exc}. {_WAY_OUT}") from None
    try:
        lout = layout_for(p, out_side, group["out_blocks"], stat_group)
    except ValueError as exc:
        raise ValueError(f"output side: {str(exc).replace('blocks=', 'out_blocks=', 1)}. {_WAY_OUT}") from None
    return lin, lout


# ----------------------------------------------------------------------------- the step
def two_sided_update_(*, w: Tensor, u: Tensor, g: Tensor, rows: BlockBasis, cols: BlockBasis, factor: float,
                      dtype: torch.dtype, norm: str = "sign", v: Tensor | None = None, step: int = 1,
                      momentum: float = 0.0, beta2: float = 0.95, eps: float = 1e-8) -> None:
    """``W += factor * Q_rows D Q_cols^T`` for one matrix (``w``, ``u`` the momentum, ``g`` the gradient,
    all oriented ``(rows axis, cols axis)``), products in ``dtype``. ``norm="adam"`` also updates
    ``v`` (the EMA of the squared rotated gradient, in its own dtype, fp32 at least) in place and
    takes ``step`` (1-based) for the bias corrections. ``factor`` carries sign's ``1/sqrt(m)``."""
    if norm == "sign":
        d = rotate(u.to(dtype), rows, cols).sign_()
    else:  # rotate the momentum and the gradient in one pass; V and the ratio in fp32 at least
        c, gr = rotate(torch.stack([u, g]).to(dtype), rows, cols).unbind(0)
        gr = gr.to(v.dtype)
        v.mul_(beta2).addcmul_(gr, gr, value=1.0 - beta2)
        d = adam_direction(c.to(v.dtype), v, step=step, momentum=momentum, beta2=beta2, eps=eps)
        d = block_pair_rms_(d, rows.sizes, cols.sizes).to(dtype)
    o = unrotate(d, rows, cols)
    o.mul_(factor)
    w.add_(o.to(w.dtype))
