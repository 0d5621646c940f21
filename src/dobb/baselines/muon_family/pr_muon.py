"""Periodic Row-wise Muon: a full NS5 step every ``period`` steps, row-normalized momentum between.

The cheap steps need no matrix-wide operation (row norms are local when rows are sharded), which
is the point of the method for large sharded models. Our choices, stated because the method's
summary does not pin them down:

- a parameter's full steps are its steps ``0, K, 2K, ...`` (its own step counter, in the state);
- between them the direction is ``rownorm(U) * sqrt(min(m, n) / m)``: unit rows rescaled so that
  ``||O||_F^2 = min(m, n)``, Muon's norm, so every step moves the weight with the same RMS ``tau``
  under the shared protocol (for ``m <= n`` the factor is 1, plain unit rows);
- ``U`` is Muon's (same EMA momentum and Nesterov option), so ``period=1`` is Muon exactly.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .. import _common as C
from ..._hparams import integer, option
from .muon import MuonOptions, _MuonFamily
from ...newton_schulz import row_normalize


@dataclass(frozen=True, kw_only=True)
class PRMuonOptions(MuonOptions):
    period: int = option(3, integer(1))


class PeriodicRowMuon(_MuonFamily):
    """PR-Muon. Args as ``Muon`` plus ``period`` (``K``, default 3: full NS5 every K-th step)."""

    algorithm = "pr-muon"
    Options = PRMuonOptions
    _uses_step = True

    def _directions(self, group, active, states, params, u):
        full_idx = [i for i, s in enumerate(states) if s["step"] % group["period"] == 0]
        outs = [None] * len(active)
        if full_idx:
            ortho = self._orthogonalize(group, [active[i] for i in full_idx], [u[i] for i in full_idx])
            for i, o in zip(full_idx, ortho):
                outs[i] = o
        for i, p in enumerate(active):
            if outs[i] is None:
                outs[i] = self._row_direction(u[i], p)
        scales = [C.update_scale(*p.shape, group["tau"]) for p in active]
        return params, outs, scales

    @staticmethod
    def _row_direction(u, p):
        m, n = p.shape
        return C.row_wise(lambda x: row_normalize(C.upcast(x)) * math.sqrt(min(m, n) / m), u, p)
