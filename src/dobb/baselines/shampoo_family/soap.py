"""SOAP (Vyas et al. 2024): Adam run in the eigenbases of Shampoo's factors.

Per matrix ``W`` (``m x n``) cut into ``blocks`` equal column blocks ``W_b`` (``m x n_b``; one block
by default), each block independently:

    L <- s L + (1 - s) G G^T,   R <- s R + (1 - s) G^T G          # Shampoo's factors, fp32
    QL, QR: eigenbases of L, R (first by eigh, then one warm-started QR power step every f steps)
    M <- b1 M + (1 - b1) G                                        # first moment, weight space
    V <- b2 V + (1 - b2) (QL^T G QR)^2                            # second moment, rotated space
    O  = QL [ (QL^T M QR) / (sqrt(V) + eps) ] QR^T
    W <- (1 - lr*wd) W - lr * sqrt(1 - b2^t) / (1 - b1^t) * O

A side longer than ``max_precondition_dim``, or switched off by ``sides``, keeps the identity basis
(one-sided SOAP). ``sides="input"`` keeps only the input-axis basis ``QR`` of each column block:
Dobb's blocks with Adam in place of the sign.

The details follow the authors' code as ``pytorch_optimizer.SOAP`` (4.1.0) ports it, and the tests
hold this class to that package on one to three steps: the first step only forms ``L``, ``R`` and
the bases (no update); ``t`` counts the updates; on a refresh the coordinates of ``V`` are
permuted to follow the new eigenvalue order (the basis columns are sorted by the Rayleigh quotients
of the previous basis before the QR step); the statistics and the refresh use the step's gradient
after the weight update. Two differences, both the project's convention: weight decay is applied
before the update, as ``torch.optim.AdamW`` (and this package's AdamW part) does, where the package
applies it after; and statistics are fp32 (fp64 for fp64 weights) whatever the weight dtype.

Update scale: SOAP's update is Adam's (entries of RMS below 1), so, like AdamW, it is applied with
``lr`` alone; the shared protocol's ``tau*sqrt(max(m, n))`` exists to bring orthogonalized updates
to Adam's RMS and does not apply (``tau`` is accepted and unused). Batching: every block of every
matrix of a group with the same ``(m, n_b)`` is one batch (``bmm``, batched ``eigh``/``qr``).

Sharded weights (FSDP2, or tensor parallel: DTensors ``Shard(0)`` or ``Shard(1)`` on a 1-D mesh) are
computed by owners, as ``OwnerMuon`` computes Muon (``dobb.distribution``). At construction every
sharded matrix gets an owner rank of its mesh (``collectives.plan_owners``, longest first by the cost
``soap_cost``, so every rank plans the same owners). The owner alone keeps that matrix's state: ``M`` (whole), ``V``, ``L``, ``R``
and the bases; the other ranks keep the same keys as empty placeholders, and the step count. Each
step, per param group and state dtype, one ``all_to_all`` sends every rank's gradient shards to their
owners (cast to the state dtype); each owner runs the step above on its whole matrices, batched as
without sharding; a second ``all_to_all`` returns every rank its shards of the updates (none on the
first step, which has no update). Both are tagged ``"owner"`` (``collectives.collective_kind``).
The numbers are those of the unsharded step on the same matrices. Payload per step and rank ``r``
(``e`` bytes of the state dtype): ``e * (sum_i |shard_r(i)| + sum_{i owned by r} m_i n_i)``, i.e.
``2 e m n`` per matrix over all ranks. Other layouts (2-D meshes, ``Replicate``, ``Partial``, ``_StridedShard``) are refused at
construction with a ``ValueError``; plain tensors are computed locally as without sharding.

Checkpoints: ``state_dict()`` gives each owner-held tensor as a DTensor ``Shard`` of its whole shape
on the matrix's mesh (one ``all_to_all`` from the owners, collective), so
``torch.distributed.checkpoint`` saves every entry once, with the same keys on every rank, in a
layout that does not depend on the owners; ``load_state_dict`` gathers them back to this run's
owners, whatever the world size of the save.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..._base import MatrixOptimizer, _name_of
from ..._safety import check_saved_optimizer
from ...collectives import plan_owners
from ...distribution import from_owners, owner_compute, to_owners
from ...layout import is_dtensor, to_local
from ..._hparams import Options, boolean, integer, one_of, option, optional, positive, unit_interval
from ..._hparams import betas as betas_rule
from .. import _common as C

SIDES = ("both", "input", "output")

__all__ = ["SOAP", "soap_project", "soap_project_back", "soap_initial_basis", "soap_refresh_basis", "soap_cost",
           "SIDES"]
# the state an owner keeps for a sharded matrix (other ranks: empty placeholders under the same keys)
OWNED_KEYS = ("momentum", "exp_avg_sq", "stat_left", "stat_right", "basis_left", "basis_right")


# ----------------------------------------------------------------------------- pure math
def soap_project(x: Tensor, left: Tensor | None, right: Tensor | None) -> Tensor:
    """``QL^T X QR`` for a batch ``(K, m, n)`` (a ``None`` side is the identity)."""
    if left is not None:
        x = left.mT @ x
    if right is not None:
        x = x @ right
    return x


def soap_project_back(x: Tensor, left: Tensor | None, right: Tensor | None) -> Tensor:
    """``QL X QR^T``: the inverse of ``soap_project``."""
    if left is not None:
        x = left @ x
    if right is not None:
        x = x @ right.mT
    return x


def soap_initial_basis(stat: Tensor) -> Tensor:
    """Eigenvectors of a batch of symmetric ``stat``, columns by decreasing eigenvalue.

    The tiny diagonal shift is the authors' (it only changes an exactly zero diagonal entry)."""
    eye = torch.eye(stat.shape[-1], dtype=stat.dtype, device=stat.device)
    return torch.linalg.eigh(stat + 1e-30 * eye).eigenvectors.flip(-1)


