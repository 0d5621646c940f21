"""Owner compute, the library's one distribution layer: a unit of work that needs a whole matrix (or a
whole statistic) is computed once, by one rank, and its result is sent where it is needed.

Optimizers use it by composition: OwnerMuon and MuonBP hold an ``OwnerCompute`` (their whole-matrix
NS5), Dobb holds one for its whole-matrix steps (``whole_every``), SOAP and SOAP-Muon call
``owner_compute`` for their sharded matrices, and Dobb's split refresh calls ``solve_on_owners``. The
placements themselves are read in ``dobb.sharding`` (the one module that builds DTensors) and every
collective goes through ``dobb.collectives`` with kind ``"owner"`` (``"basis"`` for the split refresh).

Three forms of the same idea:

- **Sharded matrices (FSDP2: DTensor ``Shard(d)`` on a 1-D mesh)**, ``to_owners`` / ``from_owners``:
  one ``all_to_all`` sends each rank's shards of every matrix to its owner (all matrices of a call in
  one buffer); the owner computes on whole matrices, batched; a second ``all_to_all`` returns each
  rank its shards of the results. Uneven and empty shards (``torch.chunk`` sizes) are uneven split
  sizes, zero included.
- **Replicated matrices (DDP: plain tensors, identical on every rank of a group)**: equal-shape
  matrices are dealt round-robin over the ranks (1/P each; the dealing starts at the least-loaded
  rank), each rank computes its share, and one ``all_gather`` per shape returns every result to
  every rank (shares padded to ``ceil(N/P)`` matrices).
- **Replicated statistics (Dobb's split refresh)**, ``solve_on_owners``: each unit is solved by one
  rank of the group that holds it identically, and broadcast from there; ``solve_as_owners`` computes
  the same results on one rank, owner by owner in the owners' batches (the unsplit refresh).

Owners come from ``collectives.plan_owners`` (longest first to the least-loaded rank), which reads
only rank-invariant facts (shapes, costs, order), so every rank plans the same owners and issues the
same collectives in the same order.

``OwnerCompute``'s plan of a matrix (``OwnerPlan``) is its route: ``"shard"``, ``"replicated"``,
``"local"`` (no group: computed here) or ``"gather"`` (2-D meshes, ``_StridedShard``, ``Partial``:
the whole matrix gathered on every rank, as plain Muon does). Payload per call, per rank ``r``
(``e`` bytes per entry of the wire dtype: the compute dtype when it is no wider than the input's,
else the input's; exact, since the computation casts to its dtype first): sharded,
``e * (sum_i |shard_r(i)| + sum_{i owned by r} m_i n_i)`` over two all-to-alls; replicated,
``e * P ceil(N_g/P) m_g n_g`` per shape group ``g`` (one all-gather each). The result equals the
single-process computation entry for entry (the owner runs the same function on the same matrix).
"""
from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, fields

import torch
import torch.distributed as dist
from torch import Tensor

from . import collectives
from .collectives import all_gather_into_, all_to_all, plan_owners
from .layout import is_dtensor

__all__ = ["OwnerPlan", "OwnerCompute", "ns_cost", "wire_dtype", "plan_owner_compute", "owner_plan_fields",
           "to_owners", "from_owners", "owner_compute", "solve_on_owners", "solve_as_owners"]


# ----------------------------------------------------------------------------- the plan
def ns_cost(shape) -> int:
    """NS5's FLOPs per step of an ``m x n`` matrix up to a constant: the owners' balance."""
    s, l = min(shape), max(shape)
    return 2 * s * s * l + s ** 3


def wire_dtype(u_dtype: torch.dtype, compute_dtype: torch.dtype) -> torch.dtype:
    """The dtype a matrix travels in: the computation's when it is no wider than the input's (the
    owner casts to it first anyway), else the input's."""
    return compute_dtype if compute_dtype.itemsize <= u_dtype.itemsize else u_dtype


