"""Muon with owner compute: each matrix's NS5 runs once, on one rank, with two all-to-alls.

The strongest distributed Muon (the ``dion`` package's megabatching, Dion3 paper) does not let
DTensor dispatch gather every matrix on every rank. This class does what it does:

- **FSDP2 (DTensor ``Shard(d)`` on a 1-D mesh).** Every matrix gets an owner rank, balanced by
  cost (longest-processing-time: matrices by NS5 FLOPs ``2 s^2 l + s^3`` descending, each to the
  least-loaded rank; ties to the lowest rank, so every rank computes the same owners). One
  ``all_to_all`` sends each rank's shards of every matrix to its owner (all matrices of the step
  in one buffer); owners assemble their full matrices, run NS5 batched by shape, and a second
  ``all_to_all`` returns each rank its shards of the results. Uneven and empty shards
  (``torch.chunk`` sizes) are uneven split sizes, zero included.
- **DDP (plain tensors, identical on every rank of ``replicated_group``).** Equal-shape matrices are
  dealt round-robin over the ranks (1/P each; the dealing starts at the least-loaded rank), each
  rank orthogonalizes its share, and one ``all_gather`` per shape returns every result to every
  rank (shares padded to ``ceil(N/P)`` matrices).
- Anything else (2-D meshes, ``_StridedShard``, ``Partial``) falls back to Muon's gather
  (``OwnerMuon.gathered`` lists them); plain tensors without a group are computed locally.

Each matrix's route and owner are its plan (``OwnerPlan``), built once with its param group and
rebuilt from the groups after ``load_state_dict`` or in a copy (``MatrixOptimizer``'s derived
state); the step reads them and writes nothing but the state. The owners are planned over each param
group's matrices of one route group and wire dtype, as a step of every matrix meets them (a step where
some matrices have no gradient keeps the same owners). The exchanges go through
``dobb.collectives`` with kind ``"owner"``.

Payload per step, per rank ``r`` (``PayloadMeter``'s logical sizes; ``e`` bytes per entry of the
wire dtype: ``ns_dtype`` when it is no wider than the momentum's, else the momentum's; exact, since
NS5 casts to ``ns_dtype`` first): sharded, ``e * (sum_i |shard_r(i)| + sum_{i owned by r} m_i n_i)``
over two all-to-alls; replicated, ``e * P ceil(N_g/P) m_g n_g`` per shape group ``g`` (one
all-gather each). The result equals single-process Muon with the same options entry for entry
(the owner runs the same NS5 on the same full matrix).
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, fields

import torch
import torch.distributed as dist
from torch import Tensor

from ...layout import is_dtensor
from ...collectives import all_gather_into_, from_owners, to_owners
from ...collectives import plan_owners as balance_owners  # the library's one greedy owner plan
from .muon import Muon
from .newton_schulz import ns_options, orthogonalize

__all__ = ["OwnerMuon", "OwnerPlan", "balance_owners", "ns_cost", "plan_owner_compute", "owner_plan_fields"]


def ns_cost(shape) -> int:
    s, l = min(shape), max(shape)
    return 2 * s * s * l + s ** 3


def _wire_dtype(u_dtype: torch.dtype, ns_dtype: torch.dtype) -> torch.dtype:
    return ns_dtype if ns_dtype.itemsize <= u_dtype.itemsize else u_dtype


@dataclass(frozen=True)
class OwnerPlan:
    """How one matrix's whole NS5 is computed: ``route`` ``"shard"`` (FSDP2: its shards to ``owner``
    of ``group`` and back, ``dim`` the sharded dim), ``"replicated"`` (DDP: ``owner`` of ``group``
    computes it, one all-gather per shape), ``"local"`` (no group) or ``"gather"`` (Muon's gather,
    ``why``)."""
    route: str
    group: object = None
    dim: int | None = None
    owner: int | None = None
    why: str | None = None


def _route(p: Tensor, replicated_pg) -> OwnerPlan:
    if not is_dtensor(p):
        if replicated_pg is None or dist.get_world_size(replicated_pg) == 1:
            return OwnerPlan("local")
        return OwnerPlan("replicated", replicated_pg)
    from torch.distributed.tensor import Replicate, Shard

    mesh, (pl, *rest) = p.device_mesh, p.placements
    if mesh.ndim != 1 or rest:
        return OwnerPlan("gather", why=f"{mesh.ndim}-D mesh")
    if type(pl) is Shard:
        return OwnerPlan("shard", mesh.get_group(0), pl.dim)
    if isinstance(pl, Replicate):
        return OwnerPlan("replicated", mesh.get_group(0))
    return OwnerPlan("gather", why=f"placement {pl}")


def plan_owner_compute(params: list[Tensor], wires: list[torch.dtype], replicated_pg) -> list[OwnerPlan]:
    """The ``OwnerPlan`` of each matrix of ``params`` (one param group, or the matrices of one step),
    exchanged in the wire dtypes ``wires``. Pure: every rank plans the same.

    Owners are planned per route group and wire dtype, in parameter order: sharded matrices by
    ``balance_owners`` over their NS5 costs; replicated ones dealt round-robin per shape, each
    shape's dealing starting at the least-loaded rank."""
    routes = [_route(p, replicated_pg) for p in params]
    sharded, replicated = defaultdict(list), defaultdict(list)
    for i, (p, r, wire) in enumerate(zip(params, routes, wires)):
        if r.route == "shard":
            sharded[(r.group, wire)].append(i)
        elif r.route == "replicated":
            replicated[(r.group, wire)].append(i)
    owner: dict[int, int] = {}
    for (pg, _), idx in sharded.items():
        owner.update(zip(idx, balance_owners([ns_cost(params[i].shape) for i in idx], dist.get_world_size(pg))))
    for (pg, _), idx in replicated.items():
        world = dist.get_world_size(pg)
        loads = [0] * world
        shapes: dict[tuple, list[int]] = defaultdict(list)
        for i in idx:
            shapes[tuple(params[i].shape)].append(i)
        for shape, same in shapes.items():
            start = min(range(world), key=lambda r: (loads[r], r))
            for k, i in enumerate(same):
                owner[i] = (start + k) % world
                loads[owner[i]] += ns_cost(shape)
    return [r if i not in owner else OwnerPlan(r.route, r.group, r.dim, owner[i]) for i, r in enumerate(routes)]


