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

Payload per step, per rank ``r`` (``PayloadMeter``'s logical sizes; ``e`` bytes per entry of the
wire dtype: ``ns_dtype`` when it is no wider than the momentum's, else the momentum's; exact, since
NS5 casts to ``ns_dtype`` first): sharded, ``e * (sum_i |shard_r(i)| + sum_{i owned by r} m_i n_i)``
over two all-to-alls; replicated, ``e * P ceil(N_g/P) m_g n_g`` per shape group ``g`` (one
all-gather each). The result equals single-process Muon with the same options entry for entry
(the owner runs the same NS5 on the same full matrix).
"""
from __future__ import annotations

import math
from collections import defaultdict

import torch
import torch.distributed as dist
from torch import Tensor

from ..layout import is_dtensor
from ..collectives import plan_owners as balance_owners  # the library's one greedy owner plan
from .muon import Muon, ns_options
from .newton_schulz import orthogonalize

__all__ = ["OwnerMuon", "balance_owners", "ns_cost"]


def ns_cost(shape) -> int:
    s, l = min(shape), max(shape)
    return 2 * s * s * l + s ** 3


def _wire_dtype(u_dtype: torch.dtype, ns_dtype: torch.dtype) -> torch.dtype:
    return ns_dtype if ns_dtype.itemsize <= u_dtype.itemsize else u_dtype


class OwnerMuon(Muon):
    """Muon (same math, state and options) with owner compute under FSDP2 and DDP.

    Extra argument ``replicated_group``: the process group across which plain-tensor matrices
    are replicated (DDP); ``"default"`` (the default) means the world group when
    ``torch.distributed`` is initialized with more than one rank, ``None`` computes every matrix
    locally (no collective). Param groups keep ``algorithm="muon"``.
    """

    def __init__(self, params, *, lr: float, replicated_group="default", **kwargs):
        if not (replicated_group is None or replicated_group == "default"
                or isinstance(replicated_group, dist.ProcessGroup)):
            raise ValueError(f"replicated_group must be 'default', None or a ProcessGroup, got {replicated_group!r}")
        self._replicated_group = replicated_group
        self.owners: dict[Tensor, int] = {}
        self.gathered: dict[Tensor, str] = {}
        super().__init__(params, lr=lr, **kwargs)

    def _replicated_pg(self):
        g = self._replicated_group
        if g == "default":
            if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
                return None
            return dist.group.WORLD
        return g

    def _route(self, p: Tensor):
        """``("shard", pg, dim)``, ``("replicated", pg)``, ``("local",)`` or ``("gather", why)``."""
        if not is_dtensor(p):
            pg = self._replicated_pg()
            return ("local",) if pg is None or dist.get_world_size(pg) == 1 else ("replicated", pg)
        from torch.distributed.tensor import Replicate, Shard

        mesh, (pl, *rest) = p.device_mesh, p.placements
        if mesh.ndim != 1 or rest:
            return ("gather", f"{mesh.ndim}-D mesh")
        if type(pl) is Shard:
            return ("shard", mesh.get_group(0), pl.dim)
        if isinstance(pl, Replicate):
            return ("replicated", mesh.get_group(0))
        return ("gather", f"placement {pl}")

    def _orthogonalize(self, group, active, u):
        opts = ns_options(group)
        ns = lambda mats: orthogonalize(mats, group["ns_coefficients"], group["ns_steps"], group["eps"], **opts)
        out: list[Tensor | None] = [None] * len(active)
        sharded, replicated, local, gather = defaultdict(list), defaultdict(list), [], []
        for i, p in enumerate(active):
            route = self._route(p)
            wire = _wire_dtype(u[i].dtype, opts["dtype"])
            if route[0] == "shard":
                sharded[(route[1], wire)].append((i, route[2]))
            elif route[0] == "replicated":
                replicated[(route[1], wire)].append(i)
            elif route[0] == "local":
                local.append(i)
            else:
                self.gathered[p] = route[1]
                gather.append(i)
        # Insertion order of the dicts follows parameter order: the same on every rank.
        for (pg, wire), items in sharded.items():
            for (i, _), o in zip(items, self._sharded(pg, wire, [(active[i], u[i], d) for i, d in items], ns)):
                out[i] = o
        for (pg, wire), idx in replicated.items():
            for i, o in zip(idx, self._replicated(pg, wire, [active[i] for i in idx], [u[i] for i in idx], ns)):
                out[i] = o
        if local:
            for i, o in zip(local, ns([u[i] for i in local])):
                out[i] = o
        if gather:
            for i, o in zip(gather, super()._orthogonalize(group, [active[i] for i in gather], [u[i] for i in gather])):
                out[i] = o
        return out

    # ------------------------------------------------------------------ FSDP2: two all-to-alls
    def _sharded(self, pg, wire, items, ns) -> list[Tensor]:
        world, me = dist.get_world_size(pg), dist.get_rank(pg)
        owners = balance_owners([ns_cost(p.shape) for p, _, _ in items], world)
        for (p, _, _), r in zip(items, owners):
            self.owners[p] = r
        from ..sharding import chunk_sizes  # DTensor Shard sizes; sharding loads torch.distributed.tensor

        sizes = [chunk_sizes(p.shape[d], world) for p, _, d in items]

        def shard_shape(j, r):
            p, _, d = items[j]
            return (sizes[j][r], p.shape[1]) if d == 0 else (p.shape[0], sizes[j][r])

        def numel(j, r):
            return math.prod(shard_shape(j, r))

        mine = [j for j, r in enumerate(owners) if r == me]
        by_owner = [[j for j, r in enumerate(owners) if r == q] for q in range(world)]
        # all-to-all 1: my shard of every matrix, to its owner
        send = [items[j][1].to(wire).reshape(-1) for q in range(world) for j in by_owner[q]]
        in_splits = [sum(numel(j, me) for j in by_owner[q]) for q in range(world)]
        out_splits = [sum(numel(j, r) for j in mine) for r in range(world)]
        recv = self._all_to_all(send, in_splits, out_splits, wire, pg)
        per_source = [list(c.split([numel(j, r) for j in mine])) for r, c in enumerate(recv.split(out_splits))]
        fulls = [torch.cat([per_source[r][k].view(shard_shape(j, r)) for r in range(world)], dim=items[j][2])
                 for k, j in enumerate(mine)]
        results = [o.to(wire) for o in ns(fulls)] if fulls else []
        # all-to-all 2: every rank's shard of each of my results, back
        back = []
        for r in range(world):
            for k, j in enumerate(mine):
                d = items[j][2]
                start = sum(sizes[j][:r])
                back.append(results[k].narrow(d, start, sizes[j][r]).reshape(-1))
        in2 = [sum(numel(j, r) for j in mine) for r in range(world)]
        out2 = [sum(numel(j, me) for j in by_owner[q]) for q in range(world)]
        recv2 = self._all_to_all(back, in2, out2, wire, pg)
        outs: list[Tensor | None] = [None] * len(items)
        for q, chunk in enumerate(recv2.split(out2)):
            for j, piece in zip(by_owner[q], chunk.split([numel(j, me) for j in by_owner[q]])):
                outs[j] = piece.view(shard_shape(j, me))
        return outs  # type: ignore[return-value]

    @staticmethod
    def _all_to_all(pieces, in_splits, out_splits, dtype, pg) -> Tensor:
        inp = torch.cat(pieces) if pieces else torch.empty(0, dtype=dtype)
        out = torch.empty(sum(out_splits), dtype=dtype, device=inp.device)
        dist.all_to_all_single(out, inp, out_splits, in_splits, group=pg)
        return out

    # ------------------------------------------------------------------ DDP: 1/P each, all-gather
    def _replicated(self, pg, wire, params, u, ns) -> list[Tensor]:
        world, me = dist.get_world_size(pg), dist.get_rank(pg)
        outs: list[Tensor | None] = [None] * len(params)
        loads = [0] * world
        shapes: dict[tuple, list[int]] = defaultdict(list)
        for i, p in enumerate(params):
            shapes[tuple(p.shape)].append(i)
        for shape, idx in shapes.items():
            start = min(range(world), key=lambda r: (loads[r], r))
            owner = [(start + k) % world for k in range(len(idx))]
            for k, i in enumerate(idx):
                self.owners[params[i]] = owner[k]
                loads[owner[k]] += ns_cost(shape)
            per_rank = -(-len(idx) // world)
            mine = [k for k in range(len(idx)) if owner[k] == me]
            buf = torch.zeros((per_rank, *shape), dtype=wire, device=u[idx[0]].device)
            if mine:
                for slot, o in enumerate(ns([u[idx[k]] for k in mine])):
                    buf[slot].copy_(o)
            gathered = torch.empty((world * per_rank, *shape), dtype=wire, device=buf.device)
            dist.all_gather_into_tensor(gathered, buf, group=pg)
            slots = [0] * world
            for k, i in enumerate(idx):
                outs[i] = gathered[owner[k] * per_rank + slots[owner[k]]]
                slots[owner[k]] += 1
        return outs  # type: ignore[return-value]
