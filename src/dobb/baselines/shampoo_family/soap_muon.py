"""SOAP-Muon: Muon whose momentum is first preconditioned by SOAP (Adam in Shampoo's eigenbases).

The recipe is that of the modded-nanogpt optimization-track record (result #46, 2,690 steps to 3.28
against 3,250 for the tuned Muon baseline #36): ``KellerJordan/modded-nanogpt``,
``records/track_3_optimization/results/20260619_cwd_rowfloor_tailema/train_gpt_cwd_SOTA.py`` (commit
``a855e31119d7085f8478237942a442c999e29f73``, PR #328: ``Muon.step``'s SOAP branch and the functions
``soap_precondition_momentum``, ``soap_update_preconditioner``, ``soap_eigenbasis``, ``soap_basis_qr``,
``zeropower_via_newtonschulz5``; those functions are unchanged from PR #321's
``results/20260609_soap_f1_auxb2_clean/train_gpt_clean_SOTA.py``, commit ``9322310e7f9e...``, the
"SOAP-Muon on all hidden matrices" of result #44; the record applies it to every hidden matrix, its
q, k, v as three). It cites Vyas et al.'s SOAP-Muon note
(nikhilvyas.github.io/SOAP_Muon.pdf). Per matrix ``W`` (``m x n``, ``blocks`` column blocks as SOAP),
with ``mu, b2 = betas`` and ``t`` the steps before this one:

    M <- mu M + (1 - mu) G                          # Muon's momentum, in weight space
    U  = (1 - mu) G + mu M                          # Nesterov (``nesterov=False``: U = M)
    t = 0:  O = U                                   # no bases yet: plain Muon
    t > 0:  P = QL^T U QR                           # U in the current eigenbases
            V <- b2 V + (1 - b2) P^2                 # second moment of the rotated *momentum*
            O = QL [ P / sqrt(max(V, eps^2)) ] QR^T  # Adam's direction, rotated back
    W <- (1 - lr*wd) W - lr * tau*sqrt(max(m, n)) * NS(O)   # NS: Newton-Schulz of the whole matrix
    L <- s L + (1 - s) G G^T,  R <- s R + (1 - s) G^T G     # after the update, from the raw gradient
    QL, QR: eigh of L, R after the first step; then every ``precondition_frequency`` steps one
            warm-started QR power step, columns sorted by Rayleigh quotient, V permuted to follow

So: momentum lives in weight space (Muon's, Nesterov); ``L`` and ``R`` are fed by the raw gradient
(EMA ``shampoo_beta``, default ``b2``); ``V`` by the rotated Nesterov momentum ``U`` (not the gradient,
as SOAP has it); what is orthogonalised is the Adam-preconditioned momentum rotated back to weight
space. The record's settings are the defaults: ``betas=(0.95, 0.90)`` (its Muon ``mu`` peaks at .95,
its ``SOAP_BETA2=.90`` is also the ``shampoo_beta``), ``precondition_frequency=1``, ``eps=1e-8``,
no bias correction (a scalar before NS would not change ``NS(O)``), weight decay 0 in the record.
The bases, their refresh and the state follow this package's ``SOAP`` (the record's
``soap_eigenbasis``/``soap_basis_qr`` are the same steps as the SOAP authors' code).

Differences from the record, all deliberate:

* Newton-Schulz is this package's Muon kernel (``newton_schulz``: Frobenius normalisation, the
  quintic ``(3.4445, -4.7750, 2.0315)`` for 5 steps, ``ns_dtype`` "auto" = bf16 on accelerators). The
  record runs ``(2, -1.5, 0.5)`` for 12 steps in bf16, normalised by ``sqrt(||X X^T||_F)``; pass
  ``ns_coefficients=(2, -1.5, 0.5), ns_steps=12`` to take its polynomial (the normalisation stays
  Frobenius).
* The scale is the shared protocol's ``tau*sqrt(max(m, n))`` (``tau=0.2``), as Muon here; the record
  scales by ``sqrt(max(1, m/n))`` with its own lr, then applies a u/w floor, a radial brake with a
  radius pin and cautious weight decay; those are outside SOAP-Muon (not implemented). Weight decay
  is the package's decoupled one, before the update.
* The record rescales ``O`` to the norm of ``U`` before NS; NS normalises its input, so that is
  dropped. Its trust-gated blend for ``attn.proj`` (a per-module heuristic) is not implemented.
* Statistics are fp32 (fp64 for fp64 weights), as ``SOAP``.

The SOAP-Muon authors' own code (``nikhilvyas/SOAP_MUON``, ``v2.py``, commit ``88b9973553af...``) is
different again: SOAP's gradient-fed ``V`` with bias correction, and NS applied in the rotated space
followed by an entrywise ``sign(x) sqrt|x|``; this class follows the record instead.

Composition: SOAP and this class are two members of one family (``soap._SOAPFamily``) with two
directions (``_direction``): the batching of equal-shape blocks, the owner compute of sharded
matrices (FSDP2/TP through ``dobb.distribution``; NS runs on the owner, on the whole matrix), the
state dict and its DTensor checkpoints are the family's, the same as SOAP's. Unlike SOAP, the first step has an update (plain Muon), so under sharding the update
shards go back on the first step too.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..._hparams import (Rule, ScaledOptions, boolean, integer, numbers_tuple, one_of, option, optional, positive,
                         unit_interval)
from ..._hparams import betas as betas_rule
from ...functional import update_scale
from ...newton_schulz import NS_COEFFICIENTS, NS_DTYPES, NS_EPS, NS_STEPS, newton_schulz, resolve_ns_dtype
from .soap import SIDES, _blocks, _SOAPFamily, _unblock, soap_project, soap_project_back

__all__ = ["SOAPMuon", "SOAPMuonOptions", "soap_muon_direction"]


def _ns_dtype_ok(dt) -> bool:
    return (isinstance(dt, str) and (dt == "auto" or dt in NS_DTYPES)) or dt in NS_DTYPES.values()


@dataclass(frozen=True, kw_only=True)
class SOAPMuonOptions(ScaledOptions):
    """SOAP-Muon's options (the record's defaults; ``tau`` from the shared protocol)."""
    betas: tuple[float, float] = option((0.95, 0.90), betas_rule)
    shampoo_beta: float | None = option(None, optional(unit_interval))
    eps: float = option(1e-8, positive)
    precondition_frequency: int = option(1, integer(1))
    max_precondition_dim: int = option(10000, integer(1))
    blocks: int = option(1, integer(1))
    sides: str = option("both", one_of(*SIDES))
    nesterov: bool = option(True, boolean)
    ns_coefficients: tuple[float, float, float] = option(NS_COEFFICIENTS, numbers_tuple(3, "three numbers (a, b, c)"))
    ns_steps: int = option(NS_STEPS, integer(1, 99))
    ns_dtype: str | torch.dtype = option("auto", Rule(
        _ns_dtype_ok, f"be 'auto' or one of {tuple(NS_DTYPES)} (or the torch dtype)"))


def soap_muon_direction(u: Tensor, v: Tensor | None, left: Tensor | None, right: Tensor | None, b2: float,
                        eps: float) -> Tensor:
    """SOAP's preconditioning of a batch ``u`` ``(K, m, n)`` before NS: ``QL [P / sqrt(max(V, eps^2))] QR^T``
    with ``P = QL^T u QR`` and ``V <- b2 V + (1 - b2) P^2`` (``v`` updated in place). ``v=None``: no
    bases yet, ``u`` itself."""
    if v is None:
        return u
    p = soap_project(u, left, right)
    v.lerp_(p.square(), 1 - b2)
    return soap_project_back(p / v.clamp_min(eps * eps).sqrt(), left, right)


class SOAPMuon(_SOAPFamily):
    """SOAP-Muon for hidden matrices, AdamW for the rest (see the module docstring).

    Args: ``lr``, ``weight_decay`` (decoupled), ``tau`` (0.2: the protocol's ``tau*sqrt(max(m, n))``),
    ``betas`` ((0.95, 0.90): Muon's momentum ``mu`` and the rotated second moment's ``b2``),
    ``shampoo_beta`` (None: ``b2``), ``eps`` (1e-8), ``precondition_frequency`` (1), ``max_precondition_dim``
    (10000), ``blocks`` (1), ``sides`` (``"both"``), ``nesterov`` (True), ``ns_coefficients``,
    ``ns_steps``, ``ns_dtype`` (this package's Muon Newton-Schulz), ``adamw_betas``, ``adamw_eps``.
    """

    algorithm = "soap-muon"
    Options = SOAPMuonOptions
    _first_step_updates = True  # no bases yet: the first step is plain Muon

    def _scale(self, group: dict, t: int, shape: tuple | None = None) -> float:
        return update_scale(shape[0], shape[1], group["tau"])

    def _direction(self, group: dict, ps: list[Tensor], states: list[dict], grads: list[Tensor], g: Tensor,
                   ql: Tensor | None, qr: Tensor | None, t: int) -> tuple[Any, Tensor | None]:
        b = group["blocks"]
        mu, b2 = group["betas"]
        moms = [st["momentum"] for st in states]
        torch._foreach_lerp_(moms, grads, 1 - mu)
        us = [x.lerp(m, mu) for x, m in zip(grads, moms)] if group["nesterov"] else moms
        u = torch.cat([_blocks(x, b) for x in us])  # (K, m, nb)
        v = torch.cat([st["exp_avg_sq"] for st in states]) if t > 0 else None
        o = soap_muon_direction(u, v, ql, qr, b2, group["eps"])
        whole = torch.stack([_unblock(x) for x in o.split(b)])  # (len(ps), m, n): NS of each whole matrix
        dtype = resolve_ns_dtype(group["ns_dtype"], whole.device)
        out = newton_schulz(whole, group["ns_coefficients"], group["ns_steps"], NS_EPS, dtype)
        return (list(out.to(u.dtype).unbind(0)), self._scale(group, t, tuple(ps[0].shape))), v
