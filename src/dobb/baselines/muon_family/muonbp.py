"""MuonBP: Muon with block-periodic orthogonalization (Khaled et al., arXiv 2510.16981).

Muon's momentum (and Nesterov option), then per step one of two directions:

- **block step** (``P - 1`` of every ``P`` steps): NS5 of each block of the matrix on its own,
  where the blocks stand for the shards. On a DTensor sharded along one matrix axis (FSDP2's
  ``Shard(0)``, column-parallel TP: rows; ``Shard(1)``, row-parallel TP: columns) the blocks run
  along that axis and never straddle a shard (``dobb.functional.block_sizes`` cuts at shard
  boundaries first, the partition Block Muon and Dobb use), so each rank orthogonalizes its own
  shard with no communication; with ``blocks`` equal to the shard count each rank's shard is one
  block, the paper's setting. On plain tensors (and DTensors that are replicated, or sharded along
  both axes) ``blocks`` and ``axis`` cut the matrix exactly as ``BlockMuon`` does, to stand for the
  shards; a DTensor whose other axis is also sharded is gathered for its blocks, as Block Muon does.
  Each block moves as a Muon update of its own shape, ``tau*sqrt(max(m_b, n_b)) * NS5(U_b)``.
- **full step** (every ``P``-th step): NS5 of the whole matrix, computed by its owner as
  ``OwnerMuon`` does, through the same strategy it holds (``dobb.distribution.OwnerCompute``: the
  owner plan and the two all-to-alls under FSDP2; one all-gather per shape under DDP), moved with
  Muon's ``tau*sqrt(max(m, n))``.

Each kind of step is thus matched to update RMS ``tau`` by its own dimensions: this is the paper's
pair of learning rates (block and full), both derived from the one ``lr``.

Choices where the paper is silent (stated in docs/baselines.md too):

- ``period`` ``P`` defaults to 5; ``period=0`` means no full step ever (every step a block step:
  row-block ``BlockMuon`` exactly), ``period=1`` a full step every step (``Muon`` exactly);
- phase: a parameter's full steps are its steps ``0, P, 2P, ...`` (its own step counter, kept in
  the state as PR-Muon does), so the first step is a full one;
- defaults ``blocks=4``, ``axis=0`` (row blocks: the 4 shards of FSDP2's ``Shard(0)`` on 4 ranks);
  ``blocks`` left ``None`` (the default) on a DTensor cut along its block axis by one mesh dim is
  that axis' shard count (one block per shard, the paper's setting).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..._base import _name_of
from ..._hparams import integer, layout_option, option
from ...layout import is_dtensor
from ...placement import follow_layout, layout_for
from ...distribution import OwnerCompute, OwnerPlan, gathered_of, owner_plan_fields, owners_of
from .. import _common as C
from .block_muon import _blocks
from .muon import AXIS, MuonOptions, _MuonFamily, tiled_directions

__all__ = ["MuonBP", "block_axis"]


def block_axis(p, axis: int) -> int:
    """The axis MuonBP's block step cuts ``p`` along: the sharded axis of a DTensor sharded along
    exactly one matrix axis (its shards are the blocks), else ``axis``."""
    if not is_dtensor(p):
        return axis
    dims = {pl.dim % 2 for pl in p.placements if pl.is_shard()}
    return dims.pop() if len(dims) == 1 else axis


@dataclass(frozen=True, kw_only=True)
class MuonBPOptions(MuonOptions):
    period: int = option(5, integer(0))
    blocks: int = layout_option(4, integer(1))
    axis: int = option(0, AXIS)


@dataclass(frozen=True)
class MuonBPPlan(OwnerPlan):
    """A matrix's ``OwnerPlan`` (its full steps) with its block step's tiles and whether they index
    its local shard (``tiled_directions``' plan)."""
    block: tuple = ()


class MuonBP(_MuonFamily):
    """MuonBP. Args as ``Muon`` (and ``OwnerMuon``'s ``replicated_group``) plus ``period`` (``P``,
    default 5: a full step every ``P``-th step, 0 never), ``blocks`` (default 4) and ``axis``
    (0 rows, the default; 1 columns) of the block steps; see the module docstring. ``owners`` and
    ``gathered`` read the full steps' plans, as ``OwnerMuon``'s do."""

    algorithm = "muonbp"
    Options = MuonBPOptions
    _uses_step = True

    def __init__(self, params, *, lr: float, replicated_group="default", **kwargs):
        # the argument first: a copy's refusal names the first attribute that holds a process group
        self._replicated_group = replicated_group
        self._distribution = OwnerCompute(replicated_group)  # validates it
        super().__init__(params, lr=lr, **kwargs)

    @property
    def owners(self):
        return owners_of(self._plans)

    @property
    def gathered(self):
        return gathered_of(self._plans)

    def _group_plans(self, group):
        plans = []
        for i, (p, whole) in enumerate(zip(group["params"], self._owner_plans(group))):
            axis = block_axis(p, group["axis"])
            side = "input" if axis == 1 else "output"
            try:  # blocks None (the default): one block per shard of a sharded axis, 4 otherwise
                lay = layout_for(p, side, follow_layout(group["blocks"], p, axis, 4), None)
            except ValueError as exc:
                raise ValueError(f"{_name_of(p, self._param_names, i)}: {exc}") from None
            axis = lay.blocked_axis
            # local when the unblocked axis is whole here (blocks never straddle shards)
            local_ok = lay.local_shape[1 - axis] == lay.shape[1 - axis]
            block = (_blocks(lay.local_sizes if local_ok else lay.global_sizes, axis), local_ok)
            plans.append(MuonBPPlan(**owner_plan_fields(whole), block=block))
        return plans

    def is_full_step(self, group, p) -> bool:
        """Whether ``p``'s next step is a full (whole-matrix) one."""
        period = group["period"]
        return period > 0 and self.state[p]["step"] % period == 0

    def _directions(self, group, active, states, params, u):
        full = [i for i, p in enumerate(active) if self.is_full_step(group, p)]
        block = sorted(set(range(len(active))) - set(full))
        targets, updates, scales = [], [], []
        if full:  # the owner computes each whole matrix (every rank takes this branch together)
            outs = self._orthogonalize(group, [active[i] for i in full], [u[i] for i in full])
            targets += [params[i] for i in full]
            updates += outs
            scales += [C.update_scale(*active[i].shape, group["tau"]) for i in full]
        if block:
            t, o, s = tiled_directions(group, [active[i] for i in block], [params[i] for i in block],
                                       [u[i] for i in block], [self._plans[active[i]].block for i in block],
                                       self._ns(group, self._out_dtype(group)))
            targets += t
            updates += o
            scales += s
        return targets, updates, scales
