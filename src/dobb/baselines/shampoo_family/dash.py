"""Block Shampoo as DASH does it (Modoranu et al., ``ista-daslab-optimizers``, module ``dash``).

Each matrix (this rank's shard of it, see Locality) is cut into tiles of ``block_size`` on both
axes, full ``B x B`` tiles first, then the right and bottom remainders and the corner. For every
tile ``G_t`` of the gradient, at every step ``t``:

1. ``L <- b_LR L + (1 - b_LR) G_t G_t^T``, ``R <- b_LR R + (1 - b_LR) G_t^T G_t`` (fp32 at least;
   ``beta_lr = 1`` sums them, AdaGrad-style, as DASH allows);
2. ``M <- b_g M + (1 - b_g) G`` (the gradient EMA, ``beta_g = 0``: ``M = G``);
3. at step 1 and every ``precondition_every``-th step: ``L^{-1/4}`` and ``R^{-1/4}`` of
   ``L + eps_inv_root I`` by ``inverse_root`` (``dobb.baselines.shampoo_family._matrix_roots``: ``"eigh"``,
   ``"newton-db"``, ``"coupled-newton"``), all factors of one size in one batched call;
4. ``U_t = L^{-1/4} M_t R^{-1/4}`` (one ``bmm`` chain per tile shape);
5. ``graft="adam"``: ``A <- b_graft A + (1 - b_graft) G^2`` and ``U_t`` is rescaled to the
   Frobenius norm of the tile's Adam direction ``(M/(1-b_g^t)) / (sqrt(A/(1-b_graft^t)) + eps_graft)``
   (DASH's default, from Distributed Shampoo); ``W <- (1 - lr*wd) W - lr * U``.
   ``graft="none"``: the factors and ``M`` are bias-corrected and each tile moves as a Muon update
   of a matrix of its own shape, ``W_t <- W_t - lr * tau*sqrt(max(r, c)) * U_t`` (Block Muon's
   statement of the shared protocol): with no EMA ``U_t`` is the tile's polar factor ``UV^T``.

Update scale: the shared protocol's ``s = tau*sqrt(max(m, n))`` exists to give an orthogonal
direction AdamW's update RMS. An Adam-grafted update already has the Adam update's norm, tile by
tile, so ``graft="adam"`` takes ``lr`` as AdamW does (no ``s``; ``tau`` is unused), exactly DASH's
rule; ``graft="none"`` is an orthogonal-like direction and gets the protocol's ``s`` per tile.

Locality: every quantity above belongs to one tile, so the step needs no communication when each
tile lies within one shard. Tiles are cut from the start of this rank's shard (a plain tensor is
one shard): under ``Shard`` placements of either axis (FSDP2, tensor parallel, both) the update is
computed from local data only. It equals the single-process update when every shard boundary is a
multiple of ``block_size`` (the usual case); otherwise the shard boundaries are extra tile cuts.
``_StridedShard`` and ``Partial`` placements raise at construction.

State per matrix: ``momentum`` and ``graft_sq`` (like the weight, sharded with it), ``step``, and
the local tile factors and their roots as flat fp32 buffers ``L``, ``R``, ``L_root``, ``R_root``
(tile by tile, in tile order). Their length depends on the local shard: for a DTensor weight they
are one DTensor with a row per shard (``dobb.sharding.per_shard_state``), so
``torch.distributed.checkpoint`` saves every rank's factors, and a checkpoint resumes on the same
sharding; ``dobb.resume.check_resume`` refuses another one before anything loads.
"""
from __future__ import annotations

from dataclasses import dataclass
from collections import defaultdict

import torch
from torch import Tensor

from ..._base import MatrixOptimizer, _name_of
from ...layout import is_dtensor, to_local
from .. import _common as C
from ._matrix_roots import INVERSE_ROOTS, inverse_root
from ..._hparams import (ScaledOptions, closed_unit_interval, integer, non_negative, one_of, option, positive,
                        unit_interval)

GRAFTS = ("adam", "none")
ROOT = 4  # Shampoo's two-sided exponent: L^{-1/4} G R^{-1/4}
NORM_EPS = 1e-16  # Distributed Shampoo's guard: a zero gradient tile gives a zero update, not NaN

__all__ = ["Dash", "Shampoo", "GRAFTS", "tile_specs", "to_tiles", "from_tiles"]


def tile_specs(m: int, n: int, block_size: int) -> list[tuple[int, int, int]]:
    """``(count, rows, cols)`` of the tile stacks of an ``m x n`` matrix, in ``to_tiles`` order."""
    a, r = divmod(m, block_size)
    b, c = divmod(n, block_size)
    B = block_size
    specs = [(a * b, B, B), (a, B, c), (b, r, B), (1, r, c)]
    return [s for s in specs if s[0] and s[1] and s[2]]


