"""Newton–Schulz orthogonalization (Muon's NS5) as pure, batched functions.

``newton_schulz`` is the same arithmetic as ``torch.optim._muon._zeropower_via_newtonschulz``
(bf16, transpose tall matrices, divide by the Frobenius norm, quintic steps via ``addmm``), but on
a batch ``(..., m, n)`` so that all equal-shape matrices (or blocks) of a step run as one ``bmm``
chain. On CPU the results are bitwise equal to torch's (tests check it). ``orthogonalize`` uses
torch's kernel for a matrix whose shape is unique in the step and the batched one for groups.
``NSOptions`` are the options that choose them (Muon's family, Dion2, Dion3), ``ns_options`` a
group's as ``orthogonalize``'s keyword arguments. The library's one home of these kernels: Dobb-Muon
(``dobb.core``) and the baselines both import them from here.

With the default coefficients the singular values land in about ``[0.7, 1.2]``, not exactly 1:
the quintic is tuned for a steep slope at zero, not for convergence (Jordan et al.'s Muon).

**Gram Newton–Schulz** (``gram_newton_schulz``, ``method="gram"``): Muon's quintic iteration run on
the Gram matrix of the short side.

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

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ._compiled import compiled
from ._hparams import Rule, boolean, integer, numbers_tuple, one_of, option, positive
from .functional import cpu_native

# torch >= 2.9 ships Muon (None before: the batched path for every matrix)
from ._torch_private import torch_newton_schulz as _torch_ns

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5
NS_EPS = 1e-7
NS_METHODS = ("standard", "gram")

__all__ = ["NS_COEFFICIENTS", "NS_STEPS", "NS_EPS", "NS_METHODS", "NS_DTYPES", "NSOptions", "newton_schulz",
           "orthogonalize", "ns_options", "widening_dtype", "resolve_ns_dtype", "row_normalize", "column_normalize", "wide_normalized",
           "gram_newton_schulz", "GRAM_RESTARTS"]


NS_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
             "float64": torch.float64}


def _ns_dtype_ok(dt) -> bool:
    return (isinstance(dt, str) and (dt == "auto" or dt in NS_DTYPES)) or dt in NS_DTYPES.values()


@dataclass(frozen=True, kw_only=True)
class NSOptions:
    """The Newton-Schulz options (Muon's family, Dion2, Dion3)."""
    ns_coefficients: tuple[float, float, float] = option(NS_COEFFICIENTS, numbers_tuple(3, "three numbers (a, b, c)"))
    ns_steps: int = option(NS_STEPS, integer(1, 99))
    eps: float = option(NS_EPS, positive)
    ns_method: str = option("standard", one_of(*NS_METHODS))
    ns_dtype: str | torch.dtype = option("auto", Rule(
        _ns_dtype_ok, f"be 'auto' or one of {tuple(NS_DTYPES)} (or the torch dtype)"))
    compile: bool = option(False, boolean)  # the iteration compiled by Inductor (dobb._compiled)


def resolve_ns_dtype(ns_dtype: "str | torch.dtype", device: "torch.device | str" = "cpu") -> torch.dtype:
    """The dtype Newton-Schulz runs in for ``ns_dtype`` on ``device``.

    ``"auto"`` (the default): bf16 where the device multiplies bf16 natively (accelerators; CPUs with
    AVX512-BF16/AMX, as oneDNN reports it), fp32 on other CPUs, where torch emulates bf16 products in
    a scalar loop many times slower than fp32 (docs/timing.md). A name or a dtype is taken as given
    on every device, so a test or a user can force either path anywhere.
    """
    if isinstance(ns_dtype, str) and ns_dtype != "auto":
        return NS_DTYPES[ns_dtype]
    if isinstance(ns_dtype, torch.dtype):
        return ns_dtype
    if torch.device(device).type != "cpu":
        return torch.bfloat16
    return torch.bfloat16 if cpu_native(torch.bfloat16) else torch.float32


def ns_options(group: dict[str, Any]) -> dict[str, Any]:
    """``orthogonalize`` keyword arguments of a group (``ns_dtype`` a name, ``"auto"`` or a dtype)."""
    device = group["params"][0].device if group.get("params") else "cpu"
    return dict(method=group["ns_method"], dtype=resolve_ns_dtype(group["ns_dtype"], device),
                compile=group.get("compile", False))


def wide_normalized(x: Tensor, dtype: torch.dtype, eps: float) -> tuple[Tensor, bool, bool]:
    """``x`` as a batch in ``dtype``, wide side last (``m <= n``), unit Frobenius norm per matrix.

    Returns it with whether a batch dimension was added and whether it was transposed, so the
    caller can undo both; shared by the standard and the Gram Newton-Schulz iterations."""
    squeeze = x.dim() == 2
    y = x.unsqueeze(0) if squeeze else x
    y = y.to(dtype)
    tall = y.size(-2) > y.size(-1)
    if tall:
        y = y.mT
    return y / y.norm(dim=(-2, -1), keepdim=True).clamp(min=eps), squeeze, tall


def newton_schulz(x: Tensor, coefficients: Sequence[float] = NS_COEFFICIENTS, steps: int = NS_STEPS,
                  eps: float = NS_EPS, dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """Approximate orthogonal polar factor of every matrix in ``x`` (``(m, n)`` or ``(b, m, n)``).

    Returns ``dtype`` (bf16 as torch's Muon; fp64 for exact reference comparisons). Each iteration is ``X <- a X + (b A + c A^2) X`` with ``A = X X^T`` on the wide
    orientation (so ``A`` is ``min(m, n)`` square).
    """
    a, b, c = coefficients
    y, squeeze, tall = wide_normalized(x, dtype, eps)
    for _ in range(steps):
        gram = y @ y.mT
        poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        y = torch.baddbmm(y, poly, y, beta=a)
    if tall:
        y = y.mT
    return y[0] if squeeze else y


def orthogonalize(mats: Sequence[Tensor], coefficients: Sequence[float] = NS_COEFFICIENTS,
                  steps: int = NS_STEPS, eps: float = NS_EPS, method: str = "standard",
                  dtype: torch.dtype = torch.bfloat16, compile: bool = False,
                  out_dtype: torch.dtype | None = None) -> list[Tensor]:
    """NS5 of a list of 2-D matrices: one batched call per (shape, device) group.

    ``method="gram"`` runs ``gram_newton_schulz`` (the same iteration on the short side's Gram
    matrix); ``dtype`` is the iteration's precision. A matrix alone in its group goes through
    torch's own kernel when this torch has it (standard method, bf16 only), unless ``compile``:
    then every group runs the batched iteration compiled (``dobb._compiled``). ``out_dtype``: the
    results cast to it once per group (``None``: left in ``dtype``); callers pass it only where the
    cast widens (``widening_dtype``), so it is the per-matrix cast's bits in one kernel.
    """
    if method not in NS_METHODS:
        raise ValueError(f"method must be one of {NS_METHODS}, got {method!r}")
    out: list[Tensor | None] = [None] * len(mats)
    groups: dict[tuple, list[int]] = defaultdict(list)
    for i, m in enumerate(mats):
        groups[(tuple(m.shape), m.device)].append(i)
    for idx in groups.values():
        if len(idx) == 1 and _torch_ns is not None and method == "standard" and dtype == torch.bfloat16 and not compile:
            r = _torch_ns(mats[idx[0]], tuple(coefficients), steps, eps)
            out[idx[0]] = r if out_dtype is None else r.to(out_dtype)
            continue
        stacked = torch.stack([mats[i] for i in idx])
        if method == "gram":
            res = (compiled(gram_newton_schulz) if compile else gram_newton_schulz)(stacked, coefficients, steps, eps, dtype)
        else:
            res = (compiled(newton_schulz) if compile else newton_schulz)(stacked, coefficients, steps, eps, dtype)
        if out_dtype is not None:
            res = res.to(out_dtype)
        for i, r in zip(idx, res.unbind(0)):
            out[i] = r
    return out  # type: ignore[return-value]


def widening_dtype(ns_dtype: torch.dtype, dtypes) -> torch.dtype | None:
    """The one dtype of ``dtypes`` (the weights') when casting ``ns_dtype`` results to it is exact
    (it is ``ns_dtype`` or wider), else None: ``orthogonalize``'s ``out_dtype``, which casts a
    group's stack once instead of each matrix (a narrowing cast is left to the caller, per matrix,
    where an intermediate dtype would round twice)."""
    dtypes = set(dtypes)
    if len(dtypes) != 1:
        return None
    (dt,) = dtypes
    return dt if torch.promote_types(ns_dtype, dt) == dt else None


def row_normalize(x: Tensor, eps: float = 1e-30) -> Tensor:
    """Every row scaled to unit ell2 norm (zero rows stay zero); ``||out||_F^2 = rows``."""
    sq = x.square().sum(dim=-1, keepdim=True)
    return x * torch.rsqrt(sq.clamp_min(eps))


def column_normalize(x: Tensor, eps: float = 1e-30) -> Tensor:
    """Every column scaled to unit ell2 norm (zero columns stay zero)."""
    sq = x.square().sum(dim=-2, keepdim=True)
    return x * torch.rsqrt(sq.clamp_min(eps))


# ----------------------------------------------------------------------------- the Gram form
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
