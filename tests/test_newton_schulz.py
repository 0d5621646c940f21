"""dobb.newton_schulz: NS5 and ``orthogonalize`` against torch.optim.Muon's NS kernel (bitwise), float64 SVD
(the singular-value band) and the quintic iteration written out in float64; Gram Newton-Schulz equals NS5 (the
quintic written out in float64), and in bf16 stays within a few times NS5's own bf16 error."""
from __future__ import annotations

import pytest
import torch

from _baseline_refs import COEFFS, ns5_reference, randn, raw_update, rel
from dobb.baselines import Muon
from dobb.newton_schulz import gram_newton_schulz, newton_schulz, orthogonalize

torch_ns = pytest.importorskip("torch.optim._muon")._zeropower_via_newtonschulz
SHAPES = [(24, 24), (40, 16), (16, 40)]


@pytest.mark.parametrize("shape", SHAPES + [(64, 64)])
def test_batched_ns_equals_torch_kernel(shape):
    x = torch.randn(3, *shape, generator=torch.Generator().manual_seed(0))
    ref = torch.stack([torch_ns(t, COEFFS, 5, 1e-7) for t in x])
    assert torch.equal(newton_schulz(x), ref)  # same arithmetic, bitwise on CPU
    outs = orthogonalize(list(x) + [x[0, :7]])  # a group of 3 (batched) and a singleton (torch's)
    assert all(torch.equal(o, r) for o, r in zip(outs, ref))
    assert torch.equal(outs[3], torch_ns(x[0, :7], COEFFS, 5, 1e-7))


@pytest.mark.parametrize("shape", SHAPES)
def test_ns_singular_values_in_band(shape):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    sv = torch.linalg.svdvals(newton_schulz(x).double())
    assert sv.min() > 0.6 and sv.max() < 1.25  # NS5's quintic lands in ~[0.7, 1.2], not at 1
    o, _ = raw_update(Muon, shape, [x])
    assert 0.6**2 < o.square().sum() / min(shape) < 1.25**2  # ||O||_F^2 ~ min(m, n) (Table 9)


def test_orthogonalize_gram_option_and_validation():
    mats = [randn(16, 40, seed=i) for i in range(3)] + [randn(40, 16, seed=9)]
    outs = orthogonalize(mats, method="gram", dtype=torch.float64)
    for m, o in zip(mats, outs):
        assert o.dtype == torch.float64 and rel(o, ns5_reference(m)) < 1e-12
    with pytest.raises(ValueError, match="method"):
        orthogonalize(mats, method="svd")


# ----------------------------------------------------------------------------- the Gram form
GRAM_SHAPES = [(48, 12), (12, 48), (20, 20), (7, 30)]


@pytest.mark.parametrize("shape", GRAM_SHAPES)
@pytest.mark.parametrize("steps", [1, 2, 5])
def test_gram_ns_equals_ns5_in_float64(shape, steps):
    x = randn(3, *shape, seed=steps)
    out = gram_newton_schulz(x, COEFFS, steps, 1e-7, dtype=torch.float64)
    for i in range(3):
        assert rel(out[i], ns5_reference(x[i], steps)) < 1e-12
    # restarts change the arithmetic, not the result
    again = gram_newton_schulz(x, COEFFS, steps, 1e-7, dtype=torch.float64, restarts=(0, 1, 2, 3))
    assert rel(again, out) < 1e-12


@pytest.mark.parametrize("shape", GRAM_SHAPES)
def test_gram_ns_half_precision_within_ns5_tolerance(shape):
    """In bf16 both iterations carry rounding; the Gram one (with its restart) stays within a few
    times NS5's own bf16 error of the exact iterate, and its singular values near the exact ones."""
    x = randn(*shape, seed=3)
    exact = ns5_reference(x)
    ns_err = rel(newton_schulz(x), exact)
    gram = gram_newton_schulz(x, COEFFS, 5, 1e-7)
    assert gram.dtype == torch.bfloat16
    assert rel(gram, exact) < max(4 * ns_err, 0.02)
    sv, sv_exact = torch.linalg.svdvals(gram.double()), torch.linalg.svdvals(exact)
    assert (sv - sv_exact).abs().max() < 0.1
    fp32 = gram_newton_schulz(x, COEFFS, 5, 1e-7, dtype=torch.float32)
    assert rel(fp32, exact) < 1e-4