def soap_refresh_basis(stat: Tensor, basis: Tensor) -> tuple[Tensor, Tensor]:
    """One warm-started power step ``Q <- qr(stat Q)`` with the columns sorted first by their
    Rayleigh quotients ``q_j^T stat q_j`` (decreasing). Returns ``(Q_new, order)``; ``order``
    ``(K, s)`` is the permutation that the rotated second moment must follow."""
    prod = stat @ basis
    est = (basis * prod).sum(dim=-2)
    order = torch.argsort(est, dim=-1, descending=True)
    power = torch.take_along_dim(prod, order.unsqueeze(-2), dim=-1)
    return torch.linalg.qr(power).Q, order


def soap_cost(m: int, nb: int, blocks: int, left: bool, right: bool) -> int:
    """Work of one step of an ``m x (blocks*nb)`` matrix, for balancing owners: the products with
    the bases and the statistics, ``m nb (m + nb)`` per block with both sides (``m nb`` without)."""
    return blocks * m * nb * (1 + (m if left else 0) + (nb if right else 0))


def _contiguous_stride(shape: tuple) -> tuple:
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(stride))


# ----------------------------------------------------------------------------- the optimizer
def _state_dtype(p: Tensor) -> torch.dtype:
    return torch.float64 if p.dtype == torch.float64 else torch.float32


