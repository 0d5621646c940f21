"""dobb.baselines._matrix_roots: each inverse root (eigh, Newton DB, coupled Newton) against SPD
matrices of known spectrum, float64."""
from __future__ import annotations

import math

import pytest
import torch

from _compare import max_diff
from dobb.baselines._matrix_roots import INVERSE_ROOTS, inverse_root


def spd(n, cond, batch=3, seed=0):
    """``(A, A^{-1/4})`` for SPD matrices with eigenvalues log-spaced over ``cond`` (float64)."""
    gen = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(batch, n, n, generator=gen, dtype=torch.float64))
    lam = 2.0 * torch.logspace(0, -math.log10(cond), n, dtype=torch.float64)
    return (q * lam) @ q.mT, (q * lam.pow(-0.25)) @ q.mT


@pytest.mark.parametrize("method,steps,cond,tol", [
    ("eigh", 10, 1e4, 1e-12), ("newton-db", 10, 1e2, 1e-7), ("newton-db", 20, 1e4, 1e-10),
    ("coupled-newton", 10, 1e3, 1e-4), ("coupled-newton", 20, 1e4, 1e-10)])
def test_inverse_roots_match_known_spectrum(method, steps, cond, tol):
    a, expected = spd(12, cond)
    out = inverse_root(a, method, 4, 0.0, steps)
    assert ((out - expected).norm() / expected.norm()).item() < tol


@pytest.mark.parametrize("method", INVERSE_ROOTS)
def test_inverse_roots_damping_and_square_root(method):
    a, _ = spd(8, 10.0)
    vals, vecs = torch.linalg.eigh(a)
    eps = 0.3
    # eigh adds eps twice (Distributed Shampoo's shift after eigh(A + eps I)); the iterations once
    shift = 2 * eps if method == "eigh" else eps
    expected = (vecs * (vals + shift).pow(-0.5).unsqueeze(-2)) @ vecs.mT
    assert max_diff(inverse_root(a, method, 2, eps, 20), expected) < 1e-10


def test_inverse_root_rejects_unknown_method():
    with pytest.raises(ValueError, match="inverse_root must be one of"):
        inverse_root(torch.eye(2)[None], "svd")


def _rel_err(out, expected):
    return ((out.double() - expected).norm() / expected.norm()).item()


def test_newton_db_tolerance_reaches_the_root_where_a_fixed_count_stops_short():
    # float32 factors with condition number 1e4: ten iterations leave the small eigenvalues far from
    # their roots; iterating to the residual tolerance gets float32 accuracy, with no warning
    from dobb.baselines._matrix_roots import inverse_root_newton_db
    a, expected = spd(64, 1e4)
    fixed = inverse_root_newton_db(a.float(), 4, 0.0, 10)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tol = inverse_root_newton_db(a.float(), 4, 0.0, 100, 1e-4)
    assert _rel_err(fixed, expected) > 0.05
    assert _rel_err(tol, expected) < 1e-3
    # tol=None is exactly the fixed-count path; a reachable tolerance stops before the cap
    assert torch.equal(inverse_root(a.float(), "newton-db", 4, 0.0, 10), fixed)
    assert torch.equal(inverse_root_newton_db(a.float(), 4, 0.0, 1000, 1e-4), tol)


def test_newton_db_warns_when_the_tolerance_is_out_of_reach():
    from dobb.baselines._matrix_roots import inverse_root_newton_db
    a, expected = spd(64, 1e4)
    with pytest.warns(RuntimeWarning, match="newton-db inverse root stopped at residual"):
        out = inverse_root_newton_db(a.float(), 4, 0.0, 5, 1e-4)  # capped at 5 iterations
    assert torch.isfinite(out).all()
    # past float32's floor (condition 1e8) the iteration would diverge: it stops at its best iterate
    a, expected = spd(64, 1e8)
    with pytest.warns(RuntimeWarning):
        out = inverse_root_newton_db(a.float(), 4, 0.0, 100, 1e-12)
    assert torch.isfinite(out).all()

