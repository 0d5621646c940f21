"""Every collective the library issues on its own behalf (not those of FSDP or DTensor), each
tagged with its kind so a meter can tell them apart, over a group from the user, the layout or
``plain_stat_group``; and ``plan_owners``, the one greedy plan of which rank computes which unit of
work (Dobb's split refresh, owner-compute Muon, SOAP under sharding: ``dobb.distribution``, which
builds the owner exchanges on ``all_to_all``, ``all_gather_into_`` and ``broadcast_``).

The library calls ``torch.distributed`` only through the functions here (``all_reduce_sum_``,
``all_to_all``, ``all_gather_into_``, ``broadcast_``), each with its ``kind``
(``tests/test_collectives.py`` checks that no other module of ``dobb`` issues one). Kinds:

- ``"stat"``: the data-parallel statistic sums (with the finiteness flags folded in when they
  share the group); ``"finite"``: the finiteness flags alone;
- ``"norm"``: ell2 column norms and gradient-Gram partial sums over the shards of the other axis
  (Dobb's ``grad_gram``, SPlus's statistics);
- ``"basis"``: the bases of a split refresh, broadcast by the rank that solved them;
- ``"owner"``: owner-compute exchanges (OwnerMuon's and MuonBP's whole-matrix NS5, SOAP's gradient
  shards to each matrix's owner and the update's shards back, its checkpoint conversion);
- ``"partial"``: Dion's ``O(r(m+n))`` partial products summed over the shards of an axis.

The tag is a context variable (``collective_kind``) read by ``dobb.meter``; this module does not
know the meter exists. A kind outside ``KINDS`` is a ``ValueError``.

Groups are never guessed: a plain parameter's statistic group is the ``stat_group`` the user gave
or the process group of the ``DistributedDataParallel`` module passed as ``model``
(``plain_stat_group``); DTensor parameters take theirs from their mesh (``sharding``).
"""
from __future__ import annotations

import contextlib
import contextvars

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

__all__ = ["KINDS", "collective_kind", "current_kind", "all_reduce_sum_", "all_to_all", "all_gather_into_",
           "broadcast_", "broadcast_object", "all_gather_object", "plain_stat_group", "group_ranks", "common_group",
           "plan_owners"]

KINDS = ("stat", "finite", "norm", "basis", "owner", "partial", "checkpoint")

_KIND: contextvars.ContextVar[str | None] = contextvars.ContextVar("dobb_collective_kind", default=None)


def _check_kind(kind) -> None:
    if kind not in KINDS:
        raise ValueError(f"collective kind must be one of {KINDS}, got {kind!r}")


@contextlib.contextmanager
def collective_kind(kind: str):
    """Tag the collectives issued inside the block (``kind``: one of ``KINDS``)."""
    _check_kind(kind)
    token = _KIND.set(kind)
    try:
        yield
    finally:
        _KIND.reset(token)


def current_kind() -> str | None:
    """The tag of the enclosing ``collective_kind`` block, or None."""
    return _KIND.get()


# ----------------------------------------------------------------------------- the collectives
def all_reduce_sum_(tensor: torch.Tensor, group, kind: str) -> torch.Tensor:
    """``tensor`` summed over ``group`` in place (it must be contiguous); no collective without a group."""
    _check_kind(kind)
    if group is not None:
        with collective_kind(kind):
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    return tensor


def all_to_all(pieces: list[torch.Tensor], in_splits: list[int], out_splits: list[int], dtype: torch.dtype,
               device, group, kind: str) -> torch.Tensor:
    """One ``all_to_all_single``: the flat ``pieces`` (``in_splits[r]`` entries to rank ``r`` of
    ``group``) out, ``out_splits[r]`` entries from each rank ``r`` back, as one flat tensor."""
    _check_kind(kind)
    inp = torch.cat(pieces) if pieces else torch.empty(0, dtype=dtype, device=device)
    out = torch.empty(sum(out_splits), dtype=dtype, device=device)
    with collective_kind(kind):
        dist.all_to_all_single(out, inp, out_splits, in_splits, group=group)
    return out