@dataclass(frozen=True)
class OwnerPlan:
    """How one matrix's whole computation runs: ``route`` ``"shard"`` (FSDP2: its shards to ``owner``
    of ``group`` and back, ``dim`` the sharded dim), ``"replicated"`` (DDP: ``owner`` of ``group``
    computes it, one all-gather per shape), ``"local"`` (no group) or ``"gather"`` (the whole matrix
    gathered on every rank, ``why``)."""
    route: str
    group: object = None
    dim: int | None = None
    owner: int | None = None
    why: str | None = None


def owner_plan_fields(plan: OwnerPlan) -> dict:
    """``plan``'s fields (shallow: its process group kept), to build a plan that extends it."""
    return {f.name: getattr(plan, f.name) for f in fields(OwnerPlan)}


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
    ``collectives.plan_owners`` over their NS5 costs; replicated ones dealt round-robin per shape,
    each shape's dealing starting at the least-loaded rank."""
    routes = [_route(p, replicated_pg) for p in params]
    sharded, replicated = defaultdict(list), defaultdict(list)
    for i, (p, r, wire) in enumerate(zip(params, routes, wires)):
        if r.route == "shard":
            sharded[(r.group, wire)].append(i)
        elif r.route == "replicated":
            replicated[(r.group, wire)].append(i)
    owner: dict[int, int] = {}
    for (pg, _), idx in sharded.items():
        owner.update(zip(idx, plan_owners([ns_cost(params[i].shape) for i in idx], dist.get_world_size(pg))))
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


# ----------------------------------------------------------------------------- the strategy
class OwnerCompute:
    """Whole-matrix computations by owner ranks under FSDP2 and DDP (the module docstring).

    ``replicated_group``: the process group across which plain-tensor matrices are replicated (DDP);
    ``"default"`` means the world group when ``torch.distributed`` is initialized with more than one
    rank (read when a plan is made), ``None`` computes every plain matrix locally (no collective).
    It keeps no state: plans are the caller's (an optimizer keeps them as derived state)."""

    def __init__(self, replicated_group="default"):
        if not (replicated_group is None or replicated_group == "default"
                or isinstance(replicated_group, dist.ProcessGroup)):
            raise ValueError(f"replicated_group must be 'default', None or a ProcessGroup, got {replicated_group!r}")
        self.replicated_group = replicated_group

    def replicated_pg(self):
        """The replicated group resolved (``"default"``: the world of several ranks, else None)."""
        g = self.replicated_group
        if g == "default":
            if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
                return None
            return dist.group.WORLD
        return g

    def plan(self, params: list[Tensor], wires: list[torch.dtype]) -> list[OwnerPlan]:
        """Each matrix's ``OwnerPlan`` (``plan_owner_compute`` over this strategy's replicated group)."""
        return plan_owner_compute(params, wires, self.replicated_pg())

    def compute(self, plans: list[OwnerPlan], active: list[Tensor], u: list[Tensor], fn: Callable,
                dtype: torch.dtype) -> list[Tensor]:
        """``fn`` (a list of whole matrices -> their results, batched as it likes) of each matrix of
        ``active`` (``u``: this rank's local tensors of it) by its plan, computed in ``dtype``: the
        results as this rank's local tensors."""
        out: list[Tensor | None] = [None] * len(active)
        sharded, replicated, local, gather = defaultdict(list), defaultdict(list), [], []
        for i, plan in enumerate(plans):
            wire = wire_dtype(u[i].dtype, dtype)
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
            items = [(plans[i].owner, u[i], tuple(active[i].shape), plans[i].dim) for i in idx]
            device = u[idx[0]].device
            results = owner_compute(items, pg, wire, device, lambda mine, fulls, wire=wire: (
                [o.to(wire) for o in fn(fulls)] if mine else []))
            for i, o in zip(idx, results):
                out[i] = o
        for (pg, wire), idx in replicated.items():
            outs = _replicated(pg, wire, [active[i] for i in idx], [u[i] for i in idx], [plans[i].owner for i in idx],
                               fn)
            for i, o in zip(idx, outs):
                out[i] = o
        if local:
            for i, o in zip(local, fn([u[i] for i in local])):
                out[i] = o
        if gather:
            from .sharding import gather_full, local_slice  # loads torch.distributed.tensor: DTensors only

            full = [gather_full(u[i], active[i]) for i in gather]
            for i, o in zip(gather, fn(full)):
                out[i] = local_slice(o, active[i])
        return out  # type: ignore[return-value]


