"""Inverse ``p``-th roots of batches of symmetric positive semi-definite matrices, ``(k, n, n)``.

Block Shampoo (``dash``) needs ``(X + eps I)^{-1/p}`` for every factor of every tile; all factors of
one size are stacked and go through one of these calls (batched ``eigh`` or ``bmm`` chains). Each
function takes and returns the input's dtype (fp32 in the optimizer, fp64 in the tests).
``newton-db`` stops at a residual tolerance when given one (``tol``; DASH passes its
``newton_tol``), reading the residual from the device once per iteration, which DASH pays only on
its preconditioner refreshes; a fixed count would leave an ill-conditioned factor far from its
root. ``coupled-newton`` runs a fixed number of iterations. Both iterative methods work in place: each
batch of tiles (``tile_batch`` matrices, by default as many as fit ``TILE_BATCH_BYTES`` of working
buffers) reuses one set of buffers, written by ``bmm(out=)`` and in-place ops; the numbers are those
of the plain expressions, bit for bit (tests/baselines/shampoo_family/test_matrix_roots.py).

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
(tests/baselines/shampoo_family/test_matrix_roots.py); beyond that ``eigh`` is the accurate choice.
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


def _damped(x: Tensor, eps: float, overwrite: bool = False) -> Tensor:
    """``X + eps I``: ``eps`` added to the diagonal in place, of a copy (of ``x`` itself with
    ``overwrite``). The numbers are the broadcast sum's, which re-reads an ``n x n`` identity for
    every matrix: off the diagonal ``x + 0`` is ``x`` (up to the sign of a zero, which a factor
    EMA never holds)."""
    y = x if overwrite else x.clone()
    if eps:
        y.diagonal(dim1=-2, dim2=-1).add_(eps)
    return y


def _fro(x: Tensor) -> Tensor:
    """``||X||_F`` per matrix as ``(k, 1, 1)``, never zero (an all-zero factor stays finite)."""
    return torch.linalg.matrix_norm(x).clamp_min(torch.finfo(x.dtype).tiny).unsqueeze(-1).unsqueeze(-1)


def inverse_root_eigh(x: Tensor, p: int = 4, eps: float = 0.0, overwrite: bool = False) -> Tensor:
    """``(X + eps I)^{-1/p}`` by ``eigh``; ``overwrite`` lets it damp ``x`` in place and then hold
    ``V diag(w)`` in it (two fewer batch-sized tensors: on a CPU a large one is fresh memory each time)."""
    a = _damped(x, eps, overwrite)
    vals, vecs = torch.linalg.eigh(a)
    vals = vals + (eps - vals.amin(dim=-1, keepdim=True).clamp(max=0))
    # Shampoo's shift makes every eigenvalue >= eps; with eps = 0 a zero eigenvalue would give inf
    vals = vals.clamp_min(torch.finfo(vals.dtype).tiny)
    scaled = torch.mul(vecs, vals.pow(-1.0 / p).unsqueeze(-2), out=a if overwrite else None)
    return scaled @ vecs.mT


# The bytes of working buffers one tile batch of the iterative roots may hold: about one core's L2
# plus a share of L3 on the hosts this package is timed on. A batch is cut to fit it (at least one
# matrix); each matrix's result does not depend on its batch, so the cut changes no number.
TILE_BATCH_BYTES = 4 * 2**20


def _tile_batch(x: Tensor, buffers: int, batch: int | None) -> int:
    """Matrices per batch: ``batch`` if given, else as many as fit ``buffers`` ``n x n`` working
    buffers each in ``TILE_BATCH_BYTES``."""
    if batch is not None:
        if int(batch) < 1:
            raise ValueError(f"tile_batch must be a positive number of matrices, got {batch!r}")
        return int(batch)
    per = buffers * x.shape[-1] ** 2 * x.element_size()
    return max(1, TILE_BATCH_BYTES // per)


def _residual(zy: Tensor, eye: Tensor) -> Tensor:
    """``||Z Y - I||_F / sqrt(n)`` per matrix, ``(k,)``, from the product ``Z Y``: how far the
    coupled iterates are from inverse to each other (0 at the fixed point)."""
    n = zy.shape[-1]
    return torch.linalg.matrix_norm(zy - eye) / n ** 0.5


class _Coupled:
    """Reusable buffers of the coupled Newton-Schulz square root for ``(k, n, n)`` batches: the
    iterates ``Y``, ``Z``, the product ``Z Y``, the correction ``E`` and a scratch buffer; every
    iteration writes into them (``bmm(out=)``, in-place scaling) and allocates nothing."""

    def __init__(self, k: int, n: int, like: Tensor):
        new = lambda: torch.empty((k, n, n), dtype=like.dtype, device=like.device)  # noqa: E731
        self.y, self.z, self.zy, self.e, self.tmp = new(), new(), new(), new(), new()
        self.eye = _eye_like(like)
        self.eye15 = 1.5 * self.eye  # the same bits as the expression 1.5 * I

    def correction(self, k: int) -> Tensor:
        """``E = 1.5 I - 0.5 (Z Y)`` of the first ``k`` matrices from ``zy`` (kept), into ``e``."""
        half = torch.mul(self.zy[:k], 0.5, out=self.e[:k])
        return torch.sub(self.eye15, half, out=half)

    def run(self, a: Tensor, steps: int, tol: float | None) -> tuple[Tensor, Tensor, float | None]:
        """``(A^{1/2}, A^{-1/2}, residual)`` of ``a`` (spectrum in ``(0, 1]``), as views of the
        buffers (valid until the next ``run``); see ``_coupled_sqrt``."""
        k = a.shape[0]
        y, z, zy, e, tmp = (b[:k] for b in (self.y, self.z, self.zy, self.e, self.tmp))
        torch.mul(a, 0.5, out=tmp)
        torch.sub(self.eye15, tmp, out=z)  # Z_1 = E_0 = 1.5 I - 0.5 A
        torch.bmm(a, z, out=y)  # Y_1 = A E_0
        if tol is None:
            for _ in range(steps - 1):
                torch.bmm(z, y, out=zy)
                self.correction(k)
                torch.bmm(y, e, out=tmp)
                y, tmp = tmp, y
                torch.bmm(e, z, out=tmp)
                z, tmp = tmp, z
            return y, z, None
        ny, nz = torch.empty_like(y), torch.empty_like(z)
        torch.bmm(z, y, out=zy)
        r = _residual(zy, self.eye)
        done = r <= tol
        for _ in range(steps - 1):
            if bool(done.all()):
                break
            self.correction(k)
            torch.bmm(y, e, out=ny)
            torch.bmm(e, z, out=nz)
            torch.bmm(nz, ny, out=zy)  # the residual's product is the next correction's
            nr = _residual(zy, self.eye)
            # advance while the residual falls, and anywhere above 0.1 (the early, stable phase); NaN
            # compares False, so a matrix diverging past its floor keeps its best iterate (its zy is
            # not read again: a matrix that does not advance is done)
            step = ~done & ((nr < r) | (r >= 0.1))
            stalled = ~done & ~step
            keep = ~step.view(-1, 1, 1)
            torch.where(keep, y, ny, out=y)
            torch.where(keep, z, nz, out=z)
            r = torch.where(step, nr, r)
            done = done | stalled | (r <= tol)
        return y, z, float(r.amax())


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
    y, z, r = _Coupled(a.shape[0], a.shape[-1], a).run(a, steps, tol)
    return y.clone(), z.clone(), r


def inverse_root_newton_db(x: Tensor, p: int = 4, eps: float = 0.0, steps: int = 10,
                           tol: float | None = None, tile_batch: int | None = None,
                           overwrite: bool = False) -> Tensor:
    """``(X + eps I)^{-1/p}`` for ``p`` in (2, 4) by the coupled Newton-Schulz square root.

    ``tol=None`` runs ``steps`` iterations per square root; a number stops each at that residual
    (at most ``steps`` iterations) and warns when a matrix of the batch did not get there. The
    matrices go through in batches of ``tile_batch`` (default: sized by ``TILE_BATCH_BYTES``) that
    share one set of buffers; the result is written into one output tensor. ``overwrite`` lets it
    damp and scale ``x`` in place (no copy of each batch).
    """
    if p not in (2, 4):
        raise ValueError(f"newton-db computes inverse square and fourth roots only (p in (2, 4)), got p={p}")
    k, n = x.shape[0], x.shape[-1]
    out = torch.empty_like(x)
    if k == 0:
        return out
    batch = _tile_batch(x, 8, tile_batch)
    work = _Coupled(min(batch, k), n, x)
    inner = _Coupled(min(batch, k), n, x) if p == 4 else None
    worst = None
    for lo in range(0, k, batch):
        xs = x[lo:lo + batch]
        a = _damped(xs, eps, overwrite)
        scale = _fro(a)
        a.div_(scale)  # of A / s: A^{1/2} = s^{1/2} Y
        sqrt_a, inv_sqrt_a, r = work.run(a, steps, tol)
        if p == 4:  # A^{-1/4} = (A^{1/2})^{-1/2}; A^{1/2}/s^{1/2} = Y has its spectrum in (0, 1] as well
            _, inv_sqrt_a, r2 = inner.run(sqrt_a, steps, tol)
            r = None if tol is None else max(r, r2)
            torch.div(inv_sqrt_a, scale.sqrt().sqrt(), out=out[lo:lo + batch])
        else:
            torch.div(inv_sqrt_a, scale.sqrt(), out=out[lo:lo + batch])
        worst = r if worst is None or r is None else max(worst, r)
    _warn_unconverged(worst, tol, steps)
    return out


def _warn_unconverged(residual: float | None, tol: float | None, steps: int) -> None:
    if residual is not None and not residual <= tol:
        warnings.warn(f"newton-db inverse root stopped at residual {residual:.2e} > tol {tol:.0e} "
                      f"(cap {steps} iterations, or the precision's floor for an ill-conditioned "
                      f"factor); inverse_root='eigh' is exact", RuntimeWarning, stacklevel=3)


def _free(buffers: list[Tensor], *busy: Tensor | None) -> Tensor:
    """A buffer of ``buffers`` that is none of ``busy``; a new one (kept in ``buffers``) if all are."""
    for t in buffers:
        if all(t is not b for b in busy):
            return t
    buffers.append(torch.empty_like(buffers[0]))
    return buffers[-1]


def _power(a: Tensor, p: int, out: Tensor, scratch: Tensor) -> Tensor:
    """``a^p`` (``p >= 1``) by the binary powering ``torch.linalg.matrix_power`` uses (``a a``,
    ``(a a) a``, ``(a a)(a a)``, ...; the same products in the same order), into ``out`` through
    ``scratch`` (``p`` in 1..4 and powers of two allocate nothing); ``a`` itself for ``p = 1``."""
    if p == 1:
        return a
    if p == 3:
        torch.bmm(a, a, out=scratch)
        return torch.bmm(scratch, a, out=out)
    result, z, free = None, None, [out, scratch]
    n = p
    while n > 0:
        bit, n = n % 2, n // 2
        if z is None:
            z = a
        else:
            dst = _free(free, z, result)
            torch.bmm(z, z, out=dst)
            z = dst
        if bit:
            if result is None:
                result = z
            else:
                dst = _free(free, z, result)
                torch.bmm(result, z, out=dst)
                result = dst
    return result


def inverse_root_coupled_newton(x: Tensor, p: int = 4, eps: float = 0.0, steps: int = 10,
                                tile_batch: int | None = None) -> Tensor:
    """``(X + eps I)^{-1/p}`` by Distributed Shampoo's coupled Newton iteration, ``steps``
    iterations, in batches of ``tile_batch`` matrices (default: sized by ``TILE_BATCH_BYTES``)
    whose iterates, correction and products live in buffers reused across iterations and batches."""
    if p < 1:
        raise ValueError(f"coupled-newton needs an integer root p >= 1, got p={p}")
    k, n = x.shape[0], x.shape[-1]
    out = torch.empty_like(x)
    if k == 0:
        return out
    batch = _tile_batch(x, 9, tile_batch)
    eye = _eye_like(x)
    head = (1 + 1.0 / p) * eye  # the same bits as the expression (1 + 1/p) I
    size = (min(batch, k), n, n)
    mid, xk, xn, m, mn, tmp, pw, sq = (torch.empty(size, dtype=x.dtype, device=x.device) for _ in range(8))
    # z = (p + 1) / (2 ||A||_F) keeps the spectrum of z A below (p + 1)/2, inside the region of
    # convergence (Distributed Shampoo's choice); X starts at z^{1/p} I so that X^{-p} M = A holds.
    # z^{1/p} is taken over all k at once: torch's vectorized pow rounds a lone element otherwise.
    zs = torch.cat([(p + 1) / (2 * _fro(_damped(x[lo:lo + batch], eps))) for lo in range(0, k, batch)])
    zroot = zs.pow(1.0 / p)
    for lo in range(0, k, batch):
        a = _damped(x[lo:lo + batch], eps)
        b = a.shape[0]
        z = zs[lo:lo + b]
        mb, xb, xnb, mnb, midb, tb = m[:b], xk[:b], xn[:b], mn[:b], mid[:b], tmp[:b]
        torch.mul(z, a, out=mb)
        torch.mul(zroot[lo:lo + b], eye, out=xb)
        for _ in range(steps):
            torch.div(mb, p, out=tb)
            torch.sub(head, tb, out=midb)
            torch.bmm(xb, midb, out=xnb)
            xb, xnb = xnb, xb
            torch.bmm(_power(midb, p, pw[:b], sq[:b]), mb, out=mnb)
            mb, mnb = mnb, mb
        out[lo:lo + b].copy_(xb)
    return out


def inverse_root(x: Tensor, method: str, p: int = 4, eps: float = 0.0, steps: int = 10,
                 tol: float | None = None, tile_batch: int | None = None, overwrite: bool = False) -> Tensor:
    """``(X + eps I)^{-1/p}`` of every matrix of ``x`` by ``method`` (one of ``INVERSE_ROOTS``);
    ``tol`` is newton-db's residual tolerance (``None``: a fixed ``steps``). ``overwrite=True``
    says ``x`` is the caller's scratch: ``eigh`` and ``newton-db`` then damp it in place instead of
    copying it (the same numbers; ``x`` is left holding intermediate values)."""
    if method == "eigh":
        return inverse_root_eigh(x, p, eps, overwrite)
    if method == "newton-db":
        return inverse_root_newton_db(x, p, eps, steps, tol, tile_batch, overwrite)
    if method == "coupled-newton":
        return inverse_root_coupled_newton(x, p, eps, steps, tile_batch)
    raise ValueError(f"inverse_root must be one of {INVERSE_ROOTS}, got {method!r}")