def _blocks(x: Tensor, blocks: int) -> Tensor:
    """``(m, n)`` -> ``(blocks, m, n / blocks)``: the column blocks, stacked (a copy)."""
    m, n = x.shape
    return x.reshape(m, blocks, n // blocks).permute(1, 0, 2)


def _unblock(x: Tensor) -> Tensor:
    """``(blocks, m, n_b)`` -> ``(m, blocks * n_b)``."""
    b, m, nb = x.shape
    return x.permute(1, 0, 2).reshape(m, b * nb)


@dataclass(frozen=True, kw_only=True)
class SOAPOptions(Options):
    """SOAP's options: Adam-scaled in the rotated space, so no ``tau`` (passing one is an error)."""
    betas: tuple[float, float] = option((0.95, 0.95), betas_rule)
    shampoo_beta: float | None = option(None, optional(unit_interval))
    eps: float = option(1e-8, positive)
    precondition_frequency: int = option(10, integer(1))
    max_precondition_dim: int = option(10000, integer(1))
    blocks: int = option(1, integer(1))
    sides: str = option("both", one_of(*SIDES))
    correct_bias: bool = option(True, boolean)


class _SOAPFamily(MatrixOptimizer):
    """SOAP's statistics, bases, batching, owner compute and checkpoints, shared by SOAP and SOAP-Muon;
    each gives its direction (``_direction``), its scale (``_scale``) and ``_first_step_updates``."""

    Options = SOAPOptions
    # fp32 statistics stay fp32 when a bf16 model resumes
    _own_dtype_keys = ("momentum", "exp_avg_sq", "stat_left", "stat_right", "basis_left", "basis_right")
    _first_step_updates = False  # whether the first step (no bases yet) has an update

    def __init__(self, params, *, lr: float, **kwargs):
        self._owner_loads: dict[tuple[int, ...], list[float]] = {}  # per mesh (its ranks): planned work
        super().__init__(params, lr=lr, **kwargs)

    # each matrix's plan: its owner (derived state; the work planned per mesh so far goes with it)
    _derived = ("_plans", "_owner_loads")

    def _rebuild(self) -> None:
        self._owner_loads = {}
        super()._rebuild()

    @property
    def owners(self) -> dict[Tensor, int]:
        """Sharded matrices: the rank (of the matrix's mesh) that keeps its state and computes its step."""
        return {p: r for p, r in self._plans.items() if r is not None}

    def _check_matrix_group(self, group: dict[str, Any]) -> None:
        for i, p in enumerate(group["params"]):
            name = _name_of(p, self._param_names, i)
            if is_dtensor(p):
                _check_layout(name, p)
            n, b = p.shape[-1], group["blocks"]
            if n % b:
                valid = [d for d in range(1, n + 1) if n % d == 0]
                raise ValueError(f"{name}: blocks={b} must divide the input axis ({n}); valid blocks: {valid}")

    def _sides(self, group: dict, m: int, nb: int) -> tuple[bool, bool]:
        """Whether the left (``m x m``) and right (``n_b x n_b``) sides are preconditioned."""
        limit = group["max_precondition_dim"]
        left = group["sides"] in ("both", "output") and m <= limit
        right = group["sides"] in ("both", "input") and nb <= limit
        return left, right

    def _shapes(self, group: dict, p: Tensor) -> dict[str, tuple]:
        """The whole shape of each state tensor of the matrix ``p``."""
        m, n = p.shape
        b = group["blocks"]
        nb = n // b
        left, right = self._sides(group, m, nb)
        sl, sr = (m if left else 0), (nb if right else 0)
        return dict(momentum=(m, n), exp_avg_sq=(b, m, nb), stat_left=(b, sl, sl), stat_right=(b, sr, sr),
                    basis_left=(b, sl, sl), basis_right=(b, sr, sr))

    def _group_plans(self, group: dict) -> list[int | None]:
        """Each matrix's owner (``None``: a plain matrix, computed here), balanced per mesh over every
        group so far."""
        params = group["params"]
        by_mesh: dict[tuple[int, ...], list[int]] = defaultdict(list)
        for i, p in enumerate(params):
            if is_dtensor(p):
                by_mesh[_mesh_ranks(p)].append(i)
        owners: list[int | None] = [None] * len(params)
        for ranks, idx in by_mesh.items():
            loads = self._owner_loads.setdefault(ranks, [0.0] * len(ranks))
            costs = []
            for i in idx:
                m, n = params[i].shape
                nb = n // group["blocks"]
                costs.append(soap_cost(m, nb, group["blocks"], *self._sides(group, m, nb)))
            for i, r in zip(idx, plan_owners(costs, len(ranks), loads)):
                owners[i] = r
        return owners

    def _init_matrix_state(self, group: dict[str, Any]) -> None:
        for p in group["params"]:
            if "momentum" in self.state[p]:
                continue
            kw = dict(dtype=_state_dtype(p), device=to_local(p).device)
            # Eager and identical in keys on every rank (distributed checkpoints load only into existing
            # state); a side without a basis keeps an empty (b, 0, 0) tensor so the key set never varies.
            # A sharded matrix's state lives on its owner; the other ranks keep empty placeholders.
            here = not is_dtensor(p) or self._plans[p] == p.device_mesh.get_local_rank(0)
            self.state[p]["step"] = 0
            for key, shape in self._shapes(group, p).items():
                self.state[p][key] = torch.zeros(shape if here else (0,), **kw)

    def _matrix_step(self, group: dict[str, Any], active: list[Tensor]) -> None:
        local = [p for p in active if not is_dtensor(p)]
        params, updates, scales = self._local_updates(group, local, [p.grad for p in local])
        sharded: dict[tuple[int, ...], list[Tensor]] = defaultdict(list)
        for p in active:  # parameter order: the same on every rank
            if is_dtensor(p):
                sharded[_mesh_ranks(p)].append(p)
        for ps in sharded.values():
            out = self._sharded_updates(group, ps)
            params += out[0]
            updates += out[1]
            scales += out[2]
        C.apply_protocol(params, params, updates, scales, group["lr"], group["weight_decay"])

    def _local_updates(self, group: dict, ps: list[Tensor], grads: list[Tensor]):
        """SOAP's step on whole matrices ``ps`` held here, with gradients ``grads``: the
        ``(params, updates, scales)`` of those that have an update this step."""
        b = group["blocks"]
        buckets: dict[tuple, list[tuple[int, list[int]]]] = defaultdict(list)
        for i, p in enumerate(ps):
            # equal block shapes at the same step count share one batch (the step sets the bias
            # correction and the refresh; all matrices of a group normally share it). The count is
            # compared, never hashed: a compiled step (torch.compile) then keeps it symbolic instead
            # of making a new graph for each value
            step = self.state[p]["step"]
            runs = buckets[(p.shape[0], p.shape[1] // b, _state_dtype(p), grads[i].device)]
            run = next((r for r in runs if r[0] == step), None)
            if run is None:
                runs.append((step, [i]))
            else:
                run[1].append(i)
        params, updates, scales = [], [], []
        for (m, nb, dtype, _), step, idx in ((k, s, idx) for k, runs in buckets.items() for s, idx in runs):
            out = self._bucket_step(group, [ps[i] for i in idx], [grads[i] for i in idx], m, nb, dtype, step)
            if out is not None:
                params += [ps[i] for i in idx]
                updates += out[0]
                scales += [out[1]] * len(idx)
        return params, updates, scales

    def _sharded_updates(self, group: dict, ps: list[Tensor]):
        """Owner compute for the sharded matrices ``ps`` of one mesh: gradient shards to the owners,
        the step there, update shards back (one ``all_to_all`` each way per state dtype). Returns the
        local shards ``(params, updates, scales)``."""
        pg = ps[0].device_mesh.get_group(0)
        params, updates, scales = [], [], []
        for dtype in dict.fromkeys(_state_dtype(p) for p in ps):
            sub = [p for p in ps if _state_dtype(p) == dtype]
            device = to_local(sub[0]).device
            steps = [self.state[p]["step"] for p in sub]  # the same on every rank
            items = []
            for p in sub:
                g = p.grad
                if tuple(g.placements) != tuple(p.placements) or g.device_mesh != p.device_mesh:
                    g = g.redistribute(p.device_mesh, p.placements)
                items.append((self._plans[p], g.to_local(), tuple(p.shape), p.placements[0].dim))

            def compute(mine, wholes, sub=sub):  # SOAP's step on the whole matrices this rank owns
                done = self._local_updates(group, [sub[j] for j in mine], wholes)
                result = dict(zip(map(id, done[0]), done[1]))
                return [result.get(id(sub[j])) for j in mine]

            # SOAP's first step has no update (SOAP-Muon's has: ``_first_step_updates``)
            back = [j for j in range(len(sub)) if steps[j] > 0 or self._first_step_updates]
            shards = owner_compute(items, pg, dtype, device, compute, back)
            for p in sub:
                if self._plans[p] != p.device_mesh.get_local_rank(0):
                    self.state[p]["step"] += 1  # the owner counted its own in the step
            for j, u in zip(back, shards):
                params.append(sub[j])
                updates.append(u)
                scales.append(self._scale(group, steps[j], tuple(sub[j].shape)))
        return [p.to_local() for p in params], updates, scales

    def _bucket_step(self, group: dict, ps: list[Tensor], grads: list[Tensor], m: int, nb: int,
                     dtype: torch.dtype, t: int):
        """One step of the matrices ``ps`` (equal shapes, step count ``t``, whole gradients ``grads``):
        returns their updates and the bias-correction factor, or None on the first step (statistics
        and bases only)."""
        b = group["blocks"]
        sb = group["betas"][1] if group["shampoo_beta"] is None else group["shampoo_beta"]
        left, right = self._sides(group, m, nb)
        states = [self.state[p] for p in ps]
        grads = [x.to(dtype) for x in grads]
        g = torch.cat([_blocks(x, b) for x in grads])  # (K, m, nb), K = len(ps) * b
        cat = lambda key: torch.cat([st[key] for st in states])  # noqa: E731
        sl, sr = (cat("stat_left") if left else None), (cat("stat_right") if right else None)
        ql, qr = (cat("basis_left") if left else None), (cat("basis_right") if right else None)
        result, v = self._direction(group, ps, states, grads, g, ql, qr, t)
        # Shampoo's factors from this step's gradient; the bases follow (first step: eigh).
        if sl is not None:
            sl.lerp_(g @ g.mT, 1 - sb)
        if sr is not None:
            sr.lerp_(g.mT @ g, 1 - sb)
        if t == 0:
            ql = soap_initial_basis(sl) if left else None
            qr = soap_initial_basis(sr) if right else None
        elif t % group["precondition_frequency"] == 0:
            if left:
                ql, order = soap_refresh_basis(sl, ql)
                v = torch.take_along_dim(v, order.unsqueeze(-1), dim=-2)  # rows follow the new order
            if right:
                qr, order = soap_refresh_basis(sr, qr)
                v = torch.take_along_dim(v, order.unsqueeze(-2), dim=-1)  # columns likewise
        for key, value in (("stat_left", sl), ("stat_right", sr), ("basis_left", ql), ("basis_right", qr),
                           ("exp_avg_sq", v if t > 0 else None)):
            if value is not None:
                torch._foreach_copy_([st[key] for st in states], list(value.split(b)))
        for st in states:
            st["step"] += 1
        return result

    # ------------------------------------------------------------------ checkpoints of owner-held state
    def _owned_entries(self):
        """``(index in the state dict, logical matrix, group)`` of every sharded matrix, in order."""
        index = 0
        for group in self.param_groups:
            for p in group["params"]:
                v = self._views.get(p, p)
                if group["algorithm"] != "adamw" and self._plans.get(v) is not None:
                    yield index, p, v, group
                index += 1

    def state_dict(self) -> dict[str, Any]:
        """torch's state dict, with each owner-held tensor of a sharded matrix as a DTensor ``Shard``
        of its whole shape on the matrix's mesh (collective: every rank must call it)."""
        sd = super().state_dict()
        entries = list(self._owned_entries())
        if not entries:
            return sd
        from torch.distributed.tensor import DTensor, Shard

        state, copied = dict(sd["state"]), set()
        groups: dict[tuple, list[tuple]] = defaultdict(list)
        for i, p, v, group in entries:
            st = self.state[p]
            here = self._plans[v] == v.device_mesh.get_local_rank(0)
            for key, shape in self._shapes(group, v).items():
                dim = v.placements[0].dim if key == "momentum" else 1
                groups[(_mesh_ranks(v), _state_dtype(v))].append(
                    (i, v, key, (self._plans[v], st[key] if here else None, shape, dim)))
        for (_, dtype), rows in groups.items():
            v0 = rows[0][1]
            shards = from_owners([r[3] for r in rows], v0.device_mesh.get_group(0), dtype, to_local(v0).device)
            for (i, v, key, (_, _, shape, dim)), local in zip(rows, shards):
                if i not in copied:  # torch's state dict shares the live per-parameter dicts
                    state[i], copied = dict(state[i]), copied | {i}
                state[i][key] = DTensor.from_local(local.clone(), v.device_mesh, [Shard(dim)], run_check=False,
                                                   shape=torch.Size(shape), stride=_contiguous_stride(shape))
        return {**sd, "state": state}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # another optimizer's state is refused before the owners' gathers read it (checked again inside)
        check_saved_optimizer(self, state_dict["param_groups"], trial=False)
        super().load_state_dict(self._owner_state(state_dict))

    def _owner_state(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """``state_dict`` with each saved tensor of a sharded matrix as this run keeps it: whole on the
        matrix's owner, an empty placeholder elsewhere. A saved DTensor is gathered to the owner (one
        ``all_to_all`` per mesh and dtype, collective); a saved whole tensor (a single-process
        checkpoint) is taken as it is."""
        entries = list(self._owned_entries())
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        if not entries or len(saved_ids) != sum(len(g["params"]) for g in self.param_groups):
            return state_dict  # nothing sharded here, or torch's own load raises the precise error
        state = dict(state_dict["state"])
        groups: dict[tuple, list[tuple]] = defaultdict(list)
        for i, p, v, group in entries:
            sid = saved_ids[i]
            saved = state.get(sid)
            if not saved:
                continue
            saved = state[sid] = dict(saved)
            here = self._plans[v] == v.device_mesh.get_local_rank(0)
            dtype = _state_dtype(v)
            for key, shape in self._shapes(group, v).items():
                value = saved.get(key)
                if not isinstance(value, torch.Tensor):
                    continue
                name = _name_of(p, self._param_names, i)
                if tuple(value.shape) != shape:
                    raise ValueError(
                        f"{name}: saved state {key!r} has shape {tuple(value.shape)}, but this optimizer's layout "
                        f"needs {shape} (saved with other blocks, sides, max_precondition_dim or weight shape?)")
                if is_dtensor(value):
                    from torch.distributed.tensor import Shard

                    dim = v.placements[0].dim if key == "momentum" else 1
                    if value.device_mesh != v.device_mesh or tuple(value.placements) != (Shard(dim),):
                        value = value.redistribute(v.device_mesh, [Shard(dim)])
                    item = (self._plans[v], value.to_local(), shape, dim)
                    groups[(_mesh_ranks(v), dtype)].append((sid, key, v, item))
                else:
                    saved[key] = value.to(dtype) if here else torch.zeros(0, dtype=dtype, device=value.device)
        for (_, dtype), rows in groups.items():
            v0 = rows[0][2]
            wholes = to_owners([r[3] for r in rows], v0.device_mesh.get_group(0), dtype, to_local(v0).device)
            for (sid, key, v, _), whole in zip(rows, wholes):
                state[sid][key] = whole if whole is not None else torch.zeros(0, dtype=dtype,
                                                                               device=to_local(v).device)
        return {**state_dict, "state": state}


class SOAP(_SOAPFamily):
    """SOAP for hidden matrices, AdamW for the rest (see the module docstring).

    Args: ``lr``, ``weight_decay`` (decoupled), ``betas`` ((0.95, 0.95), Adam's in the rotated
    space), ``shampoo_beta`` (None: ``betas[1]``; the EMA of ``L`` and ``R``), ``eps`` (1e-8),
    ``precondition_frequency`` (10: steps between basis refreshes), ``max_precondition_dim``
    (10000: a longer side keeps the identity), ``blocks`` (1: equal column blocks, each its own
    SOAP; must divide ``n``), ``sides`` (``"both"``; ``"input"``: only ``R``; ``"output"``: only
    ``L``), ``correct_bias`` (True), ``adamw_betas``, ``adamw_eps``. It takes no ``tau`` (Adam-scaled).
    """

    algorithm = "soap"
    Options = SOAPOptions
    _first_step_updates = False  # the first step only forms L, R and the bases

    def _scale(self, group: dict, t: int, shape: tuple | None = None) -> float:
        """The update's scale ``s`` at step ``t`` (``shape``: the matrix's, for subclasses)."""
        b1, b2 = group["betas"]
        return (1 - b2 ** t) ** 0.5 / (1 - b1 ** t) if group["correct_bias"] else 1.0

    def _direction(self, group: dict, ps: list[Tensor], states: list[dict], grads: list[Tensor], g: Tensor,
                   ql: Tensor | None, qr: Tensor | None, t: int):
        """The update of a bucket at step ``t`` (before the statistics of this step): returns
        ``((updates, scale) or None, V)`` with ``V`` the bucket's updated second moment (``None`` when
        untouched). ``g``: the gradients' blocks ``(K, m, nb)``; ``ql``/``qr``: the current bases."""
        if t == 0:
            return None, None
        b = group["blocks"]
        b1, b2 = group["betas"]
        moms = [st["momentum"] for st in states]
        torch._foreach_lerp_(moms, grads, 1 - b1)
        v = torch.cat([st["exp_avg_sq"] for st in states])
        v.lerp_(soap_project(g, ql, qr).square(), 1 - b2)
        mp = soap_project(torch.cat([_blocks(x, b) for x in moms]), ql, qr)
        o = soap_project_back(mp / v.sqrt().add_(group["eps"]), ql, qr)
        return ([_unblock(x) for x in o.split(b)], self._scale(group, t)), v


def _mesh_ranks(p: Tensor) -> tuple[int, ...]:
    """The global ranks of a 1-D-mesh DTensor's mesh, in mesh order."""
    return tuple(p.device_mesh.mesh.flatten().tolist())


def _check_layout(name: str, p: Tensor) -> None:
    """A sharded matrix SOAP can own-compute: ``Shard(0)`` or ``Shard(1)`` on a 1-D mesh."""
    from torch.distributed.tensor import Shard

    mesh, placements = p.device_mesh, tuple(p.placements)
    if mesh.ndim != 1 or len(placements) != 1 or type(placements[0]) is not Shard:
        raise ValueError(
            f"{name} is a DTensor with placements {placements} on a {mesh.ndim}-D mesh: SOAP computes sharded "
            f"matrices on owner ranks only for Shard(0) or Shard(1) on a 1-D mesh (FSDP2's fully_shard, or "
            f"tensor parallelism alone); use one of those layouts, or plain (DDP-replicated) weights")
