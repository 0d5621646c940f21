"""The pure math of dobb.functional, each function against an independent reference."""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import dobb.functional as F


def _orthogonal(n, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return torch.linalg.qr(torch.randn(n, n, generator=g, dtype=dtype)).Q


# ----------------------------------------------------------------------------- partition
@given(size=st.integers(1, 200), blocks=st.integers(1, 200))
@settings(max_examples=200, deadline=None)
def test_block_sizes_partition_properties(size, blocks):
    if blocks > size:
        with pytest.raises(ValueError, match="blocks"):
            F.block_sizes(size, blocks)
        return
    sizes = F.block_sizes(size, blocks)
    assert sum(sizes) == size and len(sizes) == blocks
    assert max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)  # longer blocks first, as torch.tensor_split
    assert sizes == [len(c) for c in torch.arange(size).tensor_split(blocks)]


def test_block_sizes_respects_shards_uneven_and_empty():
    # 18 rows over 4 ranks (torch.chunk: 5, 5, 5, 3) and 18 rows over 8 ranks (3 x 6 and two empty).
    assert F.block_sizes(18, 4, [5, 5, 5, 3]) == [5, 5, 5, 3]
    assert F.block_sizes(18, 8, [5, 5, 5, 3]) == [3, 2, 3, 2, 3, 2, 2, 1]
    assert F.block_sizes(18, 6, [3, 3, 3, 3, 3, 3, 0, 0]) == [3] * 6
    with pytest.raises(ValueError, match=r"valid block counts: 4, 8, 12"):
        F.block_sizes(18, 6, [5, 5, 5, 3])
    assert F.valid_block_counts(18, [3, 3, 3, 3, 3, 3, 0, 0]) == [6, 12, 18]


def test_block_runs_group_equal_sizes():
    runs = F.block_runs([6, 5, 5])
    assert [(r.start, r.count, r.size) for r in runs] == [(0, 1, 6), (6, 2, 5)]


# ----------------------------------------------------------------------------- statistics
def test_second_moment_blocks_match_dense_diagonal_blocks():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 7, 16, generator=g, dtype=torch.float64)
    sizes = [6, 5, 5]
    sums, count = F.second_moment_blocks(x, sizes, torch.float64)
    dense = x.reshape(-1, 16).T @ x.reshape(-1, 16)
    assert count == 21
    start = 0
    for run in F.block_runs(sizes):
        blocks = F.block_view(sums, run)
        for i in range(run.count):
            a, b = start, start + run.size
            torch.testing.assert_close(blocks[i], dense[a:b, a:b])
            start = b


def test_identity_blocks():
    q = F.identity_blocks([3, 2])
    assert q.shape == (5, 3)
    torch.testing.assert_close(q[:3], torch.eye(3))
    torch.testing.assert_close(q[3:, :2], torch.eye(2))


# ----------------------------------------------------------------------------- QR and bases
def test_orthogonal_iteration_converges_to_known_eigenbasis():
    n = 12
    v = _orthogonal(n, 1)
    lam = 0.7 ** torch.arange(n, dtype=torch.float64)  # distinct, known spectrum
    a = (v * lam) @ v.T
    q = _orthogonal(n, 2)[None]
    for _ in range(40):
        q = F.orthogonal_iteration(a[None], q, steps=10)
    rayleigh = q[0].T @ a @ q[0]
    torch.testing.assert_close(rayleigh.diagonal(), lam, atol=1e-8, rtol=1e-6)  # descending order
    torch.testing.assert_close((q[0].T @ v).abs(), torch.eye(n, dtype=torch.float64), atol=1e-6, rtol=0)


def test_cholesky_and_householder_qr_agree():
    g = torch.Generator().manual_seed(3)
    p = torch.randn(4, 10, 10, generator=g, dtype=torch.float64)
    qh = F.qr_householder(p)
    qc, ok = F.qr_cholesky(p, rtol=1e-8)
    assert bool(ok.all())
    # Same column space column by column: Q_c^T Q_h is diagonal with entries +-1.
    torch.testing.assert_close((qc.transpose(1, 2) @ qh).abs(), torch.eye(10, dtype=torch.float64).expand(4, -1, -1),
                               atol=1e-8, rtol=0)


