"""Spectral-Aware Muon (SAMuon; Wu, Yu, Zhang et al.): Muon's update with the head of the spectrum
held at Muon's scale and the bulk amplified by a static prior.

Per matrix, with ``U`` Muon's (Nesterov) momentum, ``NS(U)`` its NS5 and ``(u_i, v_i)`` the top-``k``
singular pairs of ``U``:

    s_i = 1 + (gamma_t - 1) log i / log k          (i = 1..k: s_1 = 1, s_k = gamma_t; k = 1: s_1 = 1)
    O   = gamma_t NS(U) - sum_{i<=k} (gamma_t - s_i) u_i v_i^T

With an exact polar factor ``NS(U) = P Q^T`` the singular values of ``O`` are the prior: ``s_i`` on
the top ``k`` directions, ``gamma_t`` on every other one (NS5's own band, ~[0.7, 1.2], multiplies
both). ``gamma_t`` warms up from 1 to ``gamma`` with a cosine over the first ``gamma_warmup``
(0.3) of ``total_steps`` (not given: a warning, and ``gamma`` from the first step); at ``gamma_t = 1`` the update is Muon's bit for bit (no pair is computed).

The top pairs (``topk_method``): ``"exact"`` (``torch.linalg.svd``), ``"lowrank"`` (randomized
subspace iteration, ``k + oversample`` columns, two power steps, a Gaussian sketch seeded by
``(seed, step)`` so every rank draws the same one and torch's global RNG is untouched),
``"power"`` (``k = 1`` only: power iteration warm-started from the last step's right vector,
state ``"top_v"``; the lite variant, ``samuon-lite``), ``"auto"`` (exact up to ``min(m, n) = 1024``,
lowrank above). ``top_k`` defaults to the paper's ``round(32 sqrt(d_model / 512))`` with ``d_model``
taken as ``min(m, n)`` (the width, for every hidden matrix of a standard transformer; 16 at width 128).

Scale: the shared protocol's ``tau*sqrt(max(m, n))`` (the paper uses Scion's ``sqrt(d_out/d_in)``
with its own lr). The bulk then moves ``gamma`` times Muon's RMS, so SAMuon's update RMS is about
``gamma * tau``, not the protocol's ``tau``: it needs its own lr grid (docs/baselines.md).
"""
from __future__ import annotations

import math
import warnings
from collections import defaultdict
from dataclasses import dataclass

import torch
from torch import Tensor

from .. import _common as C
from ..._hparams import Rule, closed_unit_interval, integer, one_of, option, optional, positive
from .muon import MuonOptions, _MuonFamily

TOPK_METHODS = ("auto", "exact", "lowrank", "power")
EXACT_UP_TO = 1024  # "auto": exact SVD up to this min(m, n), randomized above


@dataclass(frozen=True, kw_only=True)
class SAMuonOptions(MuonOptions):
    gamma: float = option(5.0, positive.hint("1 is Muon"))
    gamma_warmup: float = option(0.3, Rule(closed_unit_interval.test, "be a fraction of total_steps in [0, 1]"))
    total_steps: int | None = option(None, optional(integer(1)))
    top_k: int | None = option(None, optional(integer(1)))
    topk_method: str = option("auto", one_of(*TOPK_METHODS))
    power_iters: int = option(2, integer(1))
    oversample: int = option(8, integer(0))
    seed: int = option(0, integer(0))

    @classmethod
    def _check_together(cls, values):
        super()._check_together(values)
        if values["topk_method"] == "power" and values["top_k"] != 1:
            raise ValueError(f"topk_method='power' finds one pair: it needs top_k=1, got top_k={values['top_k']!r}")

__all__ = ["SAMuon", "spectral_prior", "gamma_at", "default_top_k", "top_singular_pairs", "power_pair",
           "samuon_direction"]


def default_top_k(m: int, n: int) -> int:
    """The paper's ``round(32 sqrt(d_model / 512))``, ``d_model = min(m, n)``, within ``[1, min(m, n)]``."""
    d = min(m, n)
    return max(1, min(d, round(32 * math.sqrt(d / 512))))


