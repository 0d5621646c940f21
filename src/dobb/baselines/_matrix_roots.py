"""Inverse ``p``-th roots of batches of symmetric positive semi-definite matrices, ``(k, n, n)``.

Block Shampoo (``dash``) needs ``(X + eps I)^{-1/p}`` for every factor of every tile; all factors of
one size are stacked and go through one of these calls (batched ``eigh`` or ``bmm`` chains). Each
function takes and returns the input's dtype (fp32 in the optimizer, fp64 in the tests).
``newton-db`` stops at a residual tolerance when given one (``tol``; DASH passes its
``newton_tol``), reading the residual from the device once per iteration, which DASH pays only on
its preconditioner refreshes; a fixed count would leave an ill-conditioned factor far from its
root. ``coupled-newton`` runs a fixed number of iterations.

- ``inverse_root_eigh``: eigendecomposition, eigenvalues shifted as Distributed Shampoo and DASH
  do (``lambda <- lambda + eps - min(lambda_min, 0)`` after ``eigh(X + eps I)``, so a slightly
  negative rounding eigenvalue cannot blow up, and the smallest lands at ``eps`` or above).
- ``inverse_root_newton_db``: the coupled, inverse-free Newton iteration for the square root
  (``Y <- Y E``, ``Z <- E Z`` with ``E = (3I - Z Y)/2``; ``Y -> A^{1/2}``, ``Z -> A^{-1/2}``), the
  form DASH calls Newton-DB; ``p = 4`` is the inverse square root of the square root.
- ``inverse_root_coupled_newton``: Distributed Shampoo's coupled Newton iteration for any ``p``
  (``M' = (1 + 1/p) I - M/p``, ``X <- X M'``, ``M <- M'^p M``; ``X -> A^{-1/p}``).

The iterative methods need the spectrum of the scaled matrix inside their convergence region; they
divide by the Frobenius norm (an upper bound of the largest eigenvalue that costs no power
iteration and no random vector, so two runs, or two ranks, give the same bits). Eigenvalues far
below ``||X||_F`` converge slowly: in float64 with 10 steps Newton-DB resolves a condition number of
about ``1e2`` to 1e-8 and coupled Newton ``1e3`` to 1e-5; 20 steps resolve ``1e4`` for both
(tests/baselines/test_matrix_roots.py); beyond that ``eigh`` is the accurate choice.
"""
from __future__ import annotations

import warnings

import torch
from torch import Tensor

INVERSE_ROOTS = ("eigh", "newton-db", "coupled-newton")

__all__ = ["INVERSE_ROOTS", "inverse_root", "inverse_root_eigh", "inverse_root_newton_db",
           "inverse_root_coupled_newton"]


def _eye_like(x: Tensor) -> Tensor:
    return torch.eye(x.shape[-1], dtype=x.dtype, device=x.device)


def _damped(x: Tensor, eps: float) -> Tensor:
    return x + eps * _eye_like(x) if eps else x.clone()


def _fro(x: Tensor) -> Tensor:
    """``||X||_F`` per matrix as ``(k, 1, 1)``, never zero (an all-zero factor stays finite)."""
    return torch.linalg.matrix_norm(x).clamp_min(torch.finfo(x.dtype).tiny).unsqueeze(-1).unsqueeze(-1)


def inverse_root_eigh(x: Tensor, p: int = 4, eps: float = 0.0) -> Tensor:
    vals, vecs = torch.linalg.eigh(_damped(x, eps))
    vals = vals + (eps - vals.amin(dim=-1, keepdim=True).clamp(max=0))
    # Shampoo's shift makes every eigenvalue >= eps; with eps = 0 a zero eigenvalue would give inf
    vals = vals.clamp_min(torch.finfo(vals.dtype).tiny)
    return (vecs * vals.pow(-1.0 / p).unsqueeze(-2)) @ vecs.mT


def _residual(z: Tensor, y: Tensor) -> Tensor:
    """``||Z Y - I||_F / sqrt(n)`` per matrix, ``(k,)``: how far the coupled iterates are from
    inverse to each other (0 at the fixed point)."""
    n = z.shape[-1]
    return torch.linalg.matrix_norm(z @ y - _eye_like(z)) / n ** 0.5


