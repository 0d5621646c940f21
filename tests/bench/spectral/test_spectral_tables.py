"""dobb_bench.spectral.spectral_tables: the constructions and updates behind Tables 1-2,
checked against closed forms and direct float64 computations."""
import math

import pytest
import torch

from dobb_bench.spectral import metrics
from dobb_bench.spectral import spectral_tables as S


F64 = torch.float64


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def test_power_profile_reproduces_paper_table1a_Y_column():
    # orthogonality of U diag(s) V^T depends only on s: sum(s) / (sqrt(k) ||s||), no SVD needed
    for t, (paper_y, _) in S.PAPER_1A.items():
        s = metrics.spectrum_with_effective_rank(768, t)
        assert float(s.sum() / (math.sqrt(768) * s.norm())) == pytest.approx(paper_y, abs=6e-4)


def test_table1a_rows_match_their_spectrum():
    rows = S.table1a(size=48, seeds=1, targets=(0.5,))
    s = metrics.spectrum_with_effective_rank(48, 0.5)
    assert rows[0]["Y"] == pytest.approx(float(s.sum() / (math.sqrt(48) * s.norm())), rel=1e-9)
    assert rows[0]["Y"] < rows[0]["sign(Y)"] < 1  # sign spreads the spectrum (the paper's point)
    assert rows[0]["paper Y"] == 0.412


def test_factor_has_exact_second_moment():
    Z = S.factor_with_second_moment(12, 40, 0.3, _gen())
    assert metrics.effective_rank_of_psd(Z @ Z.T / 40) == pytest.approx(0.3, rel=1e-6)
    with pytest.raises(ValueError, match="tokens"):
        S.factor_with_second_moment(12, 5, 0.3, _gen())


def test_dobb_direction_in_standard_basis_is_sign_and_column_l2():
    # A diagonal with distinct entries: eigenbasis = +-e_j, so the update is sign(U) (resp. U with
    # unit columns) whatever the eigenvector signs; the 1/sqrt(m) of the sign normalization included
    U = torch.randn(6, 8, generator=_gen(), dtype=F64)
    A = torch.diag(torch.arange(1, 9, dtype=F64))
    for B in (1, 2, 4):
        assert torch.allclose(S.dobb_direction(U, A, B, "sign"), torch.sign(U) / math.sqrt(6), atol=1e-12)
        assert torch.allclose(S.dobb_direction(U, A, B, "l2"), U / U.norm(dim=0), atol=1e-12)


def test_dobb_direction_blocks_against_dense_reference():
    m, n, B = 5, 9, 3
    U = torch.randn(m, n, generator=_gen(1), dtype=F64)
    X = torch.randn(n, 30, generator=_gen(2), dtype=F64)
    A = X @ X.T / 30
    expected = torch.zeros(m, n, dtype=F64)
    for b in range(B):  # blocks of 3 columns: eigh of the diagonal block, sign, reconstruct
        sl = slice(3 * b, 3 * b + 3)
        Q = torch.linalg.eigh(A[sl, sl]).eigenvectors
        expected[:, sl] = torch.sign(U[:, sl] @ Q) @ Q.T / math.sqrt(m)
    assert torch.allclose(S.dobb_direction(U, A, B), expected, atol=1e-10)


@pytest.mark.parametrize("shape,rank", [((10, 10), 10), ((12, 8), 2), ((8, 12), 1)])
def test_dion_direction_rank_and_norm(shape, rank):
    M = torch.randn(*shape, generator=_gen(3), dtype=F64)
    O = S.dion_direction(M, rank, _gen(4))
    assert torch.linalg.matrix_rank(O) == rank
    assert float(O.square().sum()) == pytest.approx(rank, rel=1e-10)  # ||O||_F^2 = r (SPEC 2)
    assert metrics.orthogonality(O) <= math.sqrt(rank / min(shape)) + 1e-12
    if rank == 1:
        assert metrics.orthogonality(O) == pytest.approx(1 / math.sqrt(min(shape)))


def test_table2_rows_orders_block_and_rank():
    pairs = []
    for seed in range(2):
        X = S.factor_with_second_moment(32, 64, 0.3, _gen(seed))
        D = S.factor_with_second_moment(32, 64, 0.3, _gen(seed + 10))
        pairs.append((D @ X.T, X @ X.T / 64))
    rows = S.table2_rows(pairs, blocks=(1, 4))
    assert [r["B"] for r in rows] == [1, 4]
    assert rows[1]["Dion"] <= 0.5 + 1e-9 < rows[1]["Dobb"]  # rank 8 of 32 caps Dion at sqrt(1/4)
    with pytest.raises(ValueError, match="stats"):
        S.table2_rows([])


def test_spectrum_rows_split_qkv_and_stability():
    A = torch.eye(4, dtype=F64)
    G = torch.block_diag(torch.eye(2), torch.diag(torch.tensor([1.0, 0.0])), torch.zeros(2, 2) + 1).double()
    rows = S.spectrum_rows({"blocks.1.attn.qkv": {"A": A, "G": G}}, 0.5)
    got = {(r["stat"], r["type"]): r["erank %"] for r in rows}
    assert got == pytest.approx({("A", "attn.qkv"): 100.0, ("G", "attn.q"): 100.0,
                                 ("G", "attn.k"): 50.0, ("G", "attn.v"): 50.0})
    assert all(r["layer"] == 1 for r in rows)
    rows2 = [dict(r, fraction=1.0, **{"erank %": r["erank %"] - (3.0 if r["type"] == "attn.k" else 0)}) for r in rows]
    s = S.stability(rows + rows2, since=0.5)
    assert s["pp"] == pytest.approx(3.0) and s["curve"] == "G/attn.k/1"


def test_table1b_sign_and_l2_do_not_depend_on_activation_spectrum():
    # C = D X^T Q = D V_X S_X: both normalizations cancel the positive column scaling S_X, so only
    # the raw gradient's orthogonality sees the activation effective rank (see docs/spectral.md)
    a = S.table1b(size=16, seeds=1, targets=(0.3,), act_target=0.15, tokens=32)[0]
    b = S.table1b(size=16, seeds=1, targets=(0.3,), act_target=0.8, tokens=32)[0]
    assert a["Dobb (sign)"] == pytest.approx(b["Dobb (sign)"], abs=1e-9)
    assert a["column l2"] == pytest.approx(b["column l2"], abs=1e-9)
    assert a["G"] < b["G"]