def spectral_prior(k: int, gamma: float) -> list[float]:
    """``s_i = 1 + (gamma - 1) log i / log k`` for ``i = 1..k`` (``[1.0]`` for ``k = 1``)."""
    if k == 1:
        return [1.0]
    return [1.0 + (gamma - 1.0) * math.log(i) / math.log(k) for i in range(1, k + 1)]


def gamma_at(step: int, gamma: float, warmup_steps: float) -> float:
    """``gamma`` after a cosine warmup from 1 over ``warmup_steps`` (``step`` counts from 0)."""
    if warmup_steps <= 0 or step >= warmup_steps:
        return float(gamma)
    return 1.0 + (gamma - 1.0) * 0.5 * (1.0 - math.cos(math.pi * step / warmup_steps))


def top_singular_pairs(x: Tensor, k: int, method: str = "exact", sketch: Tensor | None = None,
                       iters: int = 2) -> tuple[Tensor, Tensor]:
    """Top-``k`` left / right singular vectors ``(b, m, k)``, ``(b, n, k)`` of a batch ``x`` (``(b, m, n)``).

    ``"lowrank"`` needs ``sketch`` (``(n, q)``, ``q >= k``): ``Q = orth(X S)``, ``iters`` subspace
    steps ``Q <- orth(X orth(X^T Q))``, then the exact SVD of the small ``Q^T X``.
    """
    if method == "exact":
        u, _, vh = torch.linalg.svd(x, full_matrices=False)
        return u[..., :k], vh[..., :k, :].mT
    if method != "lowrank":
        raise ValueError(f"method must be 'exact' or 'lowrank', got {method!r}")
    q = torch.linalg.qr(x @ sketch.to(x.dtype)).Q
    for _ in range(iters):
        q = torch.linalg.qr(x @ torch.linalg.qr(x.mT @ q).Q).Q
    ub, _, vh = torch.linalg.svd(q.mT @ x, full_matrices=False)
    return (q @ ub)[..., :k], vh[..., :k, :].mT


def power_pair(x: Tensor, v: Tensor, iters: int) -> tuple[Tensor, Tensor, Tensor]:
    """Top singular pair of each ``x`` (``(b, m, n)``) by ``iters`` power steps from ``v`` (``(b, n)``).

    Returns ``(u (b, m, 1), v (b, n, 1), v_next (b, n))``. A zero matrix keeps its start vector
    (so the warm start never collapses to zero) and gives ``u = 0``.
    """
    def unit(t, fallback):
        norm = t.norm(dim=-1, keepdim=True)
        return torch.where(norm > 1e-30, t / norm.clamp_min(1e-30), fallback)

    for _ in range(iters):
        left = (x @ v.unsqueeze(-1)).squeeze(-1)
        left = left / left.norm(dim=-1, keepdim=True).clamp_min(1e-30)
        v = unit((x.mT @ left.unsqueeze(-1)).squeeze(-1), v)
    left = (x @ v.unsqueeze(-1)).squeeze(-1)
    left = left / left.norm(dim=-1, keepdim=True).clamp_min(1e-30)
    return left.unsqueeze(-1), v.unsqueeze(-1), v


def samuon_direction(o: Tensor, u: Tensor, v: Tensor, prior: Tensor, gamma: float) -> Tensor:
    """``gamma O - sum_i (gamma - s_i) u_i v_i^T`` for a batch (``o`` ``(b, m, n)``, ``u`` ``(b, m, k)``,
    ``v`` ``(b, n, k)``, ``prior`` the ``k`` values ``s_i``), in ``u``'s dtype."""
    return gamma * o.to(u.dtype) - (u * (gamma - prior)) @ v.mT


