"""Block Muon (chunked Muon, CMuon): NS5 on independent contiguous blocks of each matrix.

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

import torch

from .. import functional as F
from .._base import _name_of
from ..placement import layout_for
from . import _common as C
from .muon import MUON_DEFAULTS, _MuonFamily, ns_options
from .newton_schulz import orthogonalize


class BlockMuon(_MuonFamily):
    """Block Muon. Args as ``Muon`` plus ``blocks`` (default 4) and ``axis`` (1 columns, 0 rows)."""

    algorithm = "block-muon"
    matrix_defaults = dict(MUON_DEFAULTS, blocks=4, axis=1)

    def __init__(self, params, *, lr: float, **kwargs):
        self._layouts = {}
        super().__init__(params, lr=lr, **kwargs)

    def _check_matrix_group(self, group):
        C.check_int(group, "blocks", 1)
        if group["axis"] not in (0, 1) or isinstance(group["axis"], bool):
            raise ValueError(f"axis must be 0 (row blocks) or 1 (column blocks), got {group['axis']!r}")
        side = "input" if group["axis"] == 1 else "output"
        for i, p in enumerate(group["params"]):
            try:
                self._layouts[p] = layout_for(p, side, group["blocks"], None)
            except ValueError as exc:
                raise ValueError(f"{_name_of(p, self._param_names, i)}: {exc}") from None
        super()._check_matrix_group(group)

    def _directions(self, group, active, states, params, u):
        axis, blocks, tau = group["axis"], group["blocks"], group["tau"]
        srcs, plan = [], []
        for p, ut in zip(active, u):
            lay = self._layouts[p]
            local_ok = lay.local_shape[1 - axis] == lay.shape[1 - axis]
            # Unblocked axis sharded: a block spans ranks, so gather the matrix first.
            sizes = lay.local_sizes if local_ok else F.block_sizes(p.shape[axis], blocks)
            src = ut if local_ok else C.gather_full(ut, p)
            plan.append((local_ok, len(srcs), sizes))
            start = 0
            for size in sizes:
                srcs.append(src[:, start:start + size] if axis == 1 else src[start:start + size])
                start += size
        outs = orthogonalize(srcs, group["ns_coefficients"], group["ns_steps"], group["eps"], **ns_options(group))

        targets, updates, scales = [], [], []
        for p, pl, (local_ok, first, sizes) in zip(active, params, plan):
            block_scales = [C.update_scale(*((p.shape[0], b) if axis == 1 else (b, p.shape[1])), tau)
                            for b in sizes]
            mine = outs[first:first + len(sizes)]
            if local_ok:  # each block is added to its own view of the weight with its own s_b
                start = 0
                for size, o, sb in zip(sizes, mine, block_scales):
                    targets.append(pl[:, start:start + size] if axis == 1 else pl[start:start + size])
                    updates.append(o)
                    scales.append(sb)
                    start += size
            else:  # fold s_b / s into the full O, keep this rank's shard, add with the matrix's s
                s = C.update_scale(*p.shape, tau)
                full = torch.cat([o.float() * (sb / s) for o, sb in zip(mine, block_scales)], dim=axis)
                targets.append(pl)
                updates.append(C.local_slice(full, p))
                scales.append(s)
        return targets, updates, scales
