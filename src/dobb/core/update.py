"""Dobb's update: ``W <- (1 - lr wd) W - lr * s * O`` for every matrix of a param group.

The direction ``O`` comes from ``functional.add_directions_`` (one-sided: ``apply_directions``),
``functional.two_sided_update_`` (``side="both"``: ``apply_two_sided``) or Newton-Schulz on the
Dobb-preconditioned update (``norm="muon"``: ``apply_preconditioned_muon``). This module decides which
kernel runs where and batches equal blocks; ``core.optimizer.Dobb._matrix_step`` hands it plain local
tensors. Every matrix is a stack (a 2-D parameter a stack of one, an expert stack one of ``E``, see
``layout``): its blocks join the batch of their shape whatever the stack size. Per matrix ``W``
(``m x n``) with gradient ``G`` the step is

1. ``M <- mu M + G``; ``U = G + mu M`` (Nesterov) or ``U = M``;
2. on refresh steps: block statistics ``A_b`` (EMA over captures) and bases
   ``Q_b <- qr(A_b Q_b)`` (``ortho_steps`` times) or ``eigh(A_b)``;
3. ``O[:, b] = normalize(U[:, b] Q_b) Q_b^T`` (sign: ``sign(.)/sqrt(m)``, or unit ell2 columns);
4. ``W <- (1 - lr*wd) W - lr * tau*sqrt(max(m, n)) * O``.

Steps 1-2 run in ``core.optimizer.Dobb`` (momentum) and ``core.statistics`` (refresh), 3-4 here. All
equal-size blocks of all matrices of a param group go through one batched ``bmm``/QR call.
"""
from __future__ import annotations

import math
from collections import defaultdict
from typing import Any, NamedTuple

import torch
from torch import Tensor

from .. import functional as F
from .._compiled import compiled
from ..distribution import OwnerCompute, wire_dtype
from ..functional import BlockBasis, two_sided_update_
from ..layout import MatrixLayout
from ..newton_schulz import NS_COEFFICIENTS, NS_EPS, NS_STEPS, orthogonalize, resolve_ns_dtype, widening_dtype
from .kernels import compiled_muon_directions, compiled_one_sided, rotated_adam, rotated_adam_all, two_sided_group
from .statistics import all_reduce_sum_

