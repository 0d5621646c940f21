"""Block Muon: NS5 on independent contiguous near-equal blocks of each matrix.

Not CMuon: CMuon cuts fused weights along their functional boundaries (Q/K/V, heads), which is
``split_sizes``/``num_heads`` here (``_split``; Muon, Block Muon and NorMuon take it).

The matrix is cut into ``blocks`` contiguous blocks along ``axis`` (1: column blocks, Dobb's input
side and the default; 0: row blocks, Dobb-G's side) with ``dobb.functional.block_sizes``, the same
partition Dobb uses (first ``size % B`` blocks one longer; cut at shard boundaries first when the
layout is sharded). Each block ``U_b`` gets ``O_b = NS5(U_b)``.

Scaling (our statement of the shared protocol for blocks): each block moves as a Muon update of a
matrix of its own shape, ``W_b <- W_b - lr * tau*sqrt(max(m_b, n_b)) * O_b``, so every block's
update RMS is ``tau``, as Muon's is (Table 9). Written against the whole-matrix ``s``, the raw
update is ``O = [ (s_b / s) O_b ]_b``. ``blocks=1`` is Muon exactly. Weight decay is the protocol's.

Locality: a block needs every entry of its rows x columns. When the axis that is *not* blocked is
whole on this rank (plain tensors; DTensors sharded only along the blocked axis, with blocks that
do not straddle shards, which ``block_sizes`` guarantees) the update is computed on the local
shard with no communication; otherwise the matrix is gathered first. All equal-shape blocks of all
matrices of a group run as one batched NS5.
"""
from __future__ import annotations

from dataclasses import dataclass

from ... import functional as F
from ..._base import _name_of
from ...attention_heads import head_blocks, role
from ...placement import follow_axis, follow_layout, layout_for
from ..._hparams import integer, layout_option
from .muon import AXIS, MuonSplitOptions, _MuonFamily, tiled_directions


@dataclass(frozen=True, kw_only=True)
class BlockMuonOptions(MuonSplitOptions):
    blocks: int = layout_option(4, integer(1))
    axis: int = layout_option(1, AXIS)


class BlockMuon(_MuonFamily):
    """Block Muon. Args as ``Muon`` plus ``blocks`` (default 4) and ``axis`` (1 columns, 0 rows;
    default 1). Left ``None`` (the default), both follow each matrix's placement: a DTensor cut
    along one axis (FSDP2 ``Shard(0)``, tensor parallel ``Shard(0)``/``Shard(1)``) with the other
    whole is blocked along the cut axis, one block per shard (no communication); a plain tensor
    takes ``axis=1, blocks=4``.

    With ``heads`` (``dobb.attention_heads``) each attention q/k/v matrix is cut into its per-head row
    blocks and the output projection into its per-head column blocks (whatever ``axis`` and
    ``blocks`` say; cut at shard boundaries, local when the other axis is whole here); the other
    matrices keep ``axis`` and ``blocks``. With ``split_sizes``/``num_heads`` a split weight's parts
    are matrices of their own, each cut into ``blocks`` blocks (the parts x blocks tiles are
    gathered when the weight is sharded)."""

    algorithm = "block-muon"
    Options = BlockMuonOptions

    def _group_plans(self, group):
        """Each matrix's tiles and whether they index its local shard: ``tiled_directions``' plan.

        Blocks are computed on the local shard when the unblocked axis is whole on this rank (a block
        never straddles shards, ``block_sizes`` guarantees it); otherwise the matrix is gathered first.
        A split (CMuon) weight's parts are cut into blocks, gathered when sharded."""
        plans = []
        for i, p in enumerate(group["params"]):
            # None (the default): follow the placement, one block per shard of the sharded axis
            axis = follow_axis(group["axis"], p, 1)
            blocks = follow_layout(group["blocks"], p, axis, 4)
            try:
                cut = self._head_cut(group, p)
                if cut is not None:  # an attention matrix with heads: one block per head
                    axis, blocks = cut
                else:
                    parts = self._row_parts(group, p)
                    if parts is not None:
                        plans.append((_part_blocks(parts, p.shape[1], blocks, axis), False))
                        continue
                lay = layout_for(p, "input" if axis == 1 else "output", blocks, None)
            except ValueError as exc:
                name = self._matrix_name(p, group) or _name_of(p, self._param_names, i)
                raise ValueError(f"{name}: {exc}") from None
            local_ok = lay.local_shape[1 - axis] == lay.shape[1 - axis]
            sizes = lay.local_sizes if local_ok else F.block_sizes(p.shape[axis], blocks)
            plans.append((_blocks(sizes, axis), local_ok))
        return plans

    def _head_cut(self, group, p):
        """``(axis, blocks)`` of an attention matrix under ``heads`` (``dobb.attention_heads``: q/k/v rows per
        head, the output projection's columns per head), None for any other matrix."""
        if group["heads"] is None:
            return None
        rows = self._row_parts(group, p)  # q/k/v: the per-head rows (checked, named)
        name, shape = self._matrix_name(p, group), tuple(p.shape)
        if role(name) == "qkv":
            return 0, len(rows) if rows else 1
        if role(name) == "out":
            return 1, head_blocks(name, shape, group["heads"], 1, 1, bool(group["transposed"]))[0]
        return None

    def _directions(self, group, active, states, params, u):
        return tiled_directions(group, active, params, u, [self._plans[p] for p in active], self._ns(group, self._out_dtype(group)))


def _blocks(sizes, axis, rows=slice(None)):
    """Tiles of contiguous blocks of ``sizes`` along ``axis`` (within ``rows`` for column blocks)."""
    tiles, start = [], 0
    for size in sizes:
        cut = slice(start, start + size)
        tiles.append((rows, cut) if axis == 1 else (cut, slice(None)))
        start += size
    return tiles


def _part_blocks(parts, n, blocks, axis):
    """Each part of a split weight cut into ``blocks`` blocks along ``axis`` (a part is a matrix)."""
    tiles, start = [], 0
    for rows in parts:
        if axis == 1:
            tiles += _blocks(F.block_sizes(n, blocks), 1, slice(start, start + rows))
        else:
            tiles += [(slice(start + t.start, start + t.stop), cs) for t, cs in _blocks(F.block_sizes(rows, blocks), 0)]
        start += rows
    return tiles