def owners_of(plans: dict) -> dict[Tensor, int]:
    """``{matrix: owner rank of its route's group}`` of the matrices ``plans`` gives an owner."""
    return {p: plan.owner for p, plan in plans.items() if plan.owner is not None}


def gathered_of(plans: dict) -> dict[Tensor, str]:
    """``{matrix: why}`` of the matrices ``plans`` routes to the gather."""
    return {p: plan.why for p, plan in plans.items() if plan.route == "gather"}


def _replicated(pg, wire, params, u, owners, fn) -> list[Tensor]:
    """``fn`` of replicated matrices, each on its owner; one all-gather per shape returns them all."""
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
            for slot, o in enumerate(fn([u[idx[k]] for k in mine])):
                buf[slot].copy_(o)
        gathered = torch.empty((world * per_rank, *shape), dtype=wire, device=buf.device)
        all_gather_into_(gathered, buf, pg, "owner")
        slots = [0] * world
        for k, i in enumerate(idx):
            outs[i] = gathered[owner[k] * per_rank + slots[owner[k]]]
            slots[owner[k]] += 1
    return outs  # type: ignore[return-value]


# ----------------------------------------------------------------------------- sharded: the exchanges
def _chunk_shape(shape: tuple, dim: int, size: int) -> tuple:
    return tuple(size if d == dim else s for d, s in enumerate(shape))


def _exchange_plan(items: list[tuple], pg):
    """Shared bookkeeping of the two exchanges: ``items`` are ``(owner, tensor, whole shape, dim)``
    with ``Shard(dim)`` (``torch.chunk``) shards over the ranks of ``pg``."""
    from .sharding import chunk_sizes  # DTensor's Shard sizes (sharding loads torch.distributed.tensor)

    world, me = dist.get_world_size(pg), dist.get_rank(pg)
    sizes = [chunk_sizes(shape[dim], world) for _, _, shape, dim in items]
    numel = [[math.prod(_chunk_shape(shape, dim, sizes[j][r])) for r in range(world)]
             for j, (_, _, shape, dim) in enumerate(items)]
    by_owner = [[j for j, it in enumerate(items) if it[0] == q] for q in range(world)]
    return world, me, sizes, numel, by_owner


def to_owners(items: list[tuple], pg, dtype, device) -> list[Tensor | None]:
    """The owner exchange out (kind ``"owner"``): one ``all_to_all`` of this rank's shard of every
    item (``(owner, shard, whole shape, dim)``) to its owner. Returns each item's whole tensor on its
    owner (in ``dtype``), None elsewhere."""
    world, me, sizes, numel, by_owner = _exchange_plan(items, pg)
    mine = by_owner[me]
    send = [items[j][1].to(dtype).reshape(-1) for q in range(world) for j in by_owner[q]]
    in_splits = [sum(numel[j][me] for j in by_owner[q]) for q in range(world)]
    out_splits = [sum(numel[j][r] for j in mine) for r in range(world)]
    recv = all_to_all(send, in_splits, out_splits, dtype, device, pg, "owner")
    per_source = [c.split([numel[j][r] for j in mine]) for r, c in enumerate(recv.split(out_splits))]
    out: list[Tensor | None] = [None] * len(items)
    for k, j in enumerate(mine):
        _, _, shape, dim = items[j]
        out[j] = torch.cat([per_source[r][k].view(_chunk_shape(shape, dim, sizes[j][r])) for r in range(world)],
                           dim=dim)
    return out