def _coupled_sqrt(a: Tensor, steps: int, tol: float | None = None) -> tuple[Tensor, Tensor, float | None]:
    """``(A^{1/2}, A^{-1/2}, residual)`` of matrices with spectrum in ``(0, 1]`` (coupled Newton-Schulz).

    ``tol=None``: exactly ``steps`` iterations, no host read (residual ``None``). ``tol`` a number:
    each matrix iterates until its residual (``_residual``) is at most ``tol``, at most ``steps``
    times, and then stays where it is, so a matrix's result does not depend on the others of its
    batch (a sharded run batches other tiles than a single process). In finite precision the
    residual of an ill-conditioned matrix stops falling at a floor above ``tol`` (and can then grow:
    the coupled iteration is unstable far enough past it), so a matrix also stops once its residual,
    already below 0.1, fails to fall, keeping its best iterate. One host read per iteration.
    Returns the worst final residual.
    """
    eye = _eye_like(a)
    e = 1.5 * eye - 0.5 * a
    y, z = a @ e, e
    if tol is None:
        for _ in range(steps - 1):
            e = 1.5 * eye - 0.5 * (z @ y)
            y, z = y @ e, e @ z
        return y, z, None
    r = _residual(z, y)
    done = r <= tol
    for _ in range(steps - 1):
        if bool(done.all()):
            break
        e = 1.5 * eye - 0.5 * (z @ y)
        ny, nz = y @ e, e @ z
        nr = _residual(nz, ny)
        # advance while the residual falls, and anywhere above 0.1 (the early, stable phase); NaN
        # compares False, so a matrix diverging past its floor keeps its best iterate
        step = ~done & ((nr < r) | (r >= 0.1))
        stalled = ~done & ~step
        keep = ~step.view(-1, 1, 1)
        y, z, r = torch.where(keep, y, ny), torch.where(keep, z, nz), torch.where(step, nr, r)
        done = done | stalled | (r <= tol)
    return y, z, float(r.amax())


def inverse_root_newton_db(x: Tensor, p: int = 4, eps: float = 0.0, steps: int = 10,
                           tol: float | None = None) -> Tensor:
    """``(X + eps I)^{-1/p}`` for ``p`` in (2, 4) by the coupled Newton-Schulz square root.

    ``tol=None`` runs ``steps`` iterations per square root; a number stops each at that residual
    (at most ``steps`` iterations) and warns when a matrix of the batch did not get there.
    """
    if p not in (2, 4):
        raise ValueError(f"newton-db computes inverse square and fourth roots only (p in (2, 4)), got p={p}")
    a = _damped(x, eps)
    scale = _fro(a)
    sqrt_a, inv_sqrt_a, r1 = _coupled_sqrt(a / scale, steps, tol)  # of A / s: A^{1/2} = s^{1/2} Y
    if p == 2:
        _warn_unconverged(r1, tol, steps)
        return inv_sqrt_a / scale.sqrt()
    # A^{-1/4} = (A^{1/2})^{-1/2}; A^{1/2}/s^{1/2} = Y has its spectrum in (0, 1] as well
    _, inv_fourth, r2 = _coupled_sqrt(sqrt_a, steps, tol)
    _warn_unconverged(None if tol is None else max(r1, r2), tol, steps)
    return inv_fourth / scale.sqrt().sqrt()


def _warn_unconverged(residual: float | None, tol: float | None, steps: int) -> None:
    if residual is not None and not residual <= tol:
        warnings.warn(f"newton-db inverse root stopped at residual {residual:.2e} > tol {tol:.0e} "
                      f"(cap {steps} iterations, or the precision's floor for an ill-conditioned "
                      f"factor); inverse_root='eigh' is exact", RuntimeWarning, stacklevel=3)


def inverse_root_coupled_newton(x: Tensor, p: int = 4, eps: float = 0.0, steps: int = 10) -> Tensor:
    if p < 1:
        raise ValueError(f"coupled-newton needs an integer root p >= 1, got p={p}")
    a = _damped(x, eps)
    eye = _eye_like(a)
    # z = (p + 1) / (2 ||A||_F) keeps the spectrum of z A below (p + 1)/2, inside the region of
    # convergence (Distributed Shampoo's choice); X starts at z^{1/p} I so that X^{-p} M = A holds.
    z = (p + 1) / (2 * _fro(a))
    m = z * a
    xk = z.pow(1.0 / p) * eye
    for _ in range(steps):
        mid = (1 + 1.0 / p) * eye - m / p
        xk = xk @ mid
        power = torch.linalg.matrix_power(mid, p)
        m = power @ m
    return xk


def inverse_root(x: Tensor, method: str, p: int = 4, eps: float = 0.0, steps: int = 10,
                 tol: float | None = None) -> Tensor:
    """``(X + eps I)^{-1/p}`` of every matrix of ``x`` by ``method`` (one of ``INVERSE_ROOTS``);
    ``tol`` is newton-db's residual tolerance (``None``: a fixed ``steps``)."""
    if method == "eigh":
        return inverse_root_eigh(x, p, eps)
    if method == "newton-db":
        return inverse_root_newton_db(x, p, eps, steps, tol)
    if method == "coupled-newton":
        return inverse_root_coupled_newton(x, p, eps, steps)
    raise ValueError(f"inverse_root must be one of {INVERSE_ROOTS}, got {method!r}")
