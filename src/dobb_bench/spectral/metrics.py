"""Spectral metrics used by the paper's analysis (Tables 1-2, Figure 2), torch only.

* ``orthogonality(O)`` = ||O||_* / (sqrt(min(m, n)) ||O||_F): 1 exactly when all singular values
  are equal (an orthogonal update, what Muon computes), 1/sqrt(min(m, n)) for rank one.
* ``effective_rank(values)`` = exp(-sum p_i log p_i), p_i = values / sum(values): the entropy
  effective rank of a spectrum, as a fraction of its length by default.
* Constructors of test matrices with a prescribed entropy effective rank, so the experiments can
  dial the spectrum: random Haar singular vectors and a power-law profile s_i = (i + 1)^-alpha with
  alpha solved by bisection. (The power law reproduces the paper's Table 1(a) to 3 decimals; a
  geometric profile exp(-beta i / k) is available as ``profile="geometric"``.)

Everything is computed in float64: these numbers are compared with the paper's three decimals.
"""
from __future__ import annotations

import math

import torch

__all__ = [
    "orthogonality",
    "effective_rank",
    "effective_rank_of_matrix",
    "effective_rank_of_psd",
    "spectrum_with_effective_rank",
    "random_orthonormal",
    "matrix_with_effective_rank",
    "psd_with_effective_rank",
]

_PROFILES = ("power", "geometric")


def _as_matrix(x, name: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or x.ndim != 2:
        raise ValueError(f"{name} must be a 2-D torch.Tensor, got "
                         f"{getattr(x, 'shape', type(x).__name__)}")
    if x.numel() == 0:
        raise ValueError(f"{name} must be non-empty, got shape {tuple(x.shape)}")
    x = x.detach().to(torch.float64)
    if not torch.isfinite(x).all():
        raise ValueError(f"{name} must be finite")
    return x


def orthogonality(O: torch.Tensor) -> float:
    """||O||_* / (sqrt(min(m, n)) ||O||_F) of a nonzero m x n matrix, in (0, 1]."""
    O = _as_matrix(O, "O")
    s = torch.linalg.svdvals(O)
    fro = torch.linalg.vector_norm(s)
    if fro == 0:
        raise ValueError("O must be nonzero")
    return float(s.sum() / (math.sqrt(min(O.shape)) * fro))


def effective_rank(values: torch.Tensor, normalize: bool = True) -> float:
    """Entropy effective rank exp(-sum p_i log p_i) of non-negative ``values``.

    ``values`` are singular values of a matrix or eigenvalues of a PSD second moment; zeros
    contribute 0 to the entropy. With ``normalize=True`` the result is a fraction of
    ``len(values)`` (the paper quotes it as a percentage of the dimension).
    """
    if not isinstance(values, torch.Tensor) or values.ndim != 1 or values.numel() == 0:
        raise ValueError("values must be a non-empty 1-D torch.Tensor")
    v = values.detach().to(torch.float64)
    if not torch.isfinite(v).all() or (v < 0).any():
        raise ValueError("values must be finite and non-negative")
    total = v.sum()
    if total == 0:
        raise ValueError("values must not all be zero")
    p = v[v > 0] / total
    erank = math.exp(float(-(p * p.log()).sum()))
    return erank / v.numel() if normalize else erank


def effective_rank_of_matrix(Y: torch.Tensor, normalize: bool = True) -> float:
    """Effective rank from the singular values of ``Y`` (fraction of min(m, n))."""
    return effective_rank(torch.linalg.svdvals(_as_matrix(Y, "Y")), normalize)


def effective_rank_of_psd(A: torch.Tensor, normalize: bool = True) -> float:
    """Effective rank from the eigenvalues (clamped at 0) of a symmetric PSD matrix ``A``.

    Rounding makes tiny negative eigenvalues of a PSD matrix; clamping them is what "zeros
    contribute 0" means for a second moment.
    """
    A = _as_matrix(A, "A")
    if A.shape[0] != A.shape[1]:
        raise ValueError(f"A must be square, got shape {tuple(A.shape)}")
    evals = torch.linalg.eigvalsh(0.5 * (A + A.T)).clamp_min(0)
    return effective_rank(evals, normalize)


def _profile_log(k: int, param: float, profile: str) -> torch.Tensor:
    i = torch.arange(k, dtype=torch.float64)
    if profile == "power":
        return -param * torch.log1p(i)
    return -param * i / k


def _profile_erank(k: int, param: float, profile: str) -> float:
    logp = torch.log_softmax(_profile_log(k, param, profile), 0)  # stable for huge decay
    return math.exp(float(-(logp.exp() * logp).sum())) / k


def spectrum_with_effective_rank(k: int, target_fraction: float, profile: str = "power") -> torch.Tensor:
    """k decreasing positive values (max 1) whose entropy effective rank is ``target_fraction``.

    Bisection on the decay parameter (power-law exponent alpha or geometric rate beta): the
    effective rank falls monotonically from 1 (flat) towards 1/k, so any target in (1/k, 1] is
    reachable; the bisection runs to ~1e-12 relative, far inside the 1% the experiments need.
    """
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be a positive int, got {k!r}")
    if profile not in _PROFILES:
        raise ValueError(f"profile must be one of {_PROFILES}, got {profile!r}")
    if not (1.0 / k < target_fraction <= 1.0) and not (k == 1 and target_fraction == 1.0):
        raise ValueError(f"target_fraction must be in (1/k, 1] = ({1.0 / k:.4g}, 1], got {target_fraction!r}")
    lo, hi = 0.0, 1.0
    while _profile_erank(k, hi, profile) > target_fraction:
        lo, hi = hi, hi * 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if _profile_erank(k, mid, profile) > target_fraction:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-13 * hi:
            break
    return _profile_log(k, 0.5 * (lo + hi), profile).exp()


def random_orthonormal(m: int, k: int, generator: torch.Generator | None = None,
                       dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """m x k matrix with Haar-distributed orthonormal columns (QR of a Gaussian, signs fixed)."""
    if k > m:
        raise ValueError(f"k must be <= m, got k={k}, m={m}")
    q, r = torch.linalg.qr(torch.randn(m, k, generator=generator, dtype=torch.float64))
    q = q * torch.where(torch.diagonal(r) < 0, -1.0, 1.0)
    return q.to(dtype)


def matrix_with_effective_rank(m: int, n: int, target_fraction: float,
                               generator: torch.Generator | None = None, *,
                               profile: str = "power", dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """m x n matrix U diag(s) V^T, random orthonormal U, V, whose singular values ``s`` have
    entropy effective rank ``target_fraction`` of min(m, n)."""
    if min(m, n) < 1:
        raise ValueError(f"m and n must be positive, got {m}, {n}")
    k = min(m, n)
    s = spectrum_with_effective_rank(k, target_fraction, profile)
    U = random_orthonormal(m, k, generator)
    V = random_orthonormal(n, k, generator)
    return ((U * s) @ V.T).to(dtype)


def psd_with_effective_rank(n: int, target_fraction: float,
                            generator: torch.Generator | None = None, *,
                            profile: str = "power", dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """n x n symmetric PSD matrix Q diag(l) Q^T, random orthogonal Q, whose eigenvalues ``l``
    have entropy effective rank ``target_fraction`` of n."""
    lam = spectrum_with_effective_rank(n, target_fraction, profile)
    Q = random_orthonormal(n, n, generator)
    A = (Q * lam) @ Q.T
    return (0.5 * (A + A.T)).to(dtype)
