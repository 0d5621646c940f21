"""SOAP (Vyas et al. 2024): Adam run in the eigenbases of Shampoo's factors.

Per matrix ``W`` (``m x n``) cut into ``blocks`` equal column blocks ``W_b`` (``m x n_b``; one block
by default), each block independently:

    L <- s L + (1 - s) G G^T,   R <- s R + (1 - s) G^T G          # Shampoo's factors, fp32
    QL, QR: eigenbases of L, R (first by eigh, then one warm-started QR power step every f steps)
    M <- b1 M + (1 - b1) G                                        # first moment, weight space
    V <- b2 V + (1 - b2) (QL^T G QR)^2                            # second moment, rotated space
    O  = QL [ (QL^T M QR) / (sqrt(V) + eps) ] QR^T
    W <- (1 - lr*wd) W - lr * sqrt(1 - b2^t) / (1 - b1^t) * O

A side longer than ``max_precondition_dim``, or switched off by ``sides``, keeps the identity basis
(one-sided SOAP). ``sides="input"`` keeps only the input-axis basis ``QR`` of each column block:
Dobb's blocks with Adam in place of the sign.

The details follow the authors' code as ``pytorch_optimizer.SOAP`` (4.1.0) ports it, and the tests
hold this class to that package on one to three steps: the first step only forms ``L``, ``R`` and
the bases (no update); ``t`` counts the updates; on a refresh the coordinates of ``V`` are
permuted to follow the new eigenvalue order (the basis columns are sorted by the Rayleigh quotients
of the previous basis before the QR step); the statistics and the refresh use the step's gradient
after the weight update. Two differences, both the project's convention: weight decay is applied
before the update, as ``torch.optim.AdamW`` (and this package's AdamW part) does, where the package
applies it after; and statistics are fp32 (fp64 for fp64 weights) whatever the weight dtype.

Update scale: SOAP's update is Adam's (entries of RMS below 1), so, like AdamW, it is applied with
``lr`` alone; the shared protocol's ``tau*sqrt(max(m, n))`` exists to bring orthogonalized updates
to Adam's RMS and does not apply (``tau`` is accepted and unused). Batching: every block of every
matrix of a group with the same ``(m, n_b)`` is one batch (``bmm``, batched ``eigh``/``qr``).
Sharded (DTensor) weights are refused: this class computes on whole matrices.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .._base import MatrixOptimizer, _name_of
from ..layout import is_dtensor
from .._hparams import Options, boolean, integer, one_of, option, optional, positive, unit_interval
from .._hparams import betas as betas_rule
from . import _common as C

SIDES = ("both", "input", "output")

__all__ = ["SOAP", "soap_project", "soap_project_back", "soap_initial_basis", "soap_refresh_basis", "SIDES"]


# ----------------------------------------------------------------------------- pure math
def soap_project(x: Tensor, left: Tensor | None, right: Tensor | None) -> Tensor:
    """``QL^T X QR`` for a batch ``(K, m, n)`` (a ``None`` side is the identity)."""
    if left is not None:
        x = left.mT @ x
    if right is not None:
        x = x @ right
    return x


def soap_project_back(x: Tensor, left: Tensor | None, right: Tensor | None) -> Tensor:
    """``QL X QR^T``: the inverse of ``soap_project``."""
    if left is not None:
        x = left @ x
    if right is not None:
        x = x @ right.mT
    return x


def soap_initial_basis(stat: Tensor) -> Tensor:
    """Eigenvectors of a batch of symmetric ``stat``, columns by decreasing eigenvalue.

    The tiny diagonal shift is the authors' (it only changes an exactly zero diagonal entry)."""
    eye = torch.eye(stat.shape[-1], dtype=stat.dtype, device=stat.device)
    return torch.linalg.eigh(stat + 1e-30 * eye).eigenvectors.flip(-1)


