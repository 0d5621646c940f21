"""dobb.baselines.shampoo_family._matrix_roots: each inverse root (eigh, Newton DB, coupled Newton) against SPD
matrices of known spectrum, float64."""
from __future__ import annotations

import math

import pytest
import torch

from _compare import max_diff
from dobb.baselines.shampoo_family._matrix_roots import INVERSE_ROOTS, inverse_root


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
    from dobb.baselines.shampoo_family._matrix_roots import inverse_root_newton_db
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
    from dobb.baselines.shampoo_family._matrix_roots import inverse_root_newton_db
    a, expected = spd(64, 1e4)
    with pytest.warns(RuntimeWarning, match="newton-db inverse root stopped at residual"):
        out = inverse_root_newton_db(a.float(), 4, 0.0, 5, 1e-4)  # capped at 5 iterations
    assert torch.isfinite(out).all()
    # past float32's floor (condition 1e8) the iteration would diverge: it stops at its best iterate
    a, expected = spd(64, 1e8)
    with pytest.warns(RuntimeWarning):
        out = inverse_root_newton_db(a.float(), 4, 0.0, 100, 1e-12)
    assert torch.isfinite(out).all()



# ----------------------------------------------------------------------------- in place, in tile batches
def _plain_newton_db(x, p, eps, steps):
    """The fixed-count coupled Newton-Schulz root as plain expressions, a new tensor per operation
    (the form before the kernels reused their buffers): the bitwise reference."""
    eye = torch.eye(x.shape[-1], dtype=x.dtype)
    a = x + eps * eye
    s = torch.linalg.matrix_norm(a).clamp_min(torch.finfo(x.dtype).tiny)[:, None, None]

    def sqrt(a):
        e = 1.5 * eye - 0.5 * a
        y, z = a @ e, e
        for _ in range(steps - 1):
            e = 1.5 * eye - 0.5 * (z @ y)
            y, z = y @ e, e @ z
        return y, z

    y, z = sqrt(a / s)
    if p == 2:
        return z / s.sqrt()
    return sqrt(y)[1] / s.sqrt().sqrt()


def _plain_coupled_newton(x, p, eps, steps):
    eye = torch.eye(x.shape[-1], dtype=x.dtype)
    a = x + eps * eye
    z = (p + 1) / (2 * torch.linalg.matrix_norm(a).clamp_min(torch.finfo(x.dtype).tiny)[:, None, None])
    m, xk = z * a, z.pow(1.0 / p) * eye
    for _ in range(steps):
        mid = (1 + 1.0 / p) * eye - m / p
        xk = xk @ mid
        m = torch.linalg.matrix_power(mid, p) @ m
    return xk


@pytest.mark.parametrize("n", [16, 33, 128])
@pytest.mark.parametrize("tile_batch", [None, 1, 5, 64])
def test_in_place_roots_in_tile_batches_equal_the_plain_expressions_bitwise(n, tile_batch):
    """float32 (the optimizer's factors): the buffer-reusing kernels, cut into tile batches of any
    size, give the plain expressions' bits (p = 2, 4 for Newton-DB; 1..5 for coupled Newton)."""
    gen = torch.Generator().manual_seed(n)
    g = torch.randn(19, n, 2 * n, generator=gen)
    x = g @ g.mT / n
    for p in (2, 4):
        out = inverse_root(x, "newton-db", p, 1e-6, 12, tile_batch=tile_batch)
        assert torch.equal(out, _plain_newton_db(x, p, 1e-6, 12)), (p, max_diff(out, _plain_newton_db(x, p, 1e-6, 12)))
    for p in (1, 2, 3, 4, 5):
        out = inverse_root(x, "coupled-newton", p, 1e-6, 8, tile_batch=tile_batch)
        assert torch.equal(out, _plain_coupled_newton(x, p, 1e-6, 8)), p


def test_newton_db_with_a_tolerance_is_the_same_in_any_tile_batch():
    a, expected = spd(24, 1e3, batch=11)
    a = a.float()
    whole = inverse_root(a, "newton-db", 4, 1e-6, 30, tol=1e-4, tile_batch=11)
    for tb in (1, 3, None):
        assert torch.equal(inverse_root(a, "newton-db", 4, 1e-6, 30, tol=1e-4, tile_batch=tb), whole)
    assert _rel_err(whole.double(), expected) < 1e-3


@pytest.mark.parametrize("bad", [0, -2])
def test_a_tile_batch_below_one_is_refused(bad):
    with pytest.raises(ValueError, match="tile_batch must be a positive number"):
        inverse_root(torch.eye(4)[None], "newton-db", 4, 0.0, 5, tile_batch=bad)


def test_empty_batch_gives_an_empty_root():
    for method in ("newton-db", "coupled-newton"):
        assert inverse_root(torch.zeros(0, 4, 4), method).shape == (0, 4, 4)
