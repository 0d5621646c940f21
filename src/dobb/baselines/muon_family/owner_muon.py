"""Muon with owner compute: each matrix's NS5 runs once, on one rank, with two all-to-alls.

The strongest distributed Muon (the ``dion`` package's megabatching, Dion3 paper) does not let
DTensor dispatch gather every matrix on every rank. This class does what it does, through the
library's distribution layer (``dobb.distribution.OwnerCompute``, which it holds):

- **FSDP2 (DTensor ``Shard(d)`` on a 1-D mesh).** Every matrix gets an owner rank, balanced by
  cost (longest-processing-time: matrices by NS5 FLOPs ``2 s^2 l + s^3`` descending, each to the
  least-loaded rank; ties to the lowest rank, so every rank computes the same owners). One
  ``all_to_all`` sends each rank's shards of every matrix to its owner (all matrices of the step
  in one buffer); owners assemble their full matrices, run NS5 batched by shape, and a second
  ``all_to_all`` returns each rank its shards of the results.
- **DDP (plain tensors, identical on every rank of ``replicated_group``).** Equal-shape matrices are
  dealt round-robin over the ranks, each rank orthogonalizes its share, and one ``all_gather`` per
  shape returns every result to every rank.
- Anything else (2-D meshes, ``_StridedShard``, ``Partial``) falls back to Muon's gather
  (``OwnerMuon.gathered`` lists them); plain tensors without a group are computed locally.

Each matrix's route and owner are its plan (``distribution.OwnerPlan``), built once with its param
group and rebuilt from the groups after ``load_state_dict`` or in a copy (``MatrixOptimizer``'s derived
state); the step reads them and writes nothing but the state. The owners are planned over each param
group's matrices of one route group and wire dtype, as a step of every matrix meets them (a step where
some matrices have no gradient keeps the same owners). The exchanges go through
``dobb.collectives`` with kind ``"owner"``; ``dobb.distribution`` gives their payload. The result
equals single-process Muon with the same options entry for entry (the owner runs the same NS5 on
the same full matrix).
"""
from __future__ import annotations

from torch import Tensor

from ...distribution import OwnerCompute, gathered_of, owners_of
from .muon import MuonSplitOptions, _MuonFamily, muon_directions

__all__ = ["OwnerMuon"]


class OwnerMuon(_MuonFamily):
    """Muon (same math, state and options) with owner compute under FSDP2 and DDP.

    Extra argument ``replicated_group``: the process group across which plain-tensor matrices
    are replicated (DDP); ``"default"`` (the default) means the world group when
    ``torch.distributed`` is initialized with more than one rank (when the optimizer is built),
    ``None`` computes every matrix locally (no collective). Param groups keep ``algorithm="muon"``.

    ``owners`` (``{matrix: rank of its route's group}``) and ``gathered`` (``{matrix: why}``) read
    the plans.
    """

    algorithm = "muon"  # Muon's param groups and state: a checkpoint of one loads into the other
    Options = MuonSplitOptions

    def __init__(self, params, *, lr: float, replicated_group="default", **kwargs):
        # the argument first: a copy's refusal names the first attribute that holds a process group
        self._replicated_group = replicated_group
        self._distribution = OwnerCompute(replicated_group)  # validates it
        super().__init__(params, lr=lr, **kwargs)

    @property
    def owners(self) -> dict[Tensor, int]:
        return owners_of(self._plans)

    @property
    def gathered(self) -> dict[Tensor, str]:
        return gathered_of(self._plans)

    def _group_plans(self, group):
        return self._owner_plans(group)

    def _directions(self, group, active, states, params, u):
        return muon_directions(self, group, active, params, u)
