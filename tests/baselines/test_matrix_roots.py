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