def to_tiles(x: Tensor, block_size: int) -> list[Tensor]:
    """The tiles of ``x`` as ``(count, rows, cols)`` stacks (copies), in ``tile_specs`` order:
    the full tiles row-major, the right remainder top to bottom, the bottom one left to right,
    the corner."""
    m, n = x.shape
    B = block_size
    a, r = divmod(m, B)
    b, c = divmod(n, B)
    out = []
    if a and b:
        out.append(x[:a * B, :b * B].reshape(a, B, b, B).transpose(1, 2).reshape(a * b, B, B))
    if a and c:
        out.append(x[:a * B, b * B:].reshape(a, B, c))
    if r and b:
        out.append(x[a * B:, :b * B].reshape(r, b, B).transpose(0, 1).contiguous())
    if r and c:
        out.append(x[a * B:, b * B:].unsqueeze(0).contiguous())
    return out


def from_tiles(tiles: list[Tensor], m: int, n: int, block_size: int, like: Tensor | None = None) -> Tensor:
    """The ``m x n`` matrix whose ``to_tiles`` are ``tiles`` (inverse of ``to_tiles``); ``like``
    gives dtype and device when there are no tiles (an empty shard)."""
    B = block_size
    a, r = divmod(m, B)
    b, c = divmod(n, B)
    like = tiles[0] if tiles else like if like is not None else torch.zeros(0)
    x = like.new_empty(m, n)
    it = iter(tiles)
    if a and b:
        x[:a * B, :b * B] = next(it).reshape(a, b, B, B).transpose(1, 2).reshape(a * B, b * B)
    if a and c:
        x[:a * B, b * B:] = next(it).reshape(a * B, c)
    if r and b:
        x[a * B:, :b * B] = next(it).transpose(0, 1).reshape(r, b * B)
    if r and c:
        x[a * B:, b * B:] = next(it)[0]
    return x


def _tile_views(x: Tensor, block_size: int) -> list[Tensor]:
    """Views into the 2-D ``x`` of its tiles, in ``to_tiles`` order, no copy: the full tiles as
    ``(a, b, B, B)`` (tile ``(i, j)`` at ``[i, j]``), the remainders as ``(count, rows, cols)``.
    A contiguous ``(count, rows, cols)`` stack viewed as the same shape lines up with it tile by tile."""
    m, n = x.shape
    B = block_size
    a, r = divmod(m, B)
    b, c = divmod(n, B)
    out = []
    if a and b:
        out.append(x[:a * B, :b * B].view(a, B, b, B).transpose(1, 2))
    if a and c:
        out.append(x[:a * B, b * B:].view(a, B, c))
    if r and b:
        out.append(x[a * B:, :b * B].view(r, b, B).transpose(0, 1))
    if r and c:
        out.append(x[a * B:, b * B:].unsqueeze(0))
    return out


def _divided_stack(view: Tensor, shape, dtype: torch.dtype, divisor: float) -> Tensor:
    """``to_tiles(x.to(dtype)) / divisor`` for one tile stack of ``x`` from its ``_tile_views``
    view: a fresh contiguous ``shape`` stack, written once (element-wise: the same numbers)."""
    out = torch.empty(shape, dtype=dtype, device=view.device)
    if view.dtype == dtype:
        torch.div(view, divisor, out=out.view(view.shape))
        return out
    out.view(view.shape).copy_(view)  # the exact widening first, as ``x.to(dtype)`` does
    return out.div_(divisor)


def _factor_views(flat: Tensor, specs, side: int) -> list[Tensor]:
    """``(count, k, k)`` views into a flat factor buffer, ``k`` the tile's rows (side 1) or cols (2)."""
    views, start = [], 0
    for spec in specs:
        count, k = spec[0], spec[side]
        views.append(flat[start:start + count * k * k].view(count, k, k))
        start += count * k * k
    return views


def _flat(buffer: Tensor) -> Tensor:
    """This rank's flat factor buffer (a DTensor's local row, its padding at the end)."""
    return to_local(buffer).view(-1)


def _factor_dtype(p: Tensor) -> torch.dtype:
    return torch.float64 if p.dtype == torch.float64 else torch.float32


@dataclass(frozen=True, kw_only=True)
class ShampooOptions(ScaledOptions):
    """DASH's options but the tile size (Shampoo: one tile per matrix)."""
    beta_lr: float = option(0.95, closed_unit_interval.hint("1 sums the factors"))
    beta_g: float = option(0.9, unit_interval)
    beta_graft: float = option(0.95, unit_interval)
    graft: str = option("adam", one_of(*GRAFTS))
    eps_graft: float = option(1e-8, positive)
    precondition_every: int = option(10, integer(1))
    inverse_root: str = option("eigh", one_of(*INVERSE_ROOTS))
    eps_inv_root: float = option(1e-10, non_negative)
    newton_steps: int = option(30, integer(1, 1000))
    newton_tol: float = option(1e-4, non_negative.hint("0: a fixed newton_steps"))


