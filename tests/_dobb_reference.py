"""The one float64 reference of Dobb's direction, written densely and independently of the batched
kernels in ``dobb.functional`` (tests of ``functional``, ``_apply`` and ``Dobb`` compare against it).

``O[:, b] = normalize(U[:, b] Q_b) Q_b^T`` over the column blocks ``b`` (input side; the output side
is the input side of ``U^T``), sign normalization scaled by ``1/sqrt(rows)``, ell2 to unit columns.
"""
from __future__ import annotations

import math

import torch


def block_bases(stacked: torch.Tensor, sizes) -> list[torch.Tensor]:
    """float64 blocks of a row-stacked ``(k, s_max)`` basis."""
    out, start = [], 0
    for s in sizes:
        out.append(stacked.double()[start : start + s, :s])
        start += s
    return out


def eigh_bases(rows: torch.Tensor, sizes) -> list[torch.Tensor]:
    """Eigenvectors of each diagonal block of the second moment ``X^T X / N`` of ``rows`` (``N x k``)."""
    x, out, start = rows.double(), [], 0
    for s in sizes:
        xb = x[:, start : start + s]
        out.append(torch.linalg.eigh(xb.T @ xb / x.shape[0]).eigenvectors)
        start += s
    return out


def dense_direction(u: torch.Tensor, sizes, bases, norm: str = "sign", side: str = "input") -> torch.Tensor:
    """The float64 direction of ``u`` (``m x n``) for per-block ``bases`` (``s_b x s_b`` each) of the
    blocked axis (``n`` for ``side="input"``, ``m`` for ``"output"``)."""
    u = u.double() if side == "input" else u.double().T
    out = torch.zeros_like(u)
    start = 0
    for s, q in zip(sizes, bases):
        c = u[:, start : start + s] @ q.double()
        c = torch.sign(c) / math.sqrt(u.shape[0]) if norm == "sign" else c / c.norm(dim=0, keepdim=True)
        out[:, start : start + s] = c @ q.double().T
        start += s
    return out if side == "input" else out.T
