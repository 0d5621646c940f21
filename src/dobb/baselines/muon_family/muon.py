"""Muon under the shared update-scale protocol, with AdamW groups in the same optimizer.

Step for a matrix ``W`` (``m x n``), exactly ``torch.optim.Muon(adjust_lr_fn="match_rms_adamw")``
when ``tau = 0.2`` and Newton-Schulz runs in bf16 as torch's does (``ns_dtype="bfloat16"``, or
``"auto"`` on a device with native bf16; tests compare weights bitwise after several steps):

1. ``buf <- buf + (1 - mu) (G - buf)`` (torch's EMA momentum; the paper's ``mu M + G`` (docs/algorithm.md) differs by
   the constant factor ``1 - mu``, which orthogonalization removes);
2. ``U = G + mu (buf - G)`` with Nesterov (default, as torch), else ``U = buf``;
3. ``O = NS5(U)`` (``||O||_F^2 ~ min(m, n)``, Table 9);
4. ``W <- (1 - lr*wd) W - lr * tau*sqrt(max(m, n)) * O``.

``_MuonFamily`` holds steps 1, 2 and 4 for every baseline built on Muon's momentum (PR-Muon,
Block Muon); subclasses only say how ``U`` becomes a direction (``_directions``). A whole matrix's
NS5 of a sharded weight is gathered on every rank, unless the optimizer holds an owner-compute
strategy (``dobb.distribution.OwnerCompute``: OwnerMuon, MuonBP), which computes it on one rank.
Muon and OwnerMuon share their direction (``muon_directions``), not a class.

``heads`` / ``split_sizes`` (Muon, Block Muon, NorMuon; see ``_split``) cut a fused weight
(Q/K/V, per head) into parts that are orthogonalized and scaled as separate matrices (CMuon).
``tiled_directions`` is the family's update of a matrix cut into tiles (CMuon's parts, Block
Muon's and MuonBP's blocks): each tile a matrix of its own under the protocol.
"""
from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..._base import MatrixOptimizer, _name_of
from ...distribution import OwnerCompute, OwnerPlan, wire_dtype
from ...attention_heads import check_heads_apply, head_rows, shapes_note
from ..._hparams import Rule, ScaledOptions, boolean, option, unit_interval
from ...layout import is_dtensor, to_local
from .. import _common as C
from ._split import WHOLE, SplitOptions, Tile, row_parts, row_tiles
from ...newton_schulz import NSOptions, ns_options, orthogonalize, widening_dtype


@dataclass(frozen=True, kw_only=True)
class MuonOptions(ScaledOptions, NSOptions):
    """Muon's momentum and Newton-Schulz options, shared by the Muon family."""
    momentum: float = option(0.95, unit_interval)
    nesterov: bool = option(True, boolean)


# Block Muon's and MuonBP's block axis
AXIS = Rule(lambda v: v in (0, 1) and not isinstance(v, bool), "be 0 (row blocks) or 1 (column blocks)")


@dataclass(frozen=True, kw_only=True)
class MuonSplitOptions(MuonOptions, SplitOptions):
    """Muon's options with the fused-weight split (Muon, CMuon, NorMuon, Block Muon)."""