def from_owners(items: list[tuple], pg, dtype, device) -> list[Tensor]:
    """The owner exchange back (kind ``"owner"``): one ``all_to_all`` of every rank's shard of every
    item (``(owner, whole tensor on the owner else None, whole shape, dim)``) from its owner.
    Returns this rank's shard of each item."""
    world, me, sizes, numel, by_owner = _exchange_plan(items, pg)
    mine = by_owner[me]
    send = []
    for r in range(world):
        for j in mine:
            _, whole, _, dim = items[j]
            send.append(whole.to(dtype).narrow(dim, sum(sizes[j][:r]), sizes[j][r]).reshape(-1))
    in_splits = [sum(numel[j][r] for j in mine) for r in range(world)]
    out_splits = [sum(numel[j][me] for j in by_owner[q]) for q in range(world)]
    recv = all_to_all(send, in_splits, out_splits, dtype, device, pg, "owner")
    out: list[Tensor | None] = [None] * len(items)
    for q, chunk in enumerate(recv.split(out_splits)):
        for j, piece in zip(by_owner[q], chunk.split([numel[j][me] for j in by_owner[q]])):
            _, _, shape, dim = items[j]
            out[j] = piece.view(_chunk_shape(shape, dim, sizes[j][me]))
    return out  # type: ignore[return-value]


def owner_compute(items: list[tuple], pg, dtype, device, compute: Callable,
                  back: list[int] | None = None) -> list[Tensor]:
    """Owner compute of sharded tensors: ``items`` ``(owner, shard, whole shape, dim)`` go to their
    owners (``to_owners``), ``compute(mine, wholes)`` runs there (``mine``: the indices of the items
    this rank owns, ``wholes`` their whole tensors; it returns one whole result per item, or None
    for an item with no result), and the results of the items ``back`` (default: all) come back as
    this rank's shards (``from_owners``), in the order of ``back``."""
    wholes = to_owners(items, pg, dtype, device)
    mine = [j for j, w in enumerate(wholes) if w is not None]
    results = dict(zip(mine, compute(mine, [wholes[j] for j in mine])))
    back = list(range(len(items))) if back is None else back
    if not back:
        return []
    return from_owners([(items[j][0], results.get(j), items[j][2], items[j][3]) for j in back], pg, dtype, device)


# ----------------------------------------------------------------------------- replicated statistics
def solve_as_owners(costs: list[float], n_ranks: int, solve: Callable) -> list[Tensor]:
    """``solve_on_owners``'s results computed on this rank alone: ``solve(owned)`` called for each
    owner's units in rank order, as each owner would call it, no collective. Where a device's batched
    solve rounds a unit by its batch, these are still the owners' bits."""
    owner = plan_owners(costs, n_ranks)
    result: dict[int, Tensor] = {}
    for r in range(n_ranks):
        owned = [i for i, o in enumerate(owner) if o == r]
        if owned:
            result.update(zip(owned, solve(owned)))
    return [result[i] for i in range(len(costs))]


def solve_on_owners(costs: list[float], ranks: tuple[int, ...], group, solve: Callable,
                    shapes: list[tuple], dtype: torch.dtype, device, kind: str = "basis") -> list[Tensor]:
    """Units of work held identically by every rank of ``group`` (global ``ranks``, in group-rank
    order), each solved once: ``collectives.plan_owners`` over ``costs`` picks its owner,
    ``solve(mine)`` (the indices this rank owns, in order) returns their results in ``dtype`` and
    shape ``shapes[i]``, and each owner broadcasts its results (one broadcast per owner that owns a
    unit, in rank order). Returns every unit's result on every rank."""
    owner = plan_owners(costs, len(ranks))
    me = ranks.index(dist.get_rank())
    mine = [i for i, o in enumerate(owner) if o == me]
    result = dict(zip(mine, solve(mine))) if mine else {}
    for r, src in enumerate(ranks):
        owned = [i for i, o in enumerate(owner) if o == r]
        if not owned:
            continue
        sizes = [math.prod(shapes[i]) for i in owned]
        buf = (torch.cat([result[i].reshape(-1) for i in owned]) if r == me
               else torch.empty(sum(sizes), dtype=dtype, device=device))
        collectives.broadcast_(buf, src, group, kind)
        if r != me:
            for i, flat in zip(owned, buf.split(sizes)):
                result[i] = flat.view(shapes[i])
    return [result[i] for i in range(len(costs))]