class OwnerMuon(Muon):
    """Muon (same math, state and options) with owner compute under FSDP2 and DDP.

    Extra argument ``replicated_group``: the process group across which plain-tensor matrices
    are replicated (DDP); ``"default"`` (the default) means the world group when
    ``torch.distributed`` is initialized with more than one rank (when the optimizer is built),
    ``None`` computes every matrix locally (no collective). Param groups keep ``algorithm="muon"``.

    ``owners`` (``{matrix: rank of its route's group}``) and ``gathered`` (``{matrix: why}``) read
    the plans.
    """

    def __init__(self, params, *, lr: float, replicated_group="default", **kwargs):
        if not (replicated_group is None or replicated_group == "default"
                or isinstance(replicated_group, dist.ProcessGroup)):
            raise ValueError(f"replicated_group must be 'default', None or a ProcessGroup, got {replicated_group!r}")
        self._replicated_group = replicated_group
        super().__init__(params, lr=lr, **kwargs)

    @property
    def owners(self) -> dict[Tensor, int]:
        return {p: plan.owner for p, plan in self._plans.items() if plan.owner is not None}

    @property
    def gathered(self) -> dict[Tensor, str]:
        return {p: plan.why for p, plan in self._plans.items() if plan.route == "gather"}

    def _replicated_pg(self):
        g = getattr(self, "_replicated_group", "default")
        if g == "default":
            if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
                return None
            return dist.group.WORLD
        return g

    def _group_plans(self, group):
        dtype = ns_options(group)["dtype"]
        return plan_owner_compute(group["params"], [_wire_dtype(p.dtype, dtype) for p in group["params"]],
                                  self._replicated_pg())

    def plan_step(self, group, active, u) -> list[OwnerPlan]:
        """Plans of matrices this optimizer did not plan, over the matrices of one step (Dobb's whole
        steps borrow this routing: ``core.update.apply_whole_steps``)."""
        dtype = ns_options(group)["dtype"]
        return plan_owner_compute(active, [_wire_dtype(t.dtype, dtype) for t in u], self._replicated_pg())

    def _orthogonalize(self, group, active, u, plans=None):
        """NS5 of each whole matrix of ``active`` by its plan (``plans``: this optimizer's own)."""
        opts = ns_options(group)
        ns = lambda mats: orthogonalize(mats, group["ns_coefficients"], group["ns_steps"], group["eps"], **opts)
        if plans is None:
            plans = [self._plans[p] for p in active]
        out: list[Tensor | None] = [None] * len(active)
        sharded, replicated, local, gather = defaultdict(list), defaultdict(list), [], []
        for i, plan in enumerate(plans):
            wire = _wire_dtype(u[i].dtype, opts["dtype"])
            if plan.route == "shard":
                sharded[(plan.group, wire)].append(i)
            elif plan.route == "replicated":
                replicated[(plan.group, wire)].append(i)
            elif plan.route == "local":
                local.append(i)
            else:
                gather.append(i)
        # Insertion order of the dicts follows parameter order: the same on every rank.
        for (pg, wire), idx in sharded.items():
            items = [(active[i], u[i], plans[i].dim) for i in idx]
            for i, o in zip(idx, _sharded(pg, wire, items, [plans[i].owner for i in idx], ns)):
                out[i] = o
        for (pg, wire), idx in replicated.items():
            outs = _replicated(pg, wire, [active[i] for i in idx], [u[i] for i in idx], [plans[i].owner for i in idx],
                               ns)
            for i, o in zip(idx, outs):
                out[i] = o
        if local:
            for i, o in zip(local, ns([u[i] for i in local])):
                out[i] = o
        if gather:
            for i, o in zip(gather, super()._orthogonalize(group, [active[i] for i in gather], [u[i] for i in gather])):
                out[i] = o
        return out