class _MuonFamily(MatrixOptimizer):
    """Muon's momentum and protocol; subclasses implement ``_directions``."""

    Options = MuonOptions
    _uses_step = False  # whether the state carries a step counter (schedules)
    # how a whole matrix's NS5 is distributed: None gathers it on every rank; an OwnerCompute (set by
    # the constructor of OwnerMuon and MuonBP) computes it on its owner
    _distribution: OwnerCompute | None = None

    def __init__(self, params, **kwargs):
        super().__init__(params, **kwargs)
        groups = [g for g in self.param_groups if g["algorithm"] != "adamw" and g.get("heads") is not None]
        for heads in {g["heads"] for g in groups}:  # heads that cut no matrix would silently do nothing
            with contextlib.ExitStack() as stack:
                logical = [stack.enter_context(self._logical(g)) for g in groups if g["heads"] == heads]
                check_heads_apply(heads, [self._matrix_name(p, g) for g in logical for p in g["params"]])

    def _check_matrix_group(self, group: dict[str, Any]) -> None:
        if "split_sizes" not in self.matrix_defaults:
            return
        if group["num_heads"] is not None:
            warnings.warn("num_heads is deprecated: use heads (per-head blocks of the attention matrices, found "
                          "by name, as Dobb's heads); num_heads keeps its former meaning (every matrix of its "
                          "group cut into num_heads row blocks)", DeprecationWarning, stacklevel=4)
            if group["heads"] is not None:
                raise ValueError(f"heads={group['heads']} and num_heads={group['num_heads']} given together: "
                                 f"num_heads is the deprecated name of heads, give heads alone")
        for i, p in enumerate(group["params"]):
            try:
                self._row_parts(group, p)
            except ValueError as exc:
                raise ValueError(f"{self._matrix_name(p, group) or _name_of(p, self._param_names, i)}: {exc}") from None

    def _matrix_name(self, p: Tensor, group: dict[str, Any]) -> str | None:
        """The name of matrix ``p`` (a transposed group's view: its weight's); None when unnamed."""
        name = self._param_names.get(id(p))
        if name is None and group.get("transposed"):
            name = next((self._param_names.get(id(w)) for w, v in self._views.items() if v is p), None)
        return name

    def _row_parts(self, group: dict[str, Any], p: Tensor) -> list[int] | None:
        """Row sizes of ``p``'s parts under the group's ``heads`` (an attention q/k/v matrix: one part
        per head) or split (``None``: whole). ``p`` is the logical ``(out, in)`` matrix."""
        heads = group.get("heads")
        if heads is not None:
            name = self._matrix_name(p, group)
            if name is None:
                raise ValueError(f"heads={heads} finds attention matrices by name: pass named parameters "
                                 f"((name, tensor) pairs, as dobb.param_groups does) "
                                 f"{shapes_note(tuple(p.shape), bool(group.get('transposed')))}")
            rows = head_rows(name, tuple(p.shape), heads, bool(group.get("transposed")))
            if rows is not None:
                return rows if len(rows) > 1 else None
        return row_parts(p.shape, group.get("split_sizes"), group.get("num_heads"))

    def _ns(self, group: dict[str, Any], out_dtype=None):
        """The group's NS5 as a function of a list of matrices, its results cast to ``out_dtype``
        (``_out_dtype``: one cast per shape group, not one per matrix) or left in the NS dtype."""
        return lambda mats: orthogonalize(mats, group["ns_coefficients"], group["ns_steps"], group["eps"],
                                          **ns_options(group), out_dtype=out_dtype)

    @staticmethod
    def _out_dtype(group: dict[str, Any]):
        """``orthogonalize``'s ``out_dtype`` for a group's local updates: the weights' dtype where the
        cast from the Newton-Schulz dtype widens (``widening_dtype``); None for sharded (DTensor)
        groups, whose gathered tiles are scaled in their own dtype (``tiled_directions``)."""
        if any(is_dtensor(p) for p in group["params"]):
            return None
        return widening_dtype(ns_options(group)["dtype"], (p.dtype for p in group["params"]))

    def _init_matrix_state(self, group: dict[str, Any]) -> None:
        for p in group["params"]:
            state = self.state[p]
            if "momentum" not in state:
                state["momentum"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                if self._uses_step:
                    state["step"] = 0

    def _matrix_step(self, group: dict[str, Any], active: list[Tensor]) -> None:
        # gradients read before the state: see dobb._base.MatrixOptimizer._matrix_step
        grads = [to_local(p.grad) for p in active]
        states = [self.state[p] for p in active]
        bufs = [to_local(s["momentum"]) for s in states]
        mu = group["momentum"]
        torch._foreach_lerp_(bufs, grads, 1 - mu)
        u = torch._foreach_lerp(grads, bufs, mu) if group["nesterov"] else bufs
        params = [to_local(p) for p in active]
        targets, updates, scales = self._directions(group, active, states, params, u)
        C.apply_protocol(params, targets, updates, scales, group["lr"], group["weight_decay"])
        if self._uses_step:
            for s in states:
                s["step"] += 1

    def _owner_plans(self, group: dict[str, Any]) -> list[OwnerPlan]:
        """Each matrix's route to its owner (``_distribution``'s plan), in the wire dtype of its NS5."""
        dtype = ns_options(group)["dtype"]
        return self._distribution.plan(group["params"], [wire_dtype(p.dtype, dtype) for p in group["params"]])

    def _orthogonalize(self, group: dict, active: list[Tensor], u: list[Tensor]) -> list[Tensor]:
        """NS5 of each full matrix, returned as local shards: by its owner under ``_distribution``
        (its plan, ``_owner_plans``), else gathered (sharded ones) on every rank."""
        if self._distribution is not None:
            return self._distribution.compute([self._plans[p] for p in active], active, u, self._ns(group),
                                              ns_options(group)["dtype"])
        full = [C.gather_full(t, p) for t, p in zip(u, active)]
        outs = orthogonalize(full, group["ns_coefficients"], group["ns_steps"], group["eps"],
                             **ns_options(group), out_dtype=self._out_dtype(group))
        return [C.local_slice(o, p) for o, p in zip(outs, active)]

    def _directions(self, group: dict, active: list[Tensor], states: list[dict], params: list[Tensor],
                    u: list[Tensor]) -> tuple[list[Tensor], list[Tensor], list[float]]:
        """Returns ``(targets, updates, scales)`` for ``apply_protocol``."""
        raise NotImplementedError


class Muon(_MuonFamily):
    """Muon (momentum orthogonalized by Newton–Schulz) for hidden matrices, AdamW for the rest.

    Args: ``lr``, ``weight_decay``, ``tau`` (update scale ``tau*sqrt(max(m, n))``, 0.2 = torch's
    ``match_rms_adamw``), ``momentum`` (0.95), ``nesterov`` (True), ``ns_coefficients``,
    ``ns_steps`` (5), ``eps`` (1e-7), ``ns_method`` (``"standard"`` NS5 or ``"gram"``: the same
    iteration on the short side's Gram matrix, fewer FLOPs on non-square matrices; see
    ``dobb.newton_schulz``), ``ns_dtype`` (``"auto"``: bf16 where the device has native bf16 products, as torch's
    Muon always does, fp32 on CPUs without them; ``"float64"`` for exact comparisons),
    ``adamw_betas``, ``adamw_eps``; ``heads``, ``split_sizes`` (``None``: CMuon's split of fused
    weights, see ``_split``; ``heads=H`` cuts every attention q/k/v matrix into its heads,
    ``split_sizes="qkv"`` every ``3n x n`` matrix in three) and ``num_heads`` (deprecated: ``heads``).
    """

    algorithm = "muon"
    Options = MuonSplitOptions

    def _directions(self, group, active, states, params, u):
        return muon_directions(self, group, active, params, u)


def muon_directions(opt: _MuonFamily, group: dict, active: list[Tensor], params: list[Tensor],
                    u: list[Tensor]) -> tuple[list, list, list]:
    """Muon's ``(targets, updates, scales)`` (Muon's and OwnerMuon's ``_directions``): NS5 of each
    whole matrix by ``opt._orthogonalize``, or of its tiles under a split."""
    if group["split_sizes"] is None and group["num_heads"] is None and group["heads"] is None:
        outs = opt._orthogonalize(group, active, u)
        return params, outs, [C.update_scale(*p.shape, group["tau"]) for p in active]
    # Whole matrices are one tile each (gathered when sharded); all tiles go to one batched NS5.
    plans = [(row_tiles(opt._row_parts(group, p)), False) for p in active]
    return tiled_directions(group, active, params, u, plans, opt._ns(group, opt._out_dtype(group)))


# ----------------------------------------------------------------------------- the tiled update
def _extent(sl: slice, size: int) -> int:
    return len(range(*sl.indices(size)))


def tiled_directions(group: dict, active: list[Tensor], params: list[Tensor], u: list[Tensor],
                     plans: list[tuple[list[Tile], bool]], orthogonalize_fn: Callable,
                     finish: Callable | None = None) -> tuple[list, list, list]:
    """``(targets, updates, scales)`` for ``apply_protocol`` when matrix ``i`` is cut into tiles.

    ``plans[i] = (tiles, local)``: with ``local`` the tiles index this rank's shard and are computed
    from it (no communication); otherwise the full matrix is gathered, tiles index it, and each
    tile's ``s_t / s`` is folded into the full ``O``, of which this rank keeps its shard. All tiles of
    all matrices go to one ``orthogonalize_fn`` call (equal shapes batched). ``finish(i, tiles, outs)``
    may transform matrix ``i``'s tile directions (NorMuon's row normalization).
    """
    tau = group["tau"]
    srcs, spans = [], []
    for p, ut, (tiles, local) in zip(active, u, plans):
        src = ut if local else C.gather_full(ut, p)
        spans.append((len(srcs), src.shape))
        srcs.extend(src if t == WHOLE else src[t] for t in tiles)
    outs = orthogonalize_fn(srcs)
    targets, updates, scales = [], [], []
    for i, (p, pl, (tiles, local)) in enumerate(zip(active, params, plans)):
        first, (m, n) = spans[i]
        mine = outs[first:first + len(tiles)]
        if finish is not None:
            mine = finish(i, tiles, mine)
        tile_scales = [C.update_scale(_extent(rs, m), _extent(cs, n), tau) for rs, cs in tiles]
        if local or not is_dtensor(p):
            for t, o, st in zip(tiles, mine, tile_scales):
                targets.append(pl if t == WHOLE else pl[t])
                updates.append(o)
                scales.append(st)
        elif tiles == [WHOLE]:
            targets.append(pl)
            updates.append(C.local_slice(mine[0], p))
            scales.append(tile_scales[0])
        else:  # tiles of a gathered matrix: one full O against the matrix's s, this rank's shard of it
            s = C.update_scale(m, n, tau)
            full = torch.empty((m, n), dtype=C.upcast(mine[0]).dtype, device=mine[0].device)
            for t, o, st in zip(tiles, mine, tile_scales):
                full[t] = o.to(full.dtype) * (st / s)
            targets.append(pl)
            updates.append(C.local_slice(full, p))
            scales.append(s)
    return targets, updates, scales
