"""NorMuon (Li et al. 2025): Muon's direction with a per-neuron (per-row) adaptive normalization.

Per matrix ``W`` (``m x n``; a row is one output neuron), after Muon's momentum and ``O = NS5(U)``:

    v <- beta2 v + (1 - beta2) mean_j O[:, j]^2        # per-row second moment, v in R^m
    O' = O / (sqrt(v) + eps)                           # rows of equal RMS on average
    O' <- O' * ||O||_F / ||O'||_F                      # keep NS5's Frobenius norm
    W <- (1 - lr*wd) W - lr * tau*sqrt(max(m, n)) * O'

The last rescale (as the ``dion`` package's NorMuon does) keeps ``||O'||_F^2 ~ min(m, n)``, so the
shared protocol's ``tau*sqrt(max(m, n))`` gives the update RMS ``tau`` of every Muon-type baseline
(Table 9). ``v`` is a float32 vector (float64 for float64 weights), zero at the start, kept whole
and identical on every rank (it is computed from the full ``O``, which sharded weights gather as
Muon does). The normalization is the pure function ``normuon_normalize``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ._split import row_tiles
from ..._hparams import option, positive, unit_interval
from .muon import MuonSplitOptions, _MuonFamily, tiled_directions


@dataclass(frozen=True, kw_only=True)
class NeuronOptions:
    """The per-row second moment of NorMuon and Dion3."""
    beta2: float = option(0.95, unit_interval)
    neuron_eps: float = option(1e-8, positive)


@dataclass(frozen=True, kw_only=True)
class NorMuonOptions(MuonSplitOptions, NeuronOptions):
    pass


def normuon_normalize(o: Tensor, v: Tensor, beta2: float, eps: float = 1e-8) -> tuple[Tensor, Tensor]:
    """``(O', v_new)`` for a batch ``o`` (``(b, m, n)``) and its row second moments ``v`` (``(b, m)``).

    Computed in ``v``'s dtype (at least fp32). Zero rows stay zero; a zero matrix stays zero.
    """
    o = o.to(v.dtype)
    v_new = torch.lerp(v, o.square().mean(dim=-1), 1 - beta2)
    scaled = o / (v_new.sqrt() + eps).unsqueeze(-1)
    before = o.norm(dim=(-2, -1), keepdim=True)
    after = scaled.norm(dim=(-2, -1), keepdim=True).clamp_min(1e-30)
    return scaled * (before / after), v_new


def state_dtype(p: Tensor) -> torch.dtype:
    return torch.float64 if p.dtype == torch.float64 else torch.float32


class NorMuon(_MuonFamily):
    """NorMuon. Args as ``Muon`` (``split_sizes``/``num_heads`` included: each part is normalized,
    Frobenius rescale too, as a matrix of its own) plus ``beta2`` (0.95, the per-row second moment's
    EMA) and ``neuron_eps`` (1e-8)."""

    algorithm = "normuon"
    Options = NorMuonOptions
    _own_dtype_keys = ("neuron_variance",)  # stays fp32 when a bf16 model resumes

    def _init_matrix_state(self, group):
        super()._init_matrix_state(group)
        for p in group["params"]:
            if "neuron_variance" not in self.state[p]:
                self.state[p]["neuron_variance"] = torch.zeros(p.shape[0], dtype=state_dtype(p), device=p.device)

    def _directions(self, group, active, states, params, u):
        def finish(i, tiles, outs):  # per part: its rows' second moments, its own Frobenius rescale
            v, res = states[i]["neuron_variance"], []
            for (rows, _), o in zip(tiles, outs):
                o_new, v_new = normuon_normalize(o.unsqueeze(0), v[rows].unsqueeze(0), group["beta2"],
                                                 group["neuron_eps"])
                v[rows] = v_new[0]
                res.append(o_new[0])
            return res

        # v is computed from the full O, so sharded matrices are gathered (local=False), as Muon's
        plans = [(row_tiles(self._row_parts(group, p)), False) for p in active]
        return tiled_directions(group, active, params, u, plans, self._ns(group), finish)
