"""The pure math of dobb.functional, each function against an independent reference."""
import math

import pytest
import torch

import dobb.functional as F
from _dobb_reference import dense_direction


def _orthogonal(n, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return torch.linalg.qr(torch.randn(n, n, generator=g, dtype=dtype)).Q


# ----------------------------------------------------------------------------- blocks (the partition: tests/test_partition.py)
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_householder_q_without_r_is_linalg_qr_bitwise(dtype):
    # the CPU path skips R; its Q must be torch.linalg.qr's to the bit (odd, even, tiny, batched)
    g = torch.Generator().manual_seed(7)
    for size, batch in ((1, 1), (5, 3), (8, 16), (33, 2), (64, 1)):
        p = torch.randn(batch, size, size, generator=g, dtype=dtype)
        assert torch.equal(F.qr_householder(p), torch.linalg.qr(p).Q)


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
    torch.testing.assert_close(o, dense_direction(u, sizes, bases, norm, side), atol=1e-12, rtol=0)
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


# ----------------------------------------------------------------------------- stacks (a matrix is a stack of one)
def _dense_gram_blocks(x, sizes):
    """float64 diagonal blocks of X^T X, row-stacked and zero-padded to the largest block."""
    x, out, start = x.double(), torch.zeros(sum(sizes), max(sizes), dtype=torch.float64), 0
    for s in sizes:
        out[start : start + s, :s] = x[:, start : start + s].T @ x[:, start : start + s]
        start += s
    return out


@pytest.mark.parametrize("E", [1, 3])
@pytest.mark.parametrize("sizes", [[4, 4, 4], [5, 5, 4, 4], [7]])
def test_gram_blocks_of_a_stack_match_each_matrix_dense(E, sizes):
    g = torch.Generator().manual_seed(E)
    x = torch.randn(E, 9, sum(sizes), generator=g, dtype=torch.float64)
    out = F.gram_blocks(x, sizes, torch.float64)
    assert out.shape == (E, sum(sizes), max(sizes))
    for e in range(E):
        torch.testing.assert_close(out[e], _dense_gram_blocks(x[e], sizes), atol=1e-12, rtol=0)
    # the (rows, k) form of one matrix is the stack of one
    sums, n = F.second_moment_blocks(x[0], sizes, torch.float64)
    assert n == 9 and torch.equal(sums, F.gram_blocks(x[:1], sizes, torch.float64)[0])


def test_fold_statistic_first_capture_ema_selection_and_device_keep():
    g = torch.Generator().manual_seed(0)
    stat, new = torch.randn(4, 6, 3, generator=g, dtype=torch.float64), torch.randn(4, 6, 3, generator=g, dtype=torch.float64)
    d = 0.9
    ema = d * stat + (1 - d) * new
    # every matrix chosen, none first: the EMA
    s = stat.clone()
    F.fold_statistic_(s, new, [False] * 4, [0, 1, 2, 3], d)
    torch.testing.assert_close(s, ema, atol=1e-15, rtol=0)
    # matrix 1 on its first capture (a copy), matrix 3 not chosen (kept)
    s = stat.clone()
    F.fold_statistic_(s, new, [False, True, False, False], [0, 1, 2], d)
    expected = torch.stack([ema[0], new[1], ema[2], stat[3]])
    torch.testing.assert_close(s, expected, atol=1e-15, rtol=0)
    # device flags: matrix 2 had no row on any rank, so it keeps its statistic
    s = stat.clone()
    F.fold_statistic_(s, new, [False] * 4, [0, 1, 2, 3], d, keep=torch.tensor([True, True, False, True]))
    torch.testing.assert_close(s, torch.stack([ema[0], ema[1], stat[2], ema[3]]), atol=1e-15, rtol=0)
    s = stat.clone()
    F.fold_statistic_(s, new, [False] * 4, [], d)  # nothing chosen: nothing changes
    assert torch.equal(s, stat)


def test_refresh_bases_solves_each_entry_by_its_rule_in_the_order_given():
    """Mixed sizes and rules, interleaved: each result equals its own float64 solve (eigh: diagonalizes
    A with descending eigenvalues; orthogonal iteration: ``qr(A Q0)`` of that entry alone)."""
    g = torch.Generator().manual_seed(3)

    def spd(b, s):
        x = torch.randn(b, 3 * s, s, generator=g, dtype=torch.float64)
        return x.transpose(1, 2) @ x

    entries = [(spd(2, 4), _orthogonal(4, 1).expand(2, -1, -1), False), (spd(3, 5), _orthogonal(5, 2).expand(3, -1, -1), True),
               (spd(1, 4), _orthogonal(4, 3)[None], False), (spd(2, 5), _orthogonal(5, 4).expand(2, -1, -1), False),
               (spd(1, 4), _orthogonal(4, 5)[None], True)]
    out = F.refresh_bases(entries, ortho_steps=1, qr="householder")
    assert [q.shape for q in out] == [a.shape for a, _, _ in entries]
    for (a, q0, exact), q in zip(entries, out):
        if exact:
            lam = torch.linalg.eigvalsh(a).flip(-1)
            torch.testing.assert_close(q.transpose(1, 2) @ a @ q, torch.diag_embed(lam), atol=1e-9, rtol=0)
        else:
            torch.testing.assert_close(q, torch.linalg.qr(a @ q0).Q, atol=1e-12, rtol=0)


def _stack_case(E, m, sizes, seed):
    g = torch.Generator().manual_seed(seed)
    u = torch.randn(E, m, sum(sizes), generator=g, dtype=torch.float64)
    bases = [[_orthogonal(s, 100 * seed + 10 * e + i) for i, s in enumerate(sizes)] for e in range(E)]
    stacked = torch.zeros(E, sum(sizes), max(sizes), dtype=torch.float64)
    for e in range(E):
        start = 0
        for s, q in zip(sizes, bases[e]):
            stacked[e, start : start + s, :s] = q
            start += s
    return u, bases, stacked


# the transposed small-block kernel serves a stack of one with sign; the fused decay one matrix's view
KERNELS = [("small", 1, "sign"), ("fused", 1, "sign"), ("fused", 1, "l2"),
           *[("general", E, norm) for E in (1, 3) for norm in ("sign", "l2")]]


@pytest.mark.parametrize("kernel,E,norm", KERNELS)
def test_add_directions_equals_the_float64_reference(monkeypatch, kernel, E, norm):
    """Each of the three kernels (forced), for a stack of one and of three, against the one dense
    reference: ``W <- beta W + factor * O_e`` per matrix (sign's ``1/sqrt(rows)`` is in ``factor``)."""
    monkeypatch.setattr(F, "SMALL_BLOCK", 1 << 30 if kernel == "small" else 0)
    m, sizes = 7, [4, 4, 3]
    u, bases, stacked = _stack_case(E, m, sizes, seed=E)
    w0 = torch.randn(E, m, sum(sizes), generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    w = w0.clone()
    factor, beta = -0.3, (0.9 if kernel == "fused" else None)
    for run in F.block_runs(sizes):
        cols = slice(run.start, run.stop)
        F.add_directions_([F.Blocks(w[:, :, cols], u[:, :, cols], F.stack_block_view(stacked, run), factor, beta)],
                          norm=norm, dtype=torch.float64)
    for e in range(E):
        ref = dense_direction(u[e], sizes, bases[e], norm) * (math.sqrt(m) if norm == "sign" else 1.0)
        torch.testing.assert_close(w[e], (beta or 1.0) * w0[e] + factor * ref, atol=1e-12, rtol=0)


def test_add_directions_batches_several_stacks_in_one_call():
    """The accelerator form (all items of a batch in one bmm pair) equals the items one by one."""
    m, sizes = 5, [3, 3]
    items, ws = [], []
    for E, seed in ((1, 1), (2, 2)):
        u, _, stacked = _stack_case(E, m, sizes, seed)
        w = torch.zeros(E, m, sum(sizes), dtype=torch.float64)
        ws.append(w)
        run = F.block_runs(sizes)[0]
        items.append(F.Blocks(w, u, F.stack_block_view(stacked, run), -0.5))
    F.add_directions_(items, norm="l2", dtype=torch.float64)
    for w, (_, u, q, factor, _) in zip(ws, items):
        single = torch.zeros_like(w)
        F.add_directions_([F.Blocks(single, u, q, factor)], norm="l2", dtype=torch.float64)
        torch.testing.assert_close(w, single, atol=1e-14, rtol=0)