def owner_plan_fields(plan: OwnerPlan) -> dict:
    """``plan``'s fields (shallow: its process group kept), to build a plan that extends it."""
    return {f.name: getattr(plan, f.name) for f in fields(OwnerPlan)}


# ----------------------------------------------------------------------------- FSDP2: two all-to-alls
def _sharded(pg, wire, items, owners, ns) -> list[Tensor]:
    """NS5 of sharded matrices ``items`` (``(param, u shard, sharded dim)``) on their ``owners``: the
    owner exchange out (each rank's shard of every matrix to its owner, one all-to-all), NS5 batched
    on the owners, and back (one all-to-all)."""
    device = items[0][1].device
    shards = [(r, u, tuple(p.shape), d) for (p, u, d), r in zip(items, owners)]
    fulls = to_owners(shards, pg, wire, device)
    mine = [j for j, full in enumerate(fulls) if full is not None]
    results = [o.to(wire) for o in ns([fulls[j] for j in mine])] if mine else []
    wholes = [(r, None, shape, d) for r, _, shape, d in shards]
    for j, o in zip(mine, results):
        wholes[j] = (wholes[j][0], o, wholes[j][2], wholes[j][3])
    return from_owners(wholes, pg, wire, device)


# ----------------------------------------------------------------------------- DDP: 1/P each, all-gather
def _replicated(pg, wire, params, u, owners, ns) -> list[Tensor]:
    """NS5 of replicated matrices, each on its owner; one all-gather per shape returns them all."""
    world, me = dist.get_world_size(pg), dist.get_rank(pg)
    outs: list[Tensor | None] = [None] * len(params)
    shapes: dict[tuple, list[int]] = defaultdict(list)
    for i, p in enumerate(params):
        shapes[tuple(p.shape)].append(i)
    for shape, idx in shapes.items():
        owner = [owners[i] for i in idx]
        per_rank = max(owner.count(r) for r in range(world))  # ceil(N/P) when every matrix steps
        mine = [k for k in range(len(idx)) if owner[k] == me]
        buf = torch.zeros((per_rank, *shape), dtype=wire, device=u[idx[0]].device)
        if mine:
            for slot, o in enumerate(ns([u[idx[k]] for k in mine])):
                buf[slot].copy_(o)
        gathered = torch.empty((world * per_rank, *shape), dtype=wire, device=buf.device)
        all_gather_into_(gathered, buf, pg, "owner")
        slots = [0] * world
        for k, i in enumerate(idx):
            outs[i] = gathered[owner[k] * per_rank + slots[owner[k]]]
            slots[owner[k]] += 1
    return outs  # type: ignore[return-value]