def all_gather_into_(out: torch.Tensor, tensor: torch.Tensor, group, kind: str) -> torch.Tensor:
    """Every rank's ``tensor``, stacked along dim 0 in group-rank order into ``out``."""
    _check_kind(kind)
    with collective_kind(kind):
        dist.all_gather_into_tensor(out, tensor, group=group)
    return out


def broadcast_(tensor: torch.Tensor, src: int, group, kind: str) -> torch.Tensor:
    """``tensor`` of global rank ``src`` into ``tensor`` on every rank of ``group``."""
    _check_kind(kind)
    with collective_kind(kind):
        dist.broadcast(tensor, src=src, group=group)
    return tensor


def broadcast_object(obj, src: int, kind: str):
    """``obj`` (picklable) of global rank ``src`` on every rank of the default group."""
    _check_kind(kind)
    box = [obj]
    with collective_kind(kind):
        dist.broadcast_object_list(box, src=src)
    return box[0]


def all_gather_object(obj, kind: str) -> list:
    """Every rank's ``obj`` (picklable), in rank order, on every rank of the default group."""
    _check_kind(kind)
    out = [None] * dist.get_world_size()
    with collective_kind(kind):
        dist.all_gather_object(out, obj)
    return out


# ----------------------------------------------------------------------------- groups and owners
def group_ranks(group) -> frozenset[int]:
    """Global ranks of ``group`` (this rank alone for None)."""
    if group is None:
        return frozenset([dist.get_rank() if dist.is_available() and dist.is_initialized() else 0])
    return frozenset(dist.get_process_group_ranks(group))


def common_group(groups: list):
    """One group over the union of the ranks of ``groups`` (Nones ignored): one of them when it
    covers the union, the world when the union is the world; None when no rank but this one."""
    groups = [g for g in groups if g is not None]
    if not groups:
        return None
    union = frozenset().union(*(group_ranks(g) for g in groups))
    for g in groups:
        if group_ranks(g) == union:
            return g
    if union == frozenset(range(dist.get_world_size())):
        return dist.group.WORLD
    raise ValueError(
        f"the optimizer's parameters are spread over process groups with ranks "
        f"{sorted(sorted(group_ranks(g)) for g in groups)} and no one group covers them, so the ranks that "
        f"share a step cannot decide together whether its gradients are finite; pass check_finite=False"
    )


def plain_stat_group(model, stat_group):
    """The group over which plain (non-DTensor) parameters average their statistics.

    ``stat_group`` when given (a ``ProcessGroup``, or None: no averaging); else the process group of
    the ``DistributedDataParallel`` module passed as ``model``; else None in a single process. Under
    an initialized process group of several ranks with neither, a ``ValueError``: the ranks that see
    different data cannot be guessed (a model trained on one rank only would hang at its first
    refresh if the world were assumed).
    """
    if stat_group != "default":
        if stat_group is not None and not isinstance(stat_group, dist.ProcessGroup):
            raise ValueError(
                f"stat_group for plain (non-DTensor) parameters must be a ProcessGroup or None, got "
                f"{stat_group!r} (mesh dim names apply to DTensor parameters only)"
            )
        return stat_group if stat_group is not None and dist.get_world_size(stat_group) > 1 else None
    if isinstance(model, DistributedDataParallel):
        group = model.process_group
        return group if dist.get_world_size(group) > 1 else None
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        raise ValueError(
            f"plain (non-DTensor) parameters under an initialized process group of {dist.get_world_size()} "
            f"ranks: say which ranks average the statistics. Pass the DistributedDataParallel module as "
            f"`model` (its process group is used), or stat_group=<ProcessGroup> (None: this rank's data alone)"
        )
    return None


def plan_owners(costs: list[float], ranks: int, loads: list[float] | None = None) -> list[int]:
    """Owner (0 .. ranks-1) of each unit: longest first, each to the least loaded rank (ties: the
    lowest rank; equal costs keep their order). Pure: every rank computes the same plan.

    ``loads``: the ranks' loads so far (units planned earlier, e.g. SOAP's earlier param groups);
    updated in place when given."""
    if loads is not None and len(loads) != ranks:
        raise ValueError(f"loads has {len(loads)} entries for {ranks} ranks")
    load = loads if loads is not None else [0.0] * ranks
    owner = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        r = min(range(ranks), key=lambda r: (load[r], r))
        owner[i] = r
        load[r] += costs[i]
    return owner
