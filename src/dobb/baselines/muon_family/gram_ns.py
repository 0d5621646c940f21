"""Gram Newton–Schulz: Muon's quintic iteration run on the Gram matrix of the short side.

Why it is exact: on the wide orientation (``X`` is ``s x l``, ``s <= l``) every NS step is
``X_{k+1} = P_k X_k`` with ``P_k = a I + b R_k + c R_k^2`` and ``R_k = X_k X_k^T``. So
``X_k = Q_k X_0`` for an ``s x s`` matrix ``Q_k``, and ``R_{k+1} = P_k R_k P_k`` (``P_k`` is
symmetric). Iterating ``(Q, R)`` and forming ``Q X_0`` once at the end gives NS5's result up to
rounding, with two ``s^2 l`` products (``R_0`` and ``Q X_0``) instead of two per step:

    NS5:  steps * (2 s^2 l + s^3)              (3072 x 768, 5 steps: 45 s^3)
    Gram: 2 s^2 l + (4 steps - 3) s^3          (3072 x 768, 5 steps: 25 s^3)

(the first step's ``P Q`` is ``P`` itself and the last step needs no new ``R``). The saving grows
with the aspect ratio; a square matrix gains nothing.

Why restarts: ``R`` is updated multiplicatively, so in bf16/fp16 its rounding error compounds
through ``Q`` (the Dion3 paper's observation). ``restarts`` lists the step indices after which
``X = Q X_0`` is formed explicitly and the iteration starts again from ``R = X X^T``, ``Q = I``
(each restart costs two more ``s^2 l`` products). In fp32/fp64 none is needed.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .newton_schulz import wide_normalized

__all__ = ["gram_newton_schulz", "GRAM_RESTARTS"]

GRAM_RESTARTS = (2,)  # after the third of five steps, for half precision


def gram_newton_schulz(x: Tensor, coefficients: Sequence[float], steps: int, eps: float,
                       dtype: torch.dtype = torch.bfloat16,
                       restarts: Sequence[int] | None = None) -> Tensor:
    """NS5 of every matrix of ``x`` (``(m, n)`` or ``(b, m, n)``) via its short-side Gram matrix.

    Same normalization, orientation and coefficients as ``newton_schulz``; returns ``dtype``.
    ``restarts=None`` means ``GRAM_RESTARTS`` for 16-bit dtypes and none otherwise.
    """
    a, b, c = coefficients
    if restarts is None:
        restarts = GRAM_RESTARTS if dtype in (torch.bfloat16, torch.float16) else ()
    restarts = set(restarts)
    y, squeeze, tall = wide_normalized(x, dtype, eps)
    s = y.size(-2)
    eye = torch.eye(s, dtype=dtype, device=y.device).expand(y.size(0), s, s)
    r = y @ y.mT
    q = None  # None stands for the identity: the first step's P Q is P
    for k in range(steps):
        p = torch.baddbmm(r, r, r, beta=b, alpha=c)  # b R + c R^2
        p = p + a * eye
        q = p if q is None else p @ q
        last = k == steps - 1
        if k in restarts and not last:
            y = q @ y
            r = y @ y.mT
            q = None
        elif not last:
            r = p @ r @ p
    y = y if q is None else q @ y
    if tall:
        y = y.mT
    return y[0] if squeeze else y
