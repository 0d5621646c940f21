"""dobb_bench.spectral.metrics against closed forms: known spectra, orthogonal and rank-one matrices."""
import math

import pytest
import torch

from dobb_bench.spectral import metrics as M


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _with_singular_values(s, m, n, seed=0):
    U = M.random_orthonormal(m, len(s), _gen(seed))
    V = M.random_orthonormal(n, len(s), _gen(seed + 1))
    return (U * torch.as_tensor(s, dtype=torch.float64)) @ V.T


@pytest.mark.parametrize("m,n", [(8, 8), (12, 5), (5, 12)])
def test_orthogonality_of_orthonormal_is_one(m, n):
    Q = M.random_orthonormal(max(m, n), min(m, n), _gen())
    O = Q if m >= n else Q.T
    assert M.orthogonality(3.0 * O.float()) == pytest.approx(1.0, abs=1e-6)


@pytest.mark.parametrize("m,n", [(8, 8), (12, 5), (5, 12)])
def test_orthogonality_of_rank_one(m, n):
    f64 = torch.float64
    O = torch.randn(m, 1, generator=_gen(), dtype=f64) @ torch.randn(1, n, generator=_gen(1), dtype=f64)
    assert M.orthogonality(O) == pytest.approx(1 / math.sqrt(min(m, n)), rel=1e-9)


def test_orthogonality_closed_form():
    s = [4.0, 2.0, 1.0, 0.5]
    Y = _with_singular_values(s, 7, 4)
    expected = sum(s) / (math.sqrt(4) * math.sqrt(sum(x * x for x in s)))  # 7.5 / (2 * sqrt(21.25))
    assert M.orthogonality(Y) == pytest.approx(expected, rel=1e-12)


def test_orthogonality_sign_matrix_is_not_trivially_one():
    # sign(Y) of a rank-one Y is rank one: orthogonality 1/sqrt(n), a check that sign is not special-cased
    u, v = torch.randn(6, 1, generator=_gen()), torch.randn(1, 6, generator=_gen(2))
    assert M.orthogonality(torch.sign(u @ v)) == pytest.approx(1 / math.sqrt(6), rel=1e-9)


def test_effective_rank_basics():
    assert M.effective_rank(torch.ones(10)) == pytest.approx(1.0)
    assert M.effective_rank(torch.ones(10), normalize=False) == pytest.approx(10.0)
    one = torch.zeros(10)
    one[3] = 2.5
    assert M.effective_rank(one) == pytest.approx(0.1)
    # two equal values and zeros: exp(log 2) = 2 of 8
    two = torch.tensor([1.0, 1.0, 0, 0, 0, 0, 0, 0])
    assert M.effective_rank(two) == pytest.approx(2 / 8)
    # a generic spectrum against the formula written out in float64
    v = torch.tensor([3.0, 1.0, 0.5, 0.25], dtype=torch.float64)
    p = v / v.sum()
    assert M.effective_rank(v, normalize=False) == pytest.approx(math.exp(-(p * p.log()).sum().item()))


def test_effective_rank_of_matrix_and_psd():
    s = [5.0, 5.0, 0.0, 0.0]
    Y = _with_singular_values(s, 4, 6)
    assert M.effective_rank_of_matrix(Y) == pytest.approx(0.5, rel=1e-9)
    # A = Y^T Y has eigenvalues s^2 (and two zeros from the 6-4 padding): 2 of 6
    assert M.effective_rank_of_psd(Y.T @ Y) == pytest.approx(2 / 6, rel=1e-9)


@pytest.mark.parametrize("target", [0.8, 0.5, 0.2, 0.05])
@pytest.mark.parametrize("profile", ["power", "geometric"])
def test_constructors_hit_target(target, profile):
    Y = M.matrix_with_effective_rank(64, 48, target, _gen(), profile=profile)
    assert Y.shape == (64, 48)
    assert M.effective_rank_of_matrix(Y) == pytest.approx(target, rel=0.01)
    A = M.psd_with_effective_rank(40, target, _gen(1), profile=profile)
    assert torch.allclose(A, A.T)
    assert M.effective_rank_of_psd(A) == pytest.approx(target, rel=0.01)


def test_constructor_seeded_and_ordered():
    a = M.matrix_with_effective_rank(10, 10, 0.5, _gen(3))
    b = M.matrix_with_effective_rank(10, 10, 0.5, _gen(3))
    assert torch.equal(a, b)
    s = M.spectrum_with_effective_rank(20, 0.3)
    assert bool((s[1:] <= s[:-1]).all()) and s[0] == pytest.approx(1.0)
    assert M.spectrum_with_effective_rank(5, 1.0) == pytest.approx(torch.ones(5, dtype=torch.float64))


@pytest.mark.parametrize("bad,why", [(torch.zeros(3, 3), "O must be nonzero"),
                                     (torch.ones(3), r"O must be a 2-D torch.Tensor, got torch.Size\(\[3\]\)"),
                                     (torch.ones(2, 2, 2), "O must be a 2-D torch.Tensor, got torch.Size"),
                                     (torch.empty(0, 3), r"O must be non-empty, got shape \(0, 3\)"),
                                     ([[1.0]], "O must be a 2-D torch.Tensor, got list"),
                                     (torch.tensor([[float("nan")]]), "O must be finite")])
def test_orthogonality_rejects(bad, why):
    with pytest.raises(ValueError, match=f"^{why}"):
        M.orthogonality(bad)


def test_other_errors():
    for bad, why in ((torch.zeros(4), "values must not all be zero"),
                     (torch.tensor([1.0, -1.0]), "values must be finite and non-negative"),
                     (torch.tensor([1.0, float("inf")]), "values must be finite and non-negative"),
                     (torch.ones(2, 2), "values must be a non-empty 1-D torch.Tensor"),
                     (torch.tensor([]), "values must be a non-empty 1-D torch.Tensor")):
        with pytest.raises(ValueError, match=f"^{why}$"):  # the reason, not just the parameter's name
            M.effective_rank(bad)
    with pytest.raises(ValueError, match=r"^A must be square, got shape \(2, 3\)"):
        M.effective_rank_of_psd(torch.ones(2, 3))
    for t in (0.0, 0.1, 1.5, float("nan")):  # 0.1 <= 1/10 is unreachable for k = 10
        with pytest.raises(ValueError, match=r"^target_fraction must be in \(1/k, 1\] = \(0\.1, 1\], got "):
            M.spectrum_with_effective_rank(10, t)
    with pytest.raises(ValueError, match="^profile must be one of .*, got 'cubic'$"):
        M.matrix_with_effective_rank(4, 4, 0.5, profile="cubic")