class SAMuon(_MuonFamily):
    """Spectral-Aware Muon. Args as ``Muon`` (no split) plus ``gamma`` (5.0; the paper's grid is
    3.54-14.1; 1 is Muon), ``gamma_warmup`` (0.3, the fraction of ``total_steps`` over which gamma
    rises from 1; 0: none), ``total_steps`` (the run's length; without it a warning, and no warmup),
    ``top_k`` (``None``: ``round(32 sqrt(min(m, n) / 512))``), ``topk_method`` (``"auto"``,
    ``"exact"``, ``"lowrank"``, ``"power"``), ``power_iters`` (2), ``oversample`` (8), ``seed`` (0).
    """

    algorithm = "samuon"
    Options = SAMuonOptions
    _uses_step = True
    _own_dtype_keys = ("top_v",)

    def _check_matrix_group(self, group):
        super()._check_matrix_group(group)
        g, w = group["gamma"], group["gamma_warmup"]
        if group["total_steps"] is None and g != 1 and w > 0:
            # Built without the run's length (a generic builder, a trainer that does not pass it):
            # the warmup cannot be placed, so gamma applies from the first step, and we say so.
            warnings.warn("SAMuon: total_steps not given, so gamma is not warmed up (the published method "
                          "warms it up over gamma_warmup of the run): pass total_steps", stacklevel=6)

    def _init_matrix_state(self, group):
        super()._init_matrix_state(group)
        if group["topk_method"] != "power":
            return
        for p in group["params"]:
            if "top_v" not in self.state[p]:
                gen = torch.Generator().manual_seed(group["seed"])
                v = torch.randn(p.shape[1], generator=gen, dtype=torch.float64)
                dtype = torch.float64 if p.dtype == torch.float64 else torch.float32
                self.state[p]["top_v"] = (v / v.norm()).to(device=p.device, dtype=dtype)

    def _k_and_method(self, group, m: int, n: int) -> tuple[int, str]:
        k = min(group["top_k"] or default_top_k(m, n), min(m, n))
        method = group["topk_method"]
        if method == "auto":
            method = "exact" if min(m, n) <= EXACT_UP_TO else "lowrank"
        return k, method

    def _directions(self, group, active, states, params, u):
        full = [C.gather_full(t, p) for t, p in zip(u, active)]
        outs = self._ns(group)(full)
        warm = group["gamma_warmup"] * (group["total_steps"] or 0)
        gammas = [gamma_at(st["step"], group["gamma"], warm) for st in states]
        buckets: dict[tuple, list[int]] = defaultdict(list)
        for i, g in enumerate(gammas):
            if g != 1.0:  # gamma_t = 1 is Muon: no pair is needed
                m, n = full[i].shape
                buckets[(m, n, *self._k_and_method(group, m, n), g, full[i].device)].append(i)
        for (m, n, k, method, g, device), idx in buckets.items():
            x = torch.stack([C.upcast(full[i]) for i in idx])
            if method == "power":
                v0 = torch.stack([states[i]["top_v"].to(x.dtype) for i in idx])
                left, right, v_next = power_pair(x, v0, group["power_iters"])
                for i, vn in zip(idx, v_next.unbind(0)):
                    states[i]["top_v"].copy_(vn)
            elif method == "exact":
                left, right = top_singular_pairs(x, k, "exact")
            else:  # one sketch per (step, shape): identical on every rank, torch's RNG untouched
                q = min(k + group["oversample"], m, n)
                gen = torch.Generator().manual_seed(group["seed"] * 1_000_003 + states[idx[0]]["step"])
                sketch = torch.randn(n, q, generator=gen, dtype=x.dtype).to(device)
                left, right = top_singular_pairs(x, k, "lowrank", sketch)
            prior = torch.tensor(spectral_prior(k, g), dtype=x.dtype, device=device)
            res = samuon_direction(torch.stack([outs[i] for i in idx]), left, right, prior, g)
            for i, r in zip(idx, res.unbind(0)):
                outs[i] = r
        updates = [C.local_slice(o, p) for o, p in zip(outs, active)]
        return params, updates, [C.update_scale(*p.shape, group["tau"]) for p in active]