@dataclass(frozen=True, kw_only=True)
class DashOptions(ShampooOptions):
    block_size: int = option(1024, integer(1))


class _DashFamily(MatrixOptimizer):
    """DASH's step (factors, inverse roots, grafting), shared by Dash and Shampoo; each says how a
    matrix is cut into tiles (``_block_size``) and how its factors follow the shards (``_layout_note``)."""

    Options = DashOptions
    _own_dtype_keys = ("L", "R", "L_root", "R_root")

    def _check_matrix_group(self, group):
        for i, p in enumerate(group["params"]):
            if is_dtensor(p):  # tiles are cut within the local shard: it must be a contiguous rectangle
                from ...sharding import axis_split
                try:
                    axis_split(p)
                except ValueError as exc:
                    raise ValueError(f"{_name_of(p, self._param_names, i)}: Dash cuts tiles within the local "
                                     f"shard, which must be a contiguous block of rows and columns: {exc}") from None

    def _init_matrix_state(self, group):
        for p in group["params"]:
            st = self.state[p]
            if "momentum" in st:
                continue
            st["step"] = 0
            st["momentum"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            st["graft_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            local = to_local(p)
            kw = dict(dtype=_factor_dtype(p), device=local.device)
            for key, side in (("L", 1), ("R", 2)):
                if is_dtensor(p):
                    from ...sharding import local_shapes, per_shard_state  # DTensor code loads on use

                    # every rank's factors as one DTensor (one row per shard, padded to the largest)
                    numel = max(self._factor_numel(group, shape, side) for shape in local_shapes(p))
                    for k in (key, key + "_root"):
                        st[k] = per_shard_state(torch.zeros(1, numel, **kw), p)
                else:
                    numel = self._factor_numel(group, tuple(local.shape), side)
                    st[key] = torch.zeros(numel, **kw)
                    st[key + "_root"] = torch.zeros(numel, **kw)

    def _factor_numel(self, group, shape, side: int) -> int:
        specs = tile_specs(*shape, self._block_size(group, shape))
        return sum(s[0] * s[side] ** 2 for s in specs)

    def _matrix_step(self, group, active):
        graft = group["graft"]
        b_lr, b_g, b_a = group["beta_lr"], group["beta_g"], group["beta_graft"]
        states = [self.state[p] for p in active]
        for st in states:
            st["step"] += 1
        grads = [to_local(p.grad) for p in active]
        moms = [to_local(st["momentum"]) for st in states]
        if b_g == 0:
            torch._foreach_copy_(moms, grads)
        else:
            torch._foreach_lerp_(moms, grads, 1 - b_g)
        if graft == "adam":
            sqs = [to_local(st["graft_sq"]) for st in states]
            torch._foreach_mul_(sqs, b_a)
            torch._foreach_addcmul_(sqs, grads, grads, value=1 - b_a)

        # 1. factor EMAs, tile by tile, in place in the flat buffers
        plans = []
        for p, g, st in zip(active, grads, states):
            B = self._block_size(group, g.shape)
            specs = tile_specs(*g.shape, B)
            views = {k: _factor_views(_flat(st[k]), specs, 1 if k[0] == "L" else 2) for k in ("L", "R", "L_root", "R_root")}
            for t, lf, rf in zip(to_tiles(g.to(_flat(st["L"]).dtype), B), views["L"], views["R"]):
                if b_lr == 1:
                    lf.baddbmm_(t, t.mT)
                    rf.baddbmm_(t.mT, t)
                else:
                    lf.baddbmm_(t, t.mT, beta=b_lr, alpha=1 - b_lr)
                    rf.baddbmm_(t.mT, t, beta=b_lr, alpha=1 - b_lr)
            plans.append((B, specs, views))

        # 2. inverse roots of every due factor: one batched call per factor size (and dtype)
        due = defaultdict(lambda: ([], []))
        for st, (_, specs, views) in zip(states, plans):
            t = st["step"]
            if t == 1 or t % group["precondition_every"] == 0:
                # graft="none" uses the root's scale: bias-correct the EMA (graft="adam" rescales anyway)
                bias = 1 - b_lr ** t if graft == "none" and b_lr < 1 else 1.0
                for key in ("L", "R"):
                    for f, r in zip(views[key], views[key + "_root"]):
                        srcs, dsts = due[(f.shape[-1], f.dtype)]
                        srcs.append(f / bias if bias != 1.0 else f)
                        dsts.append(r)
        for srcs, dsts in due.values():
            roots = inverse_root(torch.cat(srcs), group["inverse_root"], ROOT, group["eps_inv_root"],
                                 group["newton_steps"], group["newton_tol"] or None, overwrite=True)
            torch._foreach_copy_(dsts, list(roots.split([d.shape[0] for d in dsts])))

        # 3. the preconditioned, grafted (or protocol-scaled) tile updates, tile stack by tile stack,
        # each added to its tiles of the weight in place (no full-matrix temporaries)
        params = [to_local(p) for p in active]
        targets, updates = [], []
        for w, m, st, (B, specs, views) in zip(params, moms, states, plans):
            t = st["step"]
            bc_g = 1 - b_g ** t if b_g > 0 else 1.0
            dtype = _flat(st["L"]).dtype
            if graft == "adam":
                bc_a = 1 - b_a ** t
                sq_views = _tile_views(to_local(st["graft_sq"]), B)
                scratch = None
            # the update goes into the weight's tiles in place; a weight of a narrower dtype gets it as
            # one fp32 matrix (its rounded add then sees the whole matrix's layout, as it always did)
            whole = None if w.dtype == dtype else torch.empty(m.shape, dtype=dtype, device=m.device)
            dest = _tile_views(w if whole is None else whole, B)
            tiles = zip(to_tiles(m.to(dtype), B), dest, views["L_root"], views["R_root"])
            for i, (mt, w_t, lr_, rr_) in enumerate(tiles):
                u = torch.bmm(torch.bmm(lr_, mt), rr_)
                if graft == "adam":
                    # (M / bc_g) / (sqrt(A / bc_a) + eps_graft) is element-wise, so the same numbers in any
                    # layout; its norm (a reduction) is taken in to_tiles' layout of the whole matrix: a
                    # fresh stack, or, where to_tiles gives a strided view, the same view of a scratch matrix
                    den = _divided_stack(sq_views[i], mt.shape, dtype, bc_a).sqrt_().add_(group["eps_graft"])
                    if mt.is_contiguous():
                        adam = torch.div(mt, bc_g)
                    else:
                        scratch = torch.empty(m.shape, dtype=dtype, device=m.device) if scratch is None else scratch
                        adam = torch.div(mt, bc_g, out=_tile_views(scratch, B)[i].view(mt.shape))
                    factor = torch.linalg.matrix_norm(adam.div_(den), keepdim=True)
                    u.mul_(factor.div_(torch.linalg.matrix_norm(u, keepdim=True).add_(NORM_EPS)))
                else:
                    u.mul_(C.update_scale(mt.shape[1], mt.shape[2], group["tau"]) / bc_g)
                if whole is None:
                    targets.append(w_t)
                    updates.append(u.view(w_t.shape))
                else:
                    w_t.copy_(u.view(w_t.shape))
            if whole is not None:
                targets.append(w)
                updates.append(whole)
        C.apply_protocol(params, targets, updates, [1.0] * len(targets), group["lr"], group["weight_decay"])


class Dash(_DashFamily):
    """Block Shampoo (DASH) for hidden matrices, AdamW for the rest; see the module docstring.

    Args (defaults are DASH's): ``lr``, ``weight_decay`` (decoupled), ``block_size`` (1024),
    ``beta_lr`` (0.95, factor EMA; 1 sums), ``beta_g`` (0.9, gradient EMA), ``beta_graft`` (0.95,
    Adam grafting's second moment), ``graft`` (``"adam"`` or ``"none"``), ``eps_graft`` (1e-8),
    ``precondition_every`` (10), ``inverse_root`` (``"eigh"``, ``"newton-db"``,
    ``"coupled-newton"``), ``eps_inv_root`` (1e-10, damping of the factors), ``newton_steps`` (30:
    coupled-newton's iteration count, newton-db's cap), ``newton_tol`` (1e-4: newton-db stops once
    ``||Z Y - I||_F / sqrt(n)`` is below it, and warns when a factor stops above it; 0 runs exactly
    ``newton_steps``, as DASH's authors do), ``tau`` (0.2, used by ``graft="none"`` only), ``adamw_betas``,
    ``adamw_eps``.
    """

    algorithm = "dash"
    Options = DashOptions

    def _block_size(self, group, shape) -> int:
        return group["block_size"]

    def _layout_note(self, group) -> str:
        return (f"its tile factors are cut within each shard of the weight (block_size="
                f"{group['block_size']}), so they follow the shards")


class Shampoo(_DashFamily):
    """Two-sided Shampoo with DASH's options on whole matrices: DASH's step (``_DashFamily``) with one
    tile per matrix (``block_size`` is the matrix; no other argument changes). Under sharding the tile
    is this rank's shard, so the step stays local: sharded Shampoo is block-diagonal over the shards."""

    algorithm = "shampoo"
    Options = ShampooOptions

    def _block_size(self, group, shape) -> int:
        return max(1, *shape)

    def _layout_note(self, group) -> str:
        return "its factors are those of each shard of the weight (one tile per shard), so they follow the shards"