def test_cholesky_qr_falls_back_on_rank_deficient_blocks():
    a = torch.zeros(2, 6, 6, dtype=torch.float64)
    a[0] = torch.diag(torch.tensor([3.0, 2.0, 1.0, 0.5, 0.0, 0.0], dtype=torch.float64))  # dead units
    # a[1] is all zero: a dead block
    q0 = _orthogonal(6, 4).expand(2, -1, -1)
    _, ok = F.qr_cholesky(a @ q0)
    assert not bool(ok.any())
    q = F.orthogonal_iteration(a, q0, steps=1, qr="cholesky")
    assert torch.isfinite(q).all()
    torch.testing.assert_close(q.transpose(1, 2) @ q, torch.eye(6, dtype=torch.float64).expand(2, -1, -1), atol=1e-10, rtol=0)


def test_eigh_basis_diagonalizes():
    v = _orthogonal(8, 5)
    lam = torch.arange(1, 9, dtype=torch.float64)
    q = F.eigh_basis(((v * lam) @ v.T)[None])[0]
    torch.testing.assert_close(q.T @ ((v * lam) @ v.T) @ q, torch.diag(lam.flip(0)), atol=1e-10, rtol=0)


# ----------------------------------------------------------------------------- direction
def _dense_direction(u, sizes, bases, norm, side):
    """float64 reference, written independently of the batched code path."""
    u = u if side == "input" else u.T
    out = torch.zeros_like(u)
    start = 0
    for s, q in zip(sizes, bases):
        c = u[:, start : start + s] @ q
        if norm == "sign":
            c = torch.sign(c) / math.sqrt(u.shape[0])
        else:
            c = c / c.norm(dim=0, keepdim=True)
        out[:, start : start + s] = c @ q.T
        start += s
    return out if side == "input" else out.T


@pytest.mark.parametrize("side", ["input", "output"])
@pytest.mark.parametrize("norm", ["sign", "l2"])
@pytest.mark.parametrize("blocks", [1, 4, 3])
def test_direction_matches_dense_reference_and_norm(side, norm, blocks):
    m, n = 10, 16
    g = torch.Generator().manual_seed(blocks)
    u = torch.randn(m, n, generator=g, dtype=torch.float64)
    k = n if side == "input" else m
    sizes = F.block_sizes(k, blocks)
    bases = [_orthogonal(s, 10 + i) for i, s in enumerate(sizes)]
    stacked = torch.zeros(k, max(sizes), dtype=torch.float64)
    start = 0
    for s, q in zip(sizes, bases):
        stacked[start : start + s, :s] = q
        start += s
    o = F.direction(u, stacked, sizes, norm, side)
    torch.testing.assert_close(o, _dense_direction(u, sizes, bases, norm, side), atol=1e-12, rtol=0)
    # Table 9: ||O||_F^2 = n for the input side, m for the output side (nonzero coefficients).
    assert o.square().sum().item() == pytest.approx(k, rel=1e-10)


def test_update_scale_protocol():
    assert F.update_scale(768, 3072, 0.2) == pytest.approx(0.2 * math.sqrt(3072))
    assert F.update_scale(3072, 768, 0.2) == pytest.approx(0.2 * math.sqrt(3072))


def test_warm_started_orthogonal_iteration_keeps_an_eigh_basis():
    """One refresh with a slightly changed statistic must keep the basis (nearly) diagonalizing.

    Regression: eigh's ascending column order made the first qr(A Q) step scramble the basis
    (off-diagonal energy 0.02 -> 0.87); columns must run from the largest eigenvalue down.
    """
    g = torch.Generator().manual_seed(0)
    n = 64
    x = torch.randn(1000, n, generator=g, dtype=torch.float64) * torch.logspace(0, -2, n, dtype=torch.float64)
    a = x.T @ x / 1000
    a2 = a + 1e-3 * torch.randn(n, n, generator=g, dtype=torch.float64)
    a2 = (a2 + a2.T) / 2

    def off_diagonal(q):
        m = q.T @ a2 @ q
        return ((m - torch.diag(m.diagonal())).norm() / m.norm()).item()

    q0 = F.eigh_basis(a[None])
    q1 = F.orthogonal_iteration(a2[None], q0, steps=1)[0]
    assert off_diagonal(q1) < off_diagonal(q0[0]) < 0.05
    lam = torch.linalg.eigvalsh(a)
    torch.testing.assert_close((q0[0].T @ a @ q0[0]).diagonal(), lam.flip(0), atol=1e-12, rtol=0)