__all__ = ["FUSE_MIN_BLOCK_WORK", "OneSided", "TwoSided", "decay_in_update", "apply_directions", "apply_two_sided",
           "apply_preconditioned_muon", "precondition", "apply_whole_steps", "whole_step_owner", "Prepared",
           "prepare_direction", "DirectionCache", "cacheable", "prepared_directions", "fused_decays",
           "apply_prepared", "two_sided_sign_"]

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
    """One matrix (stack) of a ``side="both"`` group: its ``plan`` (``Plan``: both sides'
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
    if torch.compiler.is_compiling():
        # Inductor cannot functionalize an in-place baddbmm into a strided view of W; the compiler
        # fuses the separate decay pass anyway
        return False
    rows = w.shape[-1 - layout.blocked_axis]  # the axis that is not blocked
    # a list, not min(..., default=): Dynamo cannot trace the keyword, and a graph break here split
    # every compiled step in two
    return (w.device.type == "cpu" and not isinstance(lr, torch.Tensor)
            and w.dtype == F.matmul_dtype(basis_dtype, w.device, product_dtype)
            and min([rows * s * s for s in layout.local_sizes if s > 0] or [0]) >= FUSE_MIN_BLOCK_WORK)


class Prepared(NamedTuple):
    """One matrix's one-sided direction as ``apply_directions`` builds it, kept across steps
    (``DirectionCache``): the ``add_directions_`` items of its runs of equal blocks (views of the
    weight, the update and the basis; ``factor`` and ``beta`` are set per step), the product
    ``dtype``, the update scale and whether the decay can be the reconstruction's ``beta``
    (``decay_in_update`` for a float lr)."""

    tensors: tuple  # (w, u, basis): the local tensors the views are of (the cache's key)
    ptrs: tuple  # their data pointers: a tensor given new storage (``p.data = ...``) is prepared again
    settings: tuple  # (norm, tau, product_dtype, basis_dtype)
    items: tuple  # (Blocks, l2 group) per run
    dtype: torch.dtype
    scale: float  # update_scale(m, n, tau)
    root: float  # sign's sqrt(rows), else 1.0
    fuse: bool
    views: tuple = ()  # per run: a dict of ``_kernel_views`` by kernel, or None (``add_directions_`` per step)


def prepare_direction(layout: MatrixLayout, basis: Tensor, u: Tensor, w: Tensor, *, norm: str, tau: float,
                      product_dtype, basis_dtype: torch.dtype) -> Prepared:
    """``Prepared`` of one matrix of a one-sided group: exactly the views ``apply_directions`` takes."""
    u3, w3, b3 = _oriented(layout.stacked(u), layout), _oriented(layout.stacked(w), layout), layout.stacked(basis)
    items = []
    for run in F.block_runs(layout.local_sizes):
        cols = slice(run.start, run.stop)
        items.append((F.Blocks(w=w3[:, :, cols], u=u3[:, :, cols], q=F.stack_block_view(b3, run), factor=0.0),
                      layout.l2_group))
    dtype = F.matmul_dtype(basis.dtype, basis.device, product_dtype)
    # views kept only where add_directions_ takes views of u (a stack of one, no conversion to dtype)
    views = tuple({} if layout.stack_local == 1 and u.dtype == dtype else None for _ in items)
    return Prepared((w, u, basis), (w.data_ptr(), u.data_ptr(), basis.data_ptr()),
                    (norm, tau, product_dtype, basis_dtype), tuple(items), dtype, F.update_scale(*layout.shape, tau),
                    math.sqrt(layout.rows) if norm == "sign" else 1.0,
                    decay_in_update(w, layout, lr=0.0, basis_dtype=basis_dtype, product_dtype=product_dtype), views)


class DirectionCache:
    """Per matrix, its ``Prepared`` direction, reused while the weight, update and basis tensors are the
    same objects on the same storage and the group's settings are unchanged (a refresh writes the
    basis in place, so its views stay valid; a load replaces the tensors). A cache derived from the
    state, never saved or copied: what it saves per matrix and step is the Python and the view
    operations of building the items again (a dozen dispatches), not any arithmetic."""

    def __init__(self):
        self.entries: dict[Tensor, Prepared] = {}  # by parameter
        self.signs: dict[Any, SignViews] = {}  # by plan (side="both", sign: ``two_sided_sign_``)

    def sign_views(self, plan, w: Tensor, u: Tensor, rows: BlockBasis, cols: BlockBasis) -> SignViews:
        """``plan``'s ``SignViews``, made again unless ``w``, ``u`` and both bases are the tensors (and
        storage) they were made of."""
        e = self.signs.get(plan)
        if not _made_of(e, (w, u, rows.basis, cols.basis)):
            e = self.signs[plan] = sign_views(w, u, rows, cols)
        return e

    def get(self, param: Tensor, layout: MatrixLayout, basis: Tensor, u: Tensor, w: Tensor, settings: tuple) -> Prepared:
        """``param``'s entry (the parameter: one entry per matrix whatever its local tensors), prepared
        again unless ``w``, ``u`` and ``basis`` (local tensors) are the ones it was prepared from."""
        e = self.entries.get(param)
        if not _made_of(e, (w, u, basis)) or e.settings != settings:
            norm, tau, product_dtype, basis_dtype = settings
            e = self.entries[param] = prepare_direction(layout, basis, u, w, norm=norm, tau=tau,
                                                    product_dtype=product_dtype, basis_dtype=basis_dtype)
        return e


def _made_of(entry, tensors: tuple) -> bool:
    """Whether a ``DirectionCache`` entry (``Prepared`` or ``SignViews``) holds views of ``tensors``: the
    same objects on the same storage (a tensor given new storage, ``p.data = ...``, is made again)."""
    return (entry is not None and all(a is b for a, b in zip(entry.tensors, tensors))
            and entry.ptrs == tuple(t.data_ptr() for t in tensors))


def cacheable(params: list[Tensor]) -> bool:
    """Whether a one-sided group's directions may come from a ``DirectionCache``: eager (a compiled
    step traces the plain path), on a CPU (where ``apply_directions`` runs one call per matrix)."""
    return not torch.compiler.is_compiling() and all(p.device.type == "cpu" for p in params)


def prepared_directions(cache: DirectionCache, group: dict, active: list[Tensor], layouts: list, states: list[dict],
                        u: list[Tensor], params: list[Tensor]) -> list[Prepared] | None:
    """The ``Prepared`` of every matrix of a one-sided group (parameters ``active``, local update ``u``
    and weights ``params``) from ``cache``, or None where the cache does not apply (``cacheable``)."""
    if not cacheable(params) or group["compile"]:  # compile: one kernel per group (apply_directions)
        return None
    settings = (group["norm"], group["tau"], group["product_dtype"], group["basis_dtype"])
    return [cache.get(p, lay, lay.local(s["basis"]), ut, pt, settings)
            for p, lay, s, ut, pt in zip(active, layouts, states, u, params)]


def fused_decays(group: dict, preps: list[Prepared] | None, params: list[Tensor], layouts: list) -> list[bool]:
    """Per matrix of ``group`` (local weights ``params``), whether its weight decay is the ``beta`` of its
    reconstruction ``baddbmm`` (``decay_in_update``: one pass over ``W`` instead of a multiply pass and a
    strided add pass), read from its ``Prepared`` where ``preps`` holds them; never for ``side="both"``
    or ``norm="muon"``. A tensor lr is never fused."""
    lr = group["lr"]
    if preps is not None:
        return [e.fuse and not isinstance(lr, torch.Tensor) for e in preps]
    if group["compile"]:  # the compiled one-sided kernel folds it in, where it runs (no l2 sums over
        # ranks: apply_directions); eager's add_directions_ takes a beta for a stack of one only
        return [group["side"] != "both" and group["norm"] != "muon" and not group["whole_every"]
                and not isinstance(lr, torch.Tensor) and all(lay.l2_group is None for lay in layouts)] * len(layouts)
    return [group["side"] != "both" and group["norm"] != "muon" and decay_in_update(
        pt, lay, lr=lr, basis_dtype=group["basis_dtype"], product_dtype=group["product_dtype"])
        for pt, lay in zip(params, layouts)]


def apply_prepared(preps: list[Prepared], decays: list[float | None], *, norm: str, lr) -> None:
    """``apply_directions`` of matrices whose items are ``preps`` (``DirectionCache``; CPU, one
    ``add_directions_`` call per run, as there), with ``decays[i]`` the ``beta`` of matrix ``i``. A stack of
    one whose update is in the product dtype runs ``add_directions_``' kernel on the item's views kept
    from the first step (``_kernel_views``): the same calls on the same views, without building them."""
    for e, beta in zip(preps, decays):
        factor = -lr * e.scale / e.root  # the same expression as apply_directions: the same rounding
        for (blocks, l2_group), views in zip(e.items, e.views):
            col_sq_sum = (lambda sq, g=l2_group: all_reduce_sum_(sq, g)) if l2_group is not None else None
            if views is None:
                F.add_directions_([F.Blocks(blocks.w, blocks.u, blocks.q, factor, beta)], norm=norm, dtype=e.dtype,
                                  col_sq_sum=col_sq_sum)
                continue
            small = norm == "sign" and beta is None and blocks.q.shape[-1] <= F.SMALL_BLOCK
            kind = "small" if small else "fused" if beta is not None else "plain"
            v = views.get(kind) or views.setdefault(kind, _kernel_views(blocks, kind))
            q = v[1].to(e.dtype)
            if small:  # add_directions_' small-block kernel: C^T = Q^T U^T, W^T += factor * Q C^T
                v[2].add_(torch.bmm(q, torch.bmm(q.transpose(1, 2), v[0]).sign_()), alpha=factor)
                continue
            c = F.block_coefficients(v[0], q, norm, col_sq_sum)
            if beta is not None:  # W_b <- beta W_b + factor C_b Q_b^T, one pass
                v[2].baddbmm_(c, q.transpose(1, 2), beta=beta, alpha=factor)
            else:
                o = torch.bmm(c, q.transpose(1, 2))
                v[2].add_(o.view(1, *o.shape).transpose(1, 2), alpha=factor)


def _kernel_views(b: F.Blocks, kind: str) -> tuple:
    """``(update, basis, weight)`` views of one run of a stack of one, exactly as ``add_directions_`` takes
    them for its ``kind`` of kernel (``"small"``: the transposed products; ``"fused"``: the ``baddbmm``
    into the weight; ``"plain"``: a product and a strided add); the basis view is converted per step."""
    r, c, s = b.u.shape[1], b.q.shape[1], b.q.shape[-1]
    if kind == "small":
        return b.u[0].t().reshape(c, s, r), b.q[0], b.w[0].t().view(c, s, r)
    ub, q = b.u.reshape(1, r, c, s).transpose(1, 2).reshape(c, r, s), b.q.reshape(c, s, s)
    return ub, q, (b.w[0].view(r, c, s).transpose(0, 1) if kind == "fused" else b.w.view(1, r, c, s))


def _oriented(t: Tensor, layout: MatrixLayout) -> Tensor:
    """A stack ``(E, m, n)`` with the blocked axis last."""
    return t if layout.blocked_axis == 1 else t.transpose(1, 2)


def apply_directions(mats: list[OneSided], *, norm: str, lr, tau: float, product_dtype, compile: bool = False) -> None:
    """``W -= lr * s * O`` with ``O`` from batched project -> normalize -> reconstruct, for every
    matrix of ``mats``.

    All equal-shape blocks of the group go through one ``add_directions_`` call on accelerators
    (stacked to save kernel launches); on CPU, where a strided block view feeds ``bmm`` at no cost
    while stacking matrices costs a transposing copy, one call per matrix. The constant
    ``-lr * s`` (and sign's ``1/sqrt(rows)``) is the kernel's ``factor``, so no update-sized
    temporary is written besides the coefficients. ``compile``: every matrix in one compiled kernel
    (``core.kernels.one_sided_``, the decay folded in), unless l2 norms are summed over ranks.
    """
    if compile and all(m.layout.l2_group is None for m in mats):
        compiled_one_sided(mats, [_oriented(m.layout.stacked(m.w), m.layout) for m in mats],
                           [_oriented(m.layout.stacked(m.u), m.layout) for m in mats], norm=norm, lr=lr, tau=tau,
                           product_dtype=product_dtype)
        return
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
                    momentum: float, beta2: float, eps: float, cache: DirectionCache | None = None,
                    compile: bool = False) -> None:
    """``side="both"``: ``W += factor * Q_rows D Q_cols^T`` (``functional.two_sided_update_``) for
    every matrix of every stack of ``mats`` (an expert stack: each expert with its own bases and
    ``second_moment``). Sign on a 2-D matrix runs ``two_sided_sign_``, its views kept in ``cache``
    (keyed by plan) across steps. ``compile``: ``two_sided_update_`` compiled, per matrix."""
    eager = not (compile or torch.compiler.is_compiling())
    update_ = compiled(two_sided_update_) if compile else two_sided_update_
    groups: dict[tuple, list] = defaultdict(list)  # off a CPU, uncompiled: equal matrices stacked, one call a group
    for plan, state, ut, gt, pt in mats:
        lin = plan.layout
        dtype = F.matmul_dtype(basis_dtype, pt.device, product_dtype)
        sides = sorted(plan.sides, key=lambda side: side.layout.blocked_axis)  # (rows side, cols side)
        # sign's 1/sqrt(m) with m = the global output axis (lin.rows), as one-sided Dobb
        factor = -lr * F.update_scale(*lin.shape, tau) / math.sqrt(lin.rows)
        if pt.device.type != "cpu" and not compile:
            w, u, g, bases = lin.stacked(pt), lin.stacked(ut), lin.stacked(gt), [s.layout.stacked(state[s.basis]) for s in sides]
            v = lin.stacked(state["second_moment"]) if norm == "adam" else None
            key = (w.shape[1:], w.dtype, u.dtype, lin.shape, lin.rows, state["step"], *(tuple(s.layout.local_sizes) for s in sides))
            groups[key] += [(w[e], u[e], g[e], *(b[e] for b in bases), None if v is None else v[e], factor, dtype) for e in range(w.shape[0])]
            continue
        if norm == "sign" and eager and pt.dim() == 2 and ut.dtype == dtype and ut.is_contiguous():
            # a 2-D matrix: its local tensors are the stack's only member (no stack views to take)
            bases = [BlockBasis(side.layout.local(state[side.basis]), side.layout.local_sizes) for side in sides]
            views = sign_views(pt, ut, *bases) if cache is None else cache.sign_views(plan, pt, ut, *bases)
            _sign_step(views, pt, ut, factor=factor, dtype=dtype)
            continue
        bases = [side.layout.stacked(state[side.basis]) for side in sides]
        v = lin.stacked(state["second_moment"]) if norm == "adam" else None
        w, u, g = lin.stacked(pt), lin.stacked(ut), lin.stacked(gt)
        for e in range(w.shape[0]):
            rows = BlockBasis(bases[0][e], sides[0].layout.local_sizes)
            cols = BlockBasis(bases[1][e], sides[1].layout.local_sizes)
            if norm == "sign" and eager and u[e].dtype == dtype and u[e].is_contiguous():
                two_sided_sign_(w[e], u[e], rows, cols, factor=factor, dtype=dtype)
                continue
            step = state["step"] + 1
            update_(w=w[e], u=u[e], g=g[e], rows=rows, cols=cols, factor=_number(factor, compile), dtype=dtype,
                    norm=norm, v=None if v is None else v[e], step=_number(step, compile), momentum=momentum,
                    beta2=beta2, eps=eps)
    for key, items in groups.items():
        two_sided_group(items, key[-2:], norm=norm, step=key[5] + 1, momentum=momentum, beta2=beta2, eps=eps)


class SignViews(NamedTuple):
    """``two_sided_sign_``'s views of one matrix (``DirectionCache.sign_views``): per axis its runs with
    the bases' block views (``(count, s, s)``, in the basis dtype), and ``u``'s views for the first
    product (``_axis``)."""

    tensors: tuple  # (w, u, rows basis, cols basis): the tensors the views are of
    ptrs: tuple
    rows: tuple  # ((run, block view), ...)
    cols: tuple
    ux: tuple


def sign_views(w: Tensor, u: Tensor, rows: BlockBasis, cols: BlockBasis) -> SignViews:
    runs = [tuple((run, F.block_view(b.basis, run)) for run in F.block_runs(b.sizes)) for b in (rows, cols)]
    tensors = (w, u, rows.basis, cols.basis)
    return SignViews(tensors, tuple(t.data_ptr() for t in tensors), *runs, _axis(u, [run for run, _ in runs[1]]))


def _axis(x: Tensor, runs: list) -> tuple:
    """``(count, rows, s)`` views of a 2-D ``x`` per run of its last axis, as ``functional.blockwise``
    takes them (``x[:, run].unflatten(-1, (count, s)).transpose(0, 1)``; a run over the whole axis
    without the slice, which is ``x`` itself)."""
    if len(runs) == 1 and runs[0].start == 0 and runs[0].stop == x.shape[1]:
        return (x.view(x.shape[0], runs[0].count, runs[0].size).transpose(0, 1),)
    return tuple(x[:, run.start : run.stop].view(x.shape[0], run.count, run.size).transpose(0, 1) for run in runs)


# ``torch.matmul`` of two 3-D tensors with the same batch is ``bmm`` of the same tensors (its expand and
# reshape are views of the same sizes and strides): called directly, the products are the same calls
# without five view dispatches each (tests/core/test_update.py checks the bits against functional).
def _products(xs: tuple, qs: list[tuple], out: Tensor, transpose: bool = False) -> Tensor:
    """``functional.blockwise``'s products of the run views ``xs`` (``_axis``) with the converted bases
    ``qs`` (``(run, Q)`` per run, ``Q^T`` with ``transpose``), copied into ``out``'s runs; returns ``out``."""
    for x, o, (_, q) in zip(xs, _axis(out, [run for run, _ in qs]), qs):
        o.copy_(torch.bmm(x, q.transpose(-1, -2) if transpose else q))
    return out


def _whole(qs: list[tuple], length: int) -> bool:
    """Whether ``qs`` is one block over the whole axis (``blocks=1``, ``out_blocks=1``)."""
    return len(qs) == 1 and qs[0][0].count == 1 and qs[0][0].size == length


def two_sided_sign_(w: Tensor, u: Tensor, rows: BlockBasis, cols: BlockBasis, *, factor: float,
                    dtype: torch.dtype) -> None:
    """``functional.two_sided_update_`` with ``norm="sign"`` for a contiguous ``u`` in ``dtype``, bit for
    bit: the same products of the same views, each basis converted to ``dtype`` once (not once per
    product), and where an axis is one block (``blocks=1`` / ``out_blocks=1``) no copy of a product into a
    buffer of the same layout. The row side's products come back transposed (``(k, r)``), so the
    rotation's sign is taken in that layout and transposed into the ``(r, k)`` coefficients (a sign is
    exact: the same values) and the reconstruction is scaled in its own layout and added through its
    transpose.

    ``w``, ``u``: ``(r, k)`` oriented (rows axis, cols axis); ``factor`` carries sign's ``1/sqrt(m)``."""
    _sign_step(sign_views(w, u, rows, cols), w, u, factor=factor, dtype=dtype)


def _sign_step(views: SignViews, w: Tensor, u: Tensor, *, factor: float, dtype: torch.dtype) -> None:
    r, k = u.shape
    qr, qc = ([(run, q.to(dtype)) for run, q in side] for side in (views.rows, views.cols))
    rr, cr = [run for run, _ in qr], [run for run, _ in qc]
    # C = Q_rows^T U Q_cols, then sign
    y = torch.bmm(views.ux[0], qc[0][1]).view(r, k) if _whole(qc, k) else _products(views.ux, qc, torch.empty_like(u))
    if _whole(qr, r):  # the sign in the product's layout, then one blocked transpose (faster than a strided sign)
        d = torch.bmm(_axis(y.t(), rr)[0], qr[0][1]).view(k, r).sign_().t().contiguous()
    else:
        d = torch.empty_like(y)
        _products(_axis(y.t(), rr), qr, d.t()).t().sign_()
    # O = Q_rows D Q_cols^T; W += factor * O
    if _whole(qc, k):
        z = torch.bmm(_axis(d, cr)[0], qc[0][1].transpose(-1, -2)).view(r, k)
    else:
        z = _products(_axis(d, cr), qc, torch.empty_like(d), transpose=True)
    if _whole(qr, r):
        o = torch.bmm(_axis(z.t(), rr)[0], qr[0][1].transpose(-1, -2)).view(k, r).mul_(factor).t()
    else:
        o = _products(_axis(z.t(), rr), qr, torch.empty_like(z.t()), transpose=True).t().mul_(factor)
    w.add_(o.to(w.dtype))


def apply_preconditioned_muon(mats: list[TwoSided], *, lr, tau: float, basis_dtype: torch.dtype, product_dtype,
                              momentum: float, beta2: float, eps: float, ns_dtype, compile: bool = False) -> None:
    """``norm="muon"`` (Dobb-preconditioned Muon) of each matrix (local rows, whole columns):

    1. ``C = U Q`` and ``Gq = G Q`` with ``Q`` the block-diagonal input-side basis;
    2. ``V <- beta2 V + (1 - beta2) Gq^2`` and ``R = (C / (1 - mu^t)) / (sqrt(V / (1 - beta2^t)) + eps)``
       (SOAP's rule on one side, ``functional.adam_direction``);
    3. ``P = R Q^T``, cut into the ``out_blocks`` row blocks of ``plan.ns_rows`` (whole on this rank);
    4. ``W_b -= lr * tau * sqrt(max(m_b, n)) * NS5(P_b)``: each row block moves as a Muon update of
       its own shape, as row-block Muon's blocks do.

    ``TwoSided`` carries the plan, the state (``basis``, ``second_moment``, ``step``), the update
    ``u``, the gradient ``g`` and the weight ``w`` (local tensors). Grouped across matrices, bit for
    bit: steps 1-3 stacked per group of equal matrices (``kernels.rotated_adam_all``), one ``orthogonalize``
    of all row blocks (equal shapes one batch), the cast and the adds once per block shape. ``compile``:
    the same calls as one compiled kernel, one call a step (``core.kernels.muon_directions``)."""
    ns = resolve_ns_dtype(ns_dtype, mats[0][4].device) if mats else None
    items = [(*_oriented_muon(plan, st, ut, gt, basis_dtype, product_dtype), tuple(plan.layout.local_sizes),
              st["step"] + 1) for plan, st, ut, gt, _ in mats]
    out_dtype = widening_dtype(ns, [m[4].dtype for m in mats])
    if compile:
        outs = compiled_muon_directions(items, [_ns_sizes(plan) for plan, *_ in mats], momentum=momentum,
                                        beta2=beta2, eps=eps, ns_dtype=ns, out_dtype=out_dtype)
    else:
        pre = rotated_adam_all(items, momentum=momentum, beta2=beta2, eps=eps)  # steps 1-3, stacked per equal matrices
        blocks = [b for (plan, *_), x in zip(mats, pre) for b in x.split(_ns_sizes(plan), dim=0)]
        outs = orthogonalize(blocks, NS_COEFFICIENTS, NS_STEPS, NS_EPS, dtype=ns, out_dtype=out_dtype)
    adds: dict[tuple, tuple[list, list]] = defaultdict(lambda: ([], []))  # by (rows, n, dtype): one scale each
    outs_iter = iter(outs)
    for plan, _, _, _, pt in mats:
        lay = plan.layout
        n = lay.shape[lay.blocked_axis]  # the input axis (global)
        w = pt.T if lay.blocked_axis == 0 else pt  # (out, in) view
        start = 0
        for size in _ns_sizes(plan):
            ws, os_ = adds[(size, n, pt.dtype, pt.device)]
            ws.append(w[start : start + size])
            os_.append(next(outs_iter).to(pt.dtype))  # no copy where orthogonalize cast the stack
            start += size
    for (size, n, _, _), (ws, os_) in adds.items():
        torch._foreach_add_(ws, torch._foreach_mul(os_, -lr * F.update_scale(size, n, tau)))


def _ns_sizes(plan) -> list[int]:
    """The row sizes of a matrix's Newton-Schulz blocks on this rank (``plan.ns_rows``)."""
    return [s for s in plan.ns_rows.local_sizes if s > 0]


def precondition(plan, state: dict, ut: Tensor, gt: Tensor, *, basis_dtype: torch.dtype, product_dtype, momentum: float,
                 beta2: float, eps: float) -> Tensor:
    """``norm="muon"``'s ``P = R Q^T`` of one matrix (local rows), advancing its ``second_moment``:
    steps 1-3 of ``apply_preconditioned_muon``. Oriented ``(out, in)``: a transposed weight's tensors
    (stored ``(in, out)``, input axis blocked on dim 0) are read through their transposes."""
    ut, gt, basis, v, dtype = _oriented_muon(plan, state, ut, gt, basis_dtype, product_dtype)
    return rotated_adam(ut, gt, basis, v, plan.layout.local_sizes, state["step"] + 1, dtype=dtype, momentum=momentum,
                        beta2=beta2, eps=eps)


def _oriented_muon(plan, state: dict, ut: Tensor, gt: Tensor, basis_dtype, product_dtype) -> tuple:
    """``(u, g, basis, second moment, product dtype)`` of ``precondition``, oriented ``(out, in)``."""
    lay = plan.layout
    v = lay.local(state["second_moment"])
    if lay.blocked_axis == 0:
        ut, gt, v = ut.T, gt.T, v.T
    return ut, gt, lay.local(state["basis"]), v, F.matmul_dtype(basis_dtype, ut.device, product_dtype)


# ----------------------------------------------------------------------------- compile=True
def _number(x, compile: bool):
    """A per-step number for a compiled kernel: a float64 0-d tensor (a float would be one graph per value)."""
    return torch.tensor(x, dtype=torch.float64) if compile else x


def whole_step_owner() -> OwnerCompute:
    """The distribution layer's owner compute over the default replicated group: ``apply_whole_steps``'s owner."""
    return OwnerCompute("default")


def apply_whole_steps(owner: OwnerCompute, group: dict, active: list[Tensor], plans: list, states: list[dict],
                      u: list[Tensor], grads: list[Tensor], params: list[Tensor]) -> None:
    """``whole_every``: ``W <- W - lr * tau * sqrt(max(m, n)) * NS5(X)`` of the whole matrix, computed by its
    owner (``whole_step_owner``; two all-to-alls under FSDP2), with ``X`` the Dobb-preconditioned ``P``
    (``norm="muon"``) or the momentum (two-sided sign): MuonBP's periodic full step on Dobb's forms."""
    if group["norm"] == "muon":  # P in the storage orientation (transposed weights: (in, out))
        xs = [precondition(plan, st, ut, gt, basis_dtype=group["basis_dtype"], product_dtype=group["product_dtype"],
                           momentum=group["momentum"], beta2=group["beta2"], eps=group["eps"])
              for plan, st, ut, gt in zip(plans, states, u, grads)]
        xs = [x.T if plan.layout.blocked_axis == 0 else x for x, plan in zip(xs, plans)]
    else:
        xs = list(u)
    dtype = resolve_ns_dtype(group["ns_dtype"], active[0].device)
    ns = lambda mats: orthogonalize(mats, NS_COEFFICIENTS, NS_STEPS, NS_EPS, method="standard", dtype=dtype)  # noqa: E731
    outs = owner.compute(owner.plan(active, [wire_dtype(x.dtype, dtype) for x in xs]), active, xs, ns, dtype)
    for p, pt, o in zip(active, params, outs):
        m, n = p.shape
        pt.add_(o.to(pt.dtype).mul_(-group["lr"] * F.update_scale(m, n, group["tau"])))