def soap_refresh_basis(stat: Tensor, basis: Tensor) -> tuple[Tensor, Tensor]:
    """One warm-started power step ``Q <- qr(stat Q)`` with the columns sorted first by their
    Rayleigh quotients ``q_j^T stat q_j`` (decreasing). Returns ``(Q_new, order)``; ``order``
    ``(K, s)`` is the permutation that the rotated second moment must follow."""
    prod = stat @ basis
    est = (basis * prod).sum(dim=-2)
    order = torch.argsort(est, dim=-1, descending=True)
    power = torch.take_along_dim(prod, order.unsqueeze(-2), dim=-1)
    return torch.linalg.qr(power).Q, order


# ----------------------------------------------------------------------------- the optimizer
def _state_dtype(p: Tensor) -> torch.dtype:
    return torch.float64 if p.dtype == torch.float64 else torch.float32


def _blocks(x: Tensor, blocks: int) -> Tensor:
    """``(m, n)`` -> ``(blocks, m, n / blocks)``: the column blocks, stacked (a copy)."""
    m, n = x.shape
    return x.reshape(m, blocks, n // blocks).permute(1, 0, 2)


def _unblock(x: Tensor) -> Tensor:
    """``(blocks, m, n_b)`` -> ``(m, blocks * n_b)``."""
    b, m, nb = x.shape
    return x.permute(1, 0, 2).reshape(m, b * nb)


@dataclass(frozen=True, kw_only=True)
class SOAPOptions(Options):
    """SOAP's options: Adam-scaled in the rotated space, so no ``tau`` (passing one is an error)."""
    betas: tuple[float, float] = option((0.95, 0.95), betas_rule)
    shampoo_beta: float | None = option(None, optional(unit_interval))
    eps: float = option(1e-8, positive)
    precondition_frequency: int = option(10, integer(1))
    max_precondition_dim: int = option(10000, integer(1))
    blocks: int = option(1, integer(1))
    sides: str = option("both", one_of(*SIDES))
    correct_bias: bool = option(True, boolean)


class SOAP(MatrixOptimizer):
    """SOAP for hidden matrices, AdamW for the rest (see the module docstring).

    Args: ``lr``, ``weight_decay`` (decoupled), ``betas`` ((0.95, 0.95), Adam's in the rotated
    space), ``shampoo_beta`` (None: ``betas[1]``; the EMA of ``L`` and ``R``), ``eps`` (1e-8),
    ``precondition_frequency`` (10: steps between basis refreshes), ``max_precondition_dim``
    (10000: a longer side keeps the identity), ``blocks`` (1: equal column blocks, each its own
    SOAP; must divide ``n``), ``sides`` (``"both"``; ``"input"``: only ``R``; ``"output"``: only
    ``L``), ``correct_bias`` (True), ``adamw_betas``, ``adamw_eps``. It takes no ``tau`` (Adam-scaled).
    """

    algorithm = "soap"
    Options = SOAPOptions
    # fp32 statistics stay fp32 when a bf16 model resumes
    _own_dtype_keys = ("momentum", "exp_avg_sq", "stat_left", "stat_right", "basis_left", "basis_right")

    def _check_matrix_group(self, group: dict[str, Any]) -> None:
        for i, p in enumerate(group["params"]):
            name = _name_of(p, self._param_names, i)
            if is_dtensor(p):
                raise ValueError(f"{name} is a DTensor: SOAP computes on whole matrices and does not shard; "
                                 f"use it on plain (DDP-replicated) weights")
            n, b = p.shape[-1], group["blocks"]
            if n % b:
                valid = [d for d in range(1, n + 1) if n % d == 0]
                raise ValueError(f"{name}: blocks={b} must divide the input axis ({n}); valid blocks: {valid}")

    def _sides(self, group: dict, m: int, nb: int) -> tuple[bool, bool]:
        """Whether the left (``m x m``) and right (``n_b x n_b``) sides are preconditioned."""
        limit = group["max_precondition_dim"]
        left = group["sides"] in ("both", "output") and m <= limit
        right = group["sides"] in ("both", "input") and nb <= limit
        return left, right

    def _init_matrix_state(self, group: dict[str, Any]) -> None:
        for p in group["params"]:
            if "momentum" in self.state[p]:
                continue
            m, n = p.shape
            b = group["blocks"]
            nb = n // b
            left, right = self._sides(group, m, nb)
            kw = dict(dtype=_state_dtype(p), device=p.device)
            sl, sr = (m if left else 0), (nb if right else 0)
            # Eager and identical on every rank (distributed checkpoints load only into existing state);
            # a side without a basis keeps an empty (b, 0, 0) tensor so the key set never varies.
            self.state[p].update(
                step=0,
                momentum=torch.zeros(m, n, **kw),
                exp_avg_sq=torch.zeros(b, m, nb, **kw),
                stat_left=torch.zeros(b, sl, sl, **kw),
                stat_right=torch.zeros(b, sr, sr, **kw),
                basis_left=torch.zeros(b, sl, sl, **kw),
                basis_right=torch.zeros(b, sr, sr, **kw),
            )

    def _matrix_step(self, group: dict[str, Any], active: list[Tensor]) -> None:
        b = group["blocks"]
        buckets: dict[tuple, list[Tensor]] = defaultdict(list)
        for p in active:
            # equal block shapes at the same step count share one batch (the step sets the bias
            # correction and the refresh; all matrices of a group normally share it)
            buckets[(p.shape[0], p.shape[1] // b, _state_dtype(p), p.device, self.state[p]["step"])].append(p)
        params, updates, scales = [], [], []
        for (m, nb, dtype, _, step), ps in buckets.items():
            out = self._bucket_step(group, ps, m, nb, dtype, step)
            if out is not None:
                params += ps
                updates += out[0]
                scales += [out[1]] * len(ps)
        C.apply_protocol(params, params, updates, scales, group["lr"], group["weight_decay"])

    def _bucket_step(self, group: dict, ps: list[Tensor], m: int, nb: int, dtype: torch.dtype, t: int):
        """One step of the matrices ``ps`` (equal shapes, step count ``t``): returns their updates
        and the bias-correction factor, or None on the first step (statistics and bases only)."""
        b = group["blocks"]
        b1, b2 = group["betas"]
        sb = b2 if group["shampoo_beta"] is None else group["shampoo_beta"]
        left, right = self._sides(group, m, nb)
        states = [self.state[p] for p in ps]
        grads = [p.grad.to(dtype) for p in ps]
        g = torch.cat([_blocks(x, b) for x in grads])  # (K, m, nb), K = len(ps) * b
        cat = lambda key: torch.cat([st[key] for st in states])  # noqa: E731
        sl, sr = (cat("stat_left") if left else None), (cat("stat_right") if right else None)
        ql, qr = (cat("basis_left") if left else None), (cat("basis_right") if right else None)
        result = None
        if t > 0:
            moms = [st["momentum"] for st in states]
            torch._foreach_lerp_(moms, grads, 1 - b1)
            v = cat("exp_avg_sq")
            v.lerp_(soap_project(g, ql, qr).square(), 1 - b2)
            mp = soap_project(torch.cat([_blocks(x, b) for x in moms]), ql, qr)
            o = soap_project_back(mp / v.sqrt().add_(group["eps"]), ql, qr)
            scale = (1 - b2 ** t) ** 0.5 / (1 - b1 ** t) if group["correct_bias"] else 1.0
            result = ([_unblock(x) for x in o.split(b)], scale)
        # Shampoo's factors from this step's gradient; the bases follow (first step: eigh).
        if sl is not None:
            sl.lerp_(g @ g.mT, 1 - sb)
        if sr is not None:
            sr.lerp_(g.mT @ g, 1 - sb)
        if t == 0:
            ql = soap_initial_basis(sl) if left else None
            qr = soap_initial_basis(sr) if right else None
        elif t % group["precondition_frequency"] == 0:
            if left:
                ql, order = soap_refresh_basis(sl, ql)
                v = torch.take_along_dim(v, order.unsqueeze(-1), dim=-2)  # rows follow the new order
            if right:
                qr, order = soap_refresh_basis(sr, qr)
                v = torch.take_along_dim(v, order.unsqueeze(-2), dim=-1)  # columns likewise
        for key, value in (("stat_left", sl), ("stat_right", sr), ("basis_left", ql), ("basis_right", qr),
                           ("exp_avg_sq", v if t > 0 else None)):
            if value is not None:
                torch._foreach_copy_([st[key] for st in states], list(value.split(b)))
        for st in states:
            st["step"] += 1
        return result
